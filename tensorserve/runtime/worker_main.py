"""A model's worker process: ``python -m tensorserve.runtime.worker_main FD``.

Started by ``ProcessExecutor`` (``isolation = "process"``) with one end of a
socketpair as file descriptor FD. The first message says which model to
load and how; the worker loads it itself (model.py, safetensors weights),
answers ``ready`` (or the reason it could not), then runs one padded batch
per message with the same ``ThreadExecutor`` the threads use, on its own main
thread, holding its own GIL. On CUDA a batch's inputs are copied into pinned
memory first, and a batch that is already waiting on the socket is launched
before the one ahead of it is collected (two in flight,
``worker_pipeline.py``); on a CPU it runs one batch at a time. It exits when
the server closes the socket, whether the server stopped or died.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tensorserve.errors import (
    BatchOutOfMemory,
    ConfigError,
    DeviceLost,
    RowErrors,
    as_model_failure,
)
from tensorserve.ipc import messages as ipc
from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.repository.loader import ModelSource, load_model
from tensorserve.runtime.device import pinned, resolve_device
from tensorserve.runtime.executor import Launched, ThreadExecutor, on_device
from tensorserve.runtime.ragged import flat_rows
from tensorserve.runtime.worker_pipeline import WorkerPorts, serve
from tensorserve.tensors.dtypes import as_feature

log = logging.getLogger("tensorserve.worker")

Loaded = tuple[ModelConfig, ThreadExecutor]  # a model's config, and the executor it runs in


def _load(hello: dict[str, Any]) -> Loaded:
    name, version, threads = hello["name"], hello["version"], hello["intra_op_threads"]
    config = parse_config(hello["config"], f"{name} (worker)")
    source = ModelSource(name, Path(hello["path"]), (version,))
    device = resolve_device(config.device)
    if device.type == "cuda":
        # Before model.py runs: a tensor it creates on a bare "cuda" lands on
        # the current GPU, which must be this worker's, not GPU 0.
        torch.cuda.set_device(device)
    loaded = load_model(source, version, config, threads)
    module = on_device(loaded.module, config, device)
    return config, ThreadExecutor(module, config, device, intra_op_threads=threads, name=name)


@dataclass
class Started:
    """A batch the worker took: launched, or answered already (its launch failed)."""

    launched: Launched | None
    reply: ipc.Message | None  # the batch's answer, when launch failed
    clock: float  # perf_counter() when it was taken (a CPU's batch time)


def _start(
    config: ModelConfig,
    executor: ThreadExecutor,
    features: dict[str, np.ndarray],
    parameters: dict[str, list[Any]] | None,
) -> Started:
    """Launch one batch as it came from the socket: on CUDA, its inputs
    copied into pinned memory first (``device.pinned``), so the copies to
    the device are queued on the instance's stream with the forward."""
    # Every tensor forward takes: the inputs, and a packed batch's batch inputs.
    forward_takes = [(s.name, s.dt) for s in config.input]
    forward_takes += [(b.name, b.dt) for b in config.batch_input]
    padded = {name: as_feature(features[name], dt) for name, dt in forward_takes}
    clock = time.perf_counter()
    try:
        staged = pinned(padded) if executor.pin_memory else padded
        return Started(executor.launch(staged, 0, parameters), None, clock)
    except Exception as exc:  # noqa: BLE001 - answered for this batch only (_failed)
        return Started(None, _failed(exc, executor), clock)


def _finish(executor: ThreadExecutor, started: Started) -> ipc.Message:
    """Reply to one batch: its outputs, one result per item, or the error;
    per-row output parameters (plain scalars) ride in the reply's header."""
    if started.launched is None:
        assert started.reply is not None
        return started.reply
    try:
        executed = executor.collect(started.launched)
    except Exception as exc:  # noqa: BLE001 - answered for this batch only (_failed)
        return _failed(exc, executor)
    # On CUDA, the GPU's time between the batch's events: a batch launched
    # behind another waits for it on the stream, which a host clock would
    # count as its own. On a CPU, the host's time from launch to here.
    seconds = executed.seconds if started.launched.started is not None else None
    if seconds is None:
        seconds = time.perf_counter() - started.clock
    returned: dict[str, Any] = {}
    if executed.parameters is not None:
        returned["parameters"] = executed.parameters
    if executed.captured:  # its seconds are a CUDA graph's capture, no batch's cost
        returned["captured"] = True
    try:
        if executed.per_item is None:
            assert executed.batched is not None
            return {"seconds": seconds, **returned}, flat_rows(executed.batched)
        failed: list[tuple[int, str]] = []  # msgpack maps take string keys only
        tensors: dict[str, np.ndarray] = {}
        for i, result in enumerate(executed.per_item):
            if isinstance(result, BaseException):
                failed.append((i, as_model_failure(result, executor.label).message))
            else:
                tensors.update({f"{i}/{key}": value for key, value in result.items()})
        header = {"items": len(executed.per_item), "failed": failed, "seconds": seconds}
        return {**header, **returned}, tensors
    except Exception as exc:  # noqa: BLE001 - answered for this batch only (_failed)
        return _failed(exc, executor)


def _failed(exc: Exception, executor: ThreadExecutor) -> ipc.Message:
    """A failed batch's reply. ``DeviceLost`` is raised again: the worker exits."""
    if isinstance(exc, BatchOutOfMemory):  # the server splits the batch and lowers its ceiling
        return {"error": exc.message, "kind": "oom"}, {}
    if isinstance(exc, RowErrors):  # some rows failed: the server runs the others again
        return {"error": str(exc), "kind": "rows", "rows": sorted(exc.errors.items())}, {}
    if isinstance(exc, DeviceLost):
        raise exc
    return {"error": as_model_failure(exc, executor.label).message}, {}  # the model failed


def _run_batch(
    config: ModelConfig,
    executor: ThreadExecutor,
    features: dict[str, np.ndarray],
    parameters: dict[str, list[Any]] | None,
) -> ipc.Message:
    """One batch from the socket to its reply, alone: the path ``_load_and_run``
    takes for each batch (benchmarks/gpu_check_cuda.py profiles its copies)."""
    return _finish(executor, _start(config, executor, features, parameters))


def _load_and_run(sock: socket.socket, hello: dict[str, Any], loaded: Loaded | None) -> int:
    """Load the model (unless the template had), answer ready or why not,
    then run batches until the server closes the socket: on CUDA, up to the
    hello's ``batches_in_flight`` at once (worker_pipeline.py)."""
    try:
        config, executor = loaded if loaded is not None else _load(hello)
        executor.start_instance(0)  # threads, inference mode, CUDA stream: on this thread
    except Exception as exc:  # noqa: BLE001 - any load failure is told to the server
        ipc.send(sock, {"error": _reason(exc)})
        # start_instance's timing met a sticky CUDA error: the context is lost.
        return ipc.EXIT_DEVICE_LOST if isinstance(exc, DeviceLost) else 1
    ipc.send(sock, {"ready": True, "pid": os.getpid()})
    # On a CPU, launch runs the batch to the end: one at a time.
    depth = hello.get("batches_in_flight", 1) if executor.overlaps else 1
    poller = select.poll()
    # The socket's end (POLLHUP) counts as waiting too: recv then says so.
    # A batch whose first bytes are in is read whole (blocking): the server
    # writes each message as fast as the socket takes it.
    poller.register(sock, select.POLLIN)
    ports = WorkerPorts(
        recv=lambda: ipc.recv(sock),
        waiting=lambda: bool(poller.poll(0)),
        launch=lambda message: _start(config, executor, message[1], message[0].get("parameters")),
        collect=lambda started: _finish(executor, started),
        send=lambda reply: ipc.send(sock, *reply),
    )
    try:
        serve(ports, depth)
    except DeviceLost as exc:
        # Every later batch would fail the same way: the server replaces this
        # worker, and fails or runs again every batch it had sent here.
        log.error("%s; this worker exits and the server replaces it", exc.message)
        logging.shutdown()
        os._exit(ipc.EXIT_DEVICE_LOST)
    return 0


def _log_as(hello: dict[str, Any]) -> None:
    logging.basicConfig(
        level=hello.get("log_level", "INFO"),
        format=f"%(asctime)s %(levelname)s %(name)s[{hello['name']}:{os.getpid()}]: %(message)s",
        force=True,
    )


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"


def template(control: socket.socket) -> int:
    """The worker template (runtime/template.py, which says why each fork is
    safe): load models on request, and fork a worker per request."""
    import msgpack

    torch.set_num_threads(1)
    hello = msgpack.unpackb(socket.recv_fds(control, 1 << 16, 0)[0])
    _log_as({"name": "template", **hello})
    models: dict[str, Loaded | None] = {}  # None: each worker loads it after the fork
    exited: dict[int, int] = {}

    def reap(*_: object) -> None:
        with contextlib.suppress(ChildProcessError):  # no child is left
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    return  # none more has exited
                exited[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    socket.send_fds(control, [msgpack.packb({"ready": True, "pid": os.getpid()})], [])
    while True:
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        if not data:
            return 0  # the server closed its end
        request = msgpack.unpackb(data)
        reply: dict[str, Any] = {}
        if "status" in request:
            reap()
            reply = {"returncode": exited.pop(request["status"], None)}
        elif "load" in request:
            try:
                model = request["hello"]
                models[request["load"]] = _load(model) if model.get("template_loads") else None
            except Exception as exc:  # noqa: BLE001 - any load failure is told to the server
                reply = {"error": _reason(exc)}
        elif "drop" in request:
            models.pop(request["drop"], None)
        else:
            reply = {"pid": _fork_worker(control, socket.socket(fileno=fds[0]), models)}
        socket.send_fds(control, [msgpack.packb(reply)], [])


def _fork_worker(
    control: socket.socket, sock: socket.socket, models: dict[str, Loaded | None]
) -> int:
    # Out of the collector's sight: a collection in the worker would otherwise
    # write to every object the template made (all its models'), copying each
    # page it touches; measured, a swapped-in spare's first answer took ~15 ms
    # more without it (docs/threading.md, "One template, one spare").
    gc.freeze()
    pid = os.fork()
    if pid:
        sock.close()
        return pid
    code = 1
    try:  # the worker: never returns into the template's loop
        control.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            ipc.send(sock, {"forked": os.getpid()})  # running: a spare is ready from now on
            hello, _ = ipc.recv(sock)  # which model: now, or when a spare is taken
        except (EOFError, ConnectionError):
            hello = {"stop": True}
        if hello.get("stop"):
            code = 0  # a spare stopped before any model took it
        else:
            _log_as(hello)
            code = _load_and_run(sock, hello, models.get(hello.get("key", "")))
    finally:
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # Ctrl-C reaches the whole process group; the server decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")
    if args[0] == "--template":
        with socket.socket(fileno=int(args[1])) as control:
            return template(control)
    with socket.socket(fileno=int(args[0])) as sock:
        hello, _ = ipc.recv(sock)
        _log_as(hello)
        return _load_and_run(sock, hello, None)


if __name__ == "__main__":
    sys.exit(main())

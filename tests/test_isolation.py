"""Models in worker processes (``isolation = "process"``): the same answers as
in a thread, failures that stay with their batch, workers that die and come
back, and no worker left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import psutil
import pytest
import torch

from tensorserve import ModelFailure, ServedModel
from tensorserve.errors import ConfigError
from tensorserve.ipc import messages as ipc
from tests.conftest import REPOSITORY, ServerProcess
from tests.helpers import (
    ECHO,
    MSGPACK,
    POISON_MODEL,
    body,
    from_wire,
    token_item,
    wait_until,
    wait_until_async,
    write_toy_model,
)

pytestmark = pytest.mark.timeout(120)
rng = np.random.default_rng(7)


def _alive(pid: int) -> bool:
    """Running, for our purposes: a zombie has gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(model: ServedModel) -> list[int]:
    return [w.pid for w in model.executor.workers]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["tagger", "image_filter", "embedder"])
def test_a_worker_process_gives_the_same_rows_as_a_model_thread(name: str) -> None:
    lengths = [int(n) for n in rng.integers(3, 40, size=12)]
    if name == "image_filter":
        batch = [{"image": rng.normal(size=(n, n // 2 + 2)).astype(np.float32)} for n in lengths]
    else:
        batch = [token_item(n, rng) for n in lengths]
    with ServedModel.from_repository(REPOSITORY, name) as here:
        expected = here.infer_many_sync(batch)
    with ServedModel.from_repository(REPOSITORY, name, isolation="process") as isolated:
        assert _pids(isolated)[0] != os.getpid()
        got = isolated.infer_many_sync(batch)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].shape == b[key].shape and a[key].dtype == b[key].dtype
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_pipelined_batches_through_a_worker_never_reorder_or_lose_items() -> None:
    items = [token_item(int(n), rng) for n in rng.integers(8, 128, size=200)]
    with ServedModel.from_repository(REPOSITORY, "tagger") as here:
        expected = here.infer_many_sync(items)
    # A tight budget cuts batches short of what waits: batches are formed and
    # sent ahead while the worker still runs the previous one.
    with ServedModel.from_repository(
        REPOSITORY, "tagger", isolation="process", max_batch_tokens=512
    ) as isolated, ThreadPoolExecutor(32) as pool:
        got = list(pool.map(isolated.infer_sync, items))
        assert isolated.stats.snapshot(0)["total_batches"] > 10
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a["logits"], b["logits"], rtol=1e-5, atol=1e-6)


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    process = {**ECHO, "isolation": "process"}
    write_toy_model(tmp_path, "poison", POISON_MODEL, **process)
    write_toy_model(tmp_path, "mortal", """
        import os, signal, torch

        class Model(torch.nn.Module):
            def forward(self, x):
                if (x == 7).any():
                    os._exit(7)
                if (x == 9).any():
                    os.kill(os.getpid(), signal.SIGKILL)
                return x * 2
    """, **process)
    write_toy_model(tmp_path, "per_item", """
        import torch

        class Model(torch.nn.Module):
            def forward(self, x):
                return [ValueError("negative start") if row[0, 0] < 0 else {"y": row} for row in x]
    """, **process)
    write_toy_model(tmp_path, "sleepy", """
        import time, torch

        class Model(torch.nn.Module):
            def forward(self, x):
                time.sleep(0.05)  # the behaviour under test: a batch takes 50 ms
                return x
    """, **{**process, "max_batch_size": 2})
    write_toy_model(tmp_path, "broken", """
        import torch
        raise ImportError("no such helper")
    """, **process)
    write_toy_model(tmp_path, "halves", """
        import torch

        class Model(torch.nn.Module):
            def forward(self, x):
                return x / 2
    """, isolation="process", max_batch_size=8,
        inputs={"x": {"dtype": "bfloat16", "shape": [-1]}},
        outputs={"y": {"dtype": "bfloat16", "shape": [-1]}})
    return tmp_path


def _x(value: float, length: int = 3) -> dict[str, np.ndarray]:
    return {"x": np.full((length, 4), value, np.float32)}


def test_a_model_that_raises_in_its_worker_fails_its_batch_only(toy_repo: Path) -> None:
    with ServedModel.from_repository(toy_repo, "poison") as model:
        pid = _pids(model)[0]
        with pytest.raises(ModelFailure, match="model 'poison' failed: RuntimeError: poison value 13"):
            model.infer_sync(_x(13))
        assert model.infer_sync(_x(2))["y"].tolist() == [[4.0] * 4] * 3
        assert _pids(model) == [pid]  # an exception is not a crash


def test_a_per_item_error_list_crosses_the_process_boundary(toy_repo: Path) -> None:
    with ServedModel.from_repository(toy_repo, "per_item", max_queue_delay_ms=200,
                                     dispatch="timer") as model:
        futures = model.submit_many([_x(1.0), _x(-1.0, 2), _x(3.0, 5)])
        # A per-item list is the model's own rows: padded, as in a thread.
        np.testing.assert_array_equal(futures[0].result(10)["y"][:3], _x(1.0)["x"])
        with pytest.raises(ModelFailure, match="ValueError: negative start"):
            futures[1].result(10)
        np.testing.assert_array_equal(futures[2].result(10)["y"], _x(3.0, 5)["x"])


@pytest.mark.parametrize(("poison", "how"), [(7, "exit code 7"), (9, "killed by signal SIGKILL")])
def test_a_worker_that_dies_fails_its_batch_and_a_new_one_serves_the_next(
    toy_repo: Path, poison: int, how: str
) -> None:
    with ServedModel.from_repository(toy_repo, "mortal") as model:
        first = _pids(model)[0]
        with pytest.raises(ModelFailure, match=rf"died while running this batch \({how}\)"):
            model.infer_sync(_x(poison))
        assert not _alive(first)
        assert model.infer_sync(_x(1))["y"].tolist() == [[2.0] * 4] * 3
        assert _pids(model)[0] not in (None, first)


def test_batch_duration_is_the_workers_own_time_not_the_wait_behind_a_batch_ahead(
    toy_repo: Path,
) -> None:
    with ServedModel.from_repository(toy_repo, "sleepy", policy="fifo") as model:
        # Three full batches of 2: batches 2 and 3 are sent while 1 runs, so
        # launch-to-collect would be ~100 ms for them; the model takes 50.
        futures = model.submit_many([_x(float(i)) for i in range(6)])
        assert [f.result(10)["y"][0, 0] for f in futures] == [float(i) for i in range(6)]
        stats = model.stats.snapshot(0)
    assert stats["total_batches"] == 3
    assert 45 <= stats["avg_batch_duration_ms"] < 75


def test_a_model_that_cannot_load_in_its_worker_reports_why(toy_repo: Path) -> None:
    with pytest.raises(ConfigError, match="import failed: ImportError: no such helper"):
        ServedModel.from_repository(toy_repo, "broken")


def test_bfloat16_crosses_the_process_boundary_as_its_bit_patterns(toy_repo: Path) -> None:
    values = torch.tensor([1.5, -3.0, 0.0078125], dtype=torch.bfloat16)
    with ServedModel.from_repository(toy_repo, "halves") as model:
        out = model.infer_sync({"x": values})["y"]  # host results: uint16 bit patterns
    assert torch.from_numpy(out).view(torch.bfloat16).tolist() == [0.75, -1.5, 0.00390625]


def test_each_instance_has_its_own_worker_and_close_stops_them(toy_repo: Path) -> None:
    model = ServedModel.from_repository(toy_repo, "poison", instance_count=2)
    with model, ThreadPoolExecutor(8) as pool:
        pids = _pids(model)
        assert len(set(pids)) == 2
        values = [float(i) for i in range(40) if i != 13]  # 13 poisons a batch
        results = list(pool.map(model.infer_sync, [_x(v) for v in values]))
    assert [r["y"][0, 0] for r in results] == [2.0 * v for v in values]
    assert not any(_alive(pid) for pid in pids)


def test_thread_isolation_refuses_nothing_and_process_needs_a_repository_model() -> None:
    with pytest.raises(ValueError, match="needs a repository model"):
        ServedModel.from_function(
            lambda x: x, isolation="process",
            inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
            outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        )


async def test_the_event_loop_is_free_while_a_worker_runs(toy_repo: Path) -> None:
    # The server's side of a batch is a socket wait: the loop keeps turning.
    async with ServedModel.from_repository(toy_repo, "poison") as model:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        values = [float(i) for i in range(20) if i != 13]  # 13 poisons a batch
        results = await asyncio.gather(*(model.infer(_x(v, 50)) for v in values))
        ticker.cancel()
    assert [r["y"][0, 0] for r in results] == [2.0 * v for v in values]
    assert ticks > 20


# ---------------------------------------------------------------------- one owner: the scheduler
def _on_loops(make_coroutine: Any) -> None:
    """Run the coroutine on asyncio's own loop and on uvloop (the server's)."""
    import uvloop

    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(make_coroutine())


def _record_dispatch_threads(model: ServedModel) -> list[int]:
    """The thread that sends each batch to a worker."""
    threads: list[int] = []
    executor: Any = model.executor
    send = executor.dispatch

    def recording(*args: Any) -> Any:
        threads.append(threading.get_ident())
        return send(*args)

    executor.dispatch = recording
    return threads


async def _idle(model: ServedModel) -> None:
    assert await asyncio.to_thread(model.batcher.wait_idle, 10)


def test_every_batch_is_sent_by_the_schedulers_loop_whoever_calls(toy_repo: Path) -> None:
    """Lone callers, bursts, a backlog and callers on threads: one path, every
    batch sent (and its reply read) by the loop the scheduler runs on."""
    items = [token_item(int(n), rng) for n in rng.integers(8, 128, size=60)]
    with ServedModel.from_repository(REPOSITORY, "tagger") as here:
        expected = here.infer_many_sync(items)

    async def run() -> None:
        async with ServedModel.from_repository(
            REPOSITORY, "tagger", isolation="process", max_batch_tokens=1024
        ) as model:
            sent_on = _record_dispatch_threads(model)
            loop_thread = threading.get_ident()
            lone = await model.infer(items[0])
            burst = await asyncio.gather(*(model.infer(item) for item in items[1:30]))
            threaded = await asyncio.to_thread(model.infer_many_sync, items[30:])
            assert len(sent_on) >= 3 and set(sent_on) == {loop_thread}
            for got, want in zip([lone, *burst, *threaded], expected, strict=True):
                np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)

    _on_loops(run)


def test_a_dead_worker_fails_its_batch_alone_and_is_replaced_off_the_loop(toy_repo: Path) -> None:
    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "mortal") as model:
            first = _pids(model)[0]
            executor: Any = model.executor
            repair, replaced_on = executor.repair, []

            def recording_repair(instance: int) -> object:
                replaced_on.append(threading.get_ident())
                return repair(instance)

            executor.repair = recording_repair
            with pytest.raises(ModelFailure, match=r"died while running this batch \(exit code 7\)"):
                await model.infer(_x(7))
            await wait_until_async(lambda: executor.workers[0].alive, "a worker up again")
            assert executor.workers[0].pid not in (None, first)
            assert replaced_on and threading.get_ident() not in replaced_on
            assert (await model.infer(_x(2)))["y"].tolist() == [[4.0] * 4] * 3
        async with ServedModel.from_repository(toy_repo, "poison") as model:
            with pytest.raises(ModelFailure, match="model 'poison' failed: RuntimeError: poison value 13"):
                await model.infer(_x(13))
            assert (await model.infer(_x(3)))["y"].tolist() == [[6.0] * 4] * 3

    _on_loops(run)


def test_close_from_another_thread_waits_for_the_batch_in_flight(toy_repo: Path) -> None:
    async def run() -> None:
        model = ServedModel.from_repository(toy_repo, "sleepy").start(asyncio.get_running_loop())
        pid = _pids(model)[0]
        pending = asyncio.ensure_future(model.infer(_x(5.0)))
        await asyncio.sleep(0)  # the task runs up to its await: the batch is sent
        assert not pending.done()
        await asyncio.to_thread(model.close)
        assert (await pending)["y"][0, 0] == 5.0
        assert not _alive(pid)

    _on_loops(run)


def test_close_on_the_schedulers_own_loop_refuses_to_wait_for_itself(toy_repo: Path) -> None:
    async def run() -> None:
        model = ServedModel.from_repository(toy_repo, "sleepy").start(asyncio.get_running_loop())
        pending = asyncio.ensure_future(model.infer(_x(6.0)))
        await asyncio.sleep(0)  # the batch is sent
        with pytest.raises(RuntimeError, match="would wait for itself; close it from another thread"):
            model.batcher.close()
        assert (await pending)["y"][0, 0] == 6.0  # nothing was lost
        await asyncio.to_thread(model.close)

    _on_loops(run)


def test_a_worker_that_died_unseen_runs_the_batch_after_its_replacement(toy_repo: Path) -> None:
    """The worker dies between the check that it is up and the send: the
    batch comes back unrun, the worker is replaced off the loop, and the
    batch runs there: its caller sees nothing of it."""

    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "poison") as model:
            worker = model.executor.workers[0]  # type: ignore[attr-defined]
            dead = worker.process
            assert dead is not None
            await _idle(model)
            dead.kill()
            dead.wait(10)
            dead.poll = lambda: None  # type: ignore[method-assign]  # still looks alive
            assert (await model.infer(_x(4.0)))["y"].tolist() == [[8.0] * 4] * 3
            assert model.executor.workers[0].pid != dead.pid  # type: ignore[attr-defined]

    _on_loops(run)


def test_sending_a_batch_never_blocks_the_loop_whatever_the_socket_buffer(
    toy_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux clamps SO_SNDBUF to net.core.wmem_max (208 KiB on most hosts):
    with a 4 KiB buffer, a 1 MiB batch is written as the worker reads it, and
    the loop runs other callbacks meanwhile."""
    from tensorserve.runtime import worker_process

    monkeypatch.setattr(worker_process, "SOCKET_BUFFER_BYTES", 4096)

    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "poison", max_batch_size=1) as model:
            sock = model.executor.workers[0].sock  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 16384
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(tick())
            big = {"x": np.full((1 << 16, 4), 1.5, np.float32)}  # 1 MiB
            pid = _pids(model)[0]
            os.kill(pid, signal.SIGSTOP)  # it reads nothing: a blocking send would hang here
            try:
                pending = asyncio.ensure_future(model.infer(big))
                await asyncio.sleep(0)  # the batch goes out, as far as the socket takes it
                before = ticks
                while ticks < before + 100:
                    await asyncio.sleep(0)
                assert not pending.done()
            finally:
                os.kill(pid, signal.SIGCONT)
            result = await pending
            ticker.cancel()
            assert result["y"].shape == (1 << 16, 4) and float(result["y"][-1, 3]) == 3.0

    _on_loops(run)


# ---------------------------------------------------------------------- the framing
@pytest.mark.parametrize("dtype", ["bool", "uint8", "int64", "float16", "float32", "float64"])
def test_ipc_messages_round_trip_tensors_of_every_shape(dtype: str) -> None:
    a, b = socket.socketpair()
    with a, b:
        tensors = {
            "m": (rng.normal(size=(3, 5, 2)) * 10).astype(dtype),
            "empty": np.zeros((0, 4), dtype),
            "scalar": np.array(3).astype(dtype),
            "strided": np.arange(20).astype(dtype).reshape(4, 5)[:, ::2],
        }
        ipc.send(a, {"k": 1}, tensors)
        header, got = ipc.recv(b)
    assert header == {"k": 1}
    assert got.keys() == tensors.keys()
    for name, array in tensors.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        np.testing.assert_array_equal(got[name], array)


def test_ipc_recv_says_eof_when_the_other_end_has_gone() -> None:
    a, b = socket.socketpair()
    with b:
        ipc.send(a, {"k": 1}, {"x": np.arange(1000)})
        a.close()
        ipc.recv(b)  # the whole message still arrives
        with pytest.raises(EOFError):
            ipc.recv(b)


def _wire(header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """The bytes ``ipc.send`` puts on the stream for one message."""
    a, b = socket.socketpair()
    with a, b:
        ipc.send(a, header, tensors)
        a.shutdown(socket.SHUT_WR)
        return b"".join(iter(lambda: b.recv(1 << 16), b""))


def test_the_loops_reader_reassembles_a_dribbled_message_and_reads_no_further() -> None:
    tensors = {"x": rng.normal(size=(300, 7)).astype(np.float32), "none": np.zeros(0, np.int64)}
    first, second = _wire({"k": 2}, tensors), _wire({"next": True})
    a, b = socket.socketpair()
    with a, b:
        reader = ipc.MessageReader()
        assert reader.feed(b) is None  # nothing sent yet: it does not block
        pieces = [first[i : i + 997] for i in range(0, len(first), 997)]  # odd-sized
        for piece in pieces[:-1]:
            a.sendall(piece)
            assert reader.feed(b) is None
        a.sendall(pieces[-1] + second)
        message = reader.feed(b)
        assert message is not None
        header, got = message
        assert header == {"k": 2} and got.keys() == tensors.keys()
        for name, array in tensors.items():
            np.testing.assert_array_equal(got[name], array)
        assert ipc.recv(b) == ({"next": True}, {})  # not one byte of it was read
        a.close()
        with pytest.raises(EOFError):
            ipc.MessageReader().feed(b)


# ---------------------------------------------------------------------- a real server
def _workers_of(pid: int) -> list[psutil.Process]:
    """Worker processes under ``pid``: the worker template (its child) and the
    workers it forked (its grandchildren)."""
    return [
        child for child in psutil.Process(pid).children(recursive=True)
        if "tensorserve.runtime.worker_main" in child.cmdline()
    ]


def test_a_server_killed_outright_leaves_no_worker_behind(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "poison", POISON_MODEL, **ECHO)
    server = ServerProcess(tmp_path, "--isolation", "process")
    try:
        # The template, the instance's worker, and the standby (loading in the background).
        wait_until(lambda: len(_workers_of(server.process.pid)) == 3,
                   "template, worker and standby", 60)
        workers = _workers_of(server.process.pid)
        reply = httpx.post(f"{server.url}/v2/models/poison/infer", content=body([_x(4.0)]),
                           headers=MSGPACK)
        assert reply.status_code == 200
        assert from_wire(msgpack.unpackb(reply.content)["outputs"][0]["y"]).tolist() == [[8.0] * 4] * 3
        server.process.send_signal(signal.SIGKILL)  # no shutdown code runs
        server.process.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=10)  # it exits on its socket's EOF
        assert not alive, "the worker outlived its server"
    finally:
        server.stop()


# --------------------------------------------------------------------------- isolation = "auto"
def _auto_config(**fields: Any) -> Any:
    from tensorserve.repository.config import ModelConfig

    return ModelConfig.model_validate({
        **fields,
        "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    })


@pytest.mark.parametrize(
    ("device", "cpus", "expected"),
    [("cpu", 2, "process"), ("cpu", 16, "process"), ("cpu", 1, "thread")],
)
def test_auto_isolation_is_a_worker_process_on_a_cpu_with_two_cpus_or_more(
    device: str, cpus: int, expected: str
) -> None:
    from tensorserve.runtime.placement import resolve_isolation, resolve_placement

    config, placements = resolve_placement(_auto_config(device=device))
    assert config.isolation == "auto"
    assert resolve_isolation(config, placements, cpus=cpus).isolation == expected
    explicit = _auto_config(device=device, isolation="thread")
    assert resolve_isolation(explicit, placements, cpus=cpus).isolation == "thread"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_auto_isolation_is_a_thread_on_a_gpu() -> None:
    from tensorserve.runtime.placement import Placement, resolve_isolation

    config = _auto_config(device="cuda")
    assert resolve_isolation(config, [Placement("cuda", 1)], cpus=16).isolation == "thread"


def test_auto_isolation_is_a_thread_where_the_model_is_on_a_gpu_or_on_several_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule, on any machine: a device that is not the CPU, or a model
    placed over several devices, keeps a model thread."""
    from tensorserve.runtime import placement
    from tensorserve.runtime.placement import Placement, resolve_isolation

    monkeypatch.setattr(placement, "resolve_device", torch.device)  # no CUDA needed to name it
    config = _auto_config(device="cuda")
    assert resolve_isolation(config, [Placement("cuda", 1)], cpus=16).isolation == "thread"
    two_cpus = [Placement("cpu", 1), Placement("cpu", 1)]
    assert resolve_isolation(_auto_config(device="cpu"), two_cpus, cpus=16).isolation == "thread"


def test_a_repository_model_at_defaults_runs_in_a_worker_process_here() -> None:
    """This machine has 2 CPUs or more: the bundled embedder, which sets no
    isolation, gets a worker process, and a function a thread."""
    from tensorserve.host import available_cpus

    if available_cpus() < 2:
        pytest.skip("auto picks a thread on one CPU (checked above)")
    with ServedModel.from_repository(REPOSITORY, "embedder", warmup={"enabled": False}) as model:
        assert model.config.isolation == "process"
        assert type(model.executor).__name__ == "ProcessExecutor"
    function = ServedModel.from_function(lambda x: x, inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
                                         outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}])
    assert function.config.isolation == "thread"

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
from tensorserve.runtime import ipc
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


# ---------------------------------------------------------------------- the direct path
def _on_loops(make_coroutine: Any) -> None:
    """Run the coroutine on asyncio's own loop and on uvloop (the server's)."""
    import uvloop

    for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(make_coroutine())


def _record_launch_threads(model: ServedModel) -> list[int]:
    """The thread that sends each batch to the worker: a model thread
    (``launch``) or the event loop's (``try_launch_direct``)."""
    threads: list[int] = []
    executor = model.executor
    for name in ("launch", "try_launch_direct"):
        send = getattr(executor, name)

        def recording(*args: Any, send: Any = send) -> Any:
            threads.append(threading.get_ident())
            return send(*args)

        setattr(executor, name, recording)
    return threads


async def _parked(model: ServedModel) -> None:
    """Wait until the model thread has gone back to waiting for work."""
    assert await asyncio.to_thread(model.batcher.wait_idle, 10)


def test_a_loop_drives_a_worker_until_a_backlog_and_the_model_thread_takes_over() -> None:
    items = [token_item(int(n), rng) for n in rng.integers(8, 128, size=60)]
    with ServedModel.from_repository(REPOSITORY, "tagger") as here:
        expected = here.infer_many_sync(items)

    async def run() -> None:
        # The fixed 1024-token budget the tagger shipped with: 17 waiting items
        # are a backlog under it, whatever budget a learnt one has reached.
        async with ServedModel.from_repository(
            REPOSITORY, "tagger", isolation="process", max_batch_tokens=1024
        ) as model:
            launched_on = _record_launch_threads(model)
            loop_thread = threading.get_ident()
            await _parked(model)
            # A lone caller: the loop sends the batch and reads the reply.
            lone = await model.infer(items[0])
            assert launched_on == [loop_thread]
            # Pairs: the first item goes direct, the second queues behind it,
            # and the loop sends it as the first one's reply comes in (no
            # backlog): the model thread never takes the GIL.
            burst = []
            for pair in range(6):
                burst += await asyncio.gather(
                    *(model.infer(item) for item in items[1 + 2 * pair : 3 + 2 * pair])
                )
            assert len(launched_on) >= 4
            assert set(launched_on) == {loop_thread}
            # A backlog (more waits than a batch takes): the worker is the
            # bottleneck, and the model thread takes over, sending the next
            # batch while one runs.
            launched_on.clear()
            await _parked(model)
            burst += await asyncio.gather(*(model.infer(item) for item in items[13:30]))
            assert launched_on[0] == loop_thread
            assert any(thread != loop_thread for thread in launched_on[1:])
            # Callers without a loop are the model thread's: it reads the same
            # socket with blocking reads (uvloop had made it non-blocking).
            launched_on.clear()
            threaded = await asyncio.to_thread(model.infer_many_sync, items[30:])
            assert launched_on and loop_thread not in launched_on
            for got, want in zip([lone, *burst, *threaded], expected, strict=True):
                np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
            # And alone again: direct once more, once the model thread that
            # ran the last batch has gone back to waiting.
            await _parked(model)
            launched_on.clear()
            await model.infer(items[0])
            assert launched_on == [loop_thread]

    _on_loops(run)


def test_direct_batches_fail_alone_and_a_dead_worker_is_replaced_off_the_loop(toy_repo: Path) -> None:
    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "mortal") as model:
            first = _pids(model)[0]
            with pytest.raises(ModelFailure, match=r"died while running this batch \(exit code 7\)"):
                await model.infer(_x(7))
            # The dead worker is replaced off the loop, right after its batch
            # (the standby takes over): the next request goes direct again.
            executor: Any = model.executor
            await wait_until_async(lambda: executor.workers[0].alive, "a worker up again")
            assert executor.workers[0].pid not in (None, first)
            await _parked(model)
            launched_on = _record_launch_threads(model)
            assert (await model.infer(_x(2)))["y"].tolist() == [[4.0] * 4] * 3
            assert launched_on[0] == threading.get_ident()  # direct
        async with ServedModel.from_repository(toy_repo, "poison") as model:
            with pytest.raises(ModelFailure, match="model 'poison' failed: RuntimeError: poison value 13"):
                await model.infer(_x(13))
            assert (await model.infer(_x(3)))["y"].tolist() == [[6.0] * 4] * 3

    _on_loops(run)


def test_close_from_another_thread_waits_for_the_batch_the_loop_is_driving(toy_repo: Path) -> None:
    async def run() -> None:
        model = ServedModel.from_repository(toy_repo, "sleepy").start()
        pid = _pids(model)[0]
        await _parked(model)
        pending = asyncio.ensure_future(model.infer(_x(5.0)))
        await asyncio.sleep(0)  # the task runs up to its await: the batch is sent
        assert not pending.done()
        await asyncio.to_thread(model.close)
        assert (await pending)["y"][0, 0] == 5.0
        assert not _alive(pid)

    _on_loops(run)


def test_close_on_the_loop_that_drives_a_batch_waits_for_it_there(toy_repo: Path) -> None:
    async def run() -> None:
        model = ServedModel.from_repository(toy_repo, "sleepy").start()
        await _parked(model)
        pending = asyncio.ensure_future(model.infer(_x(6.0)))
        await asyncio.sleep(0)  # the task runs up to its await: the batch is sent
        started = time.monotonic()
        model.close()  # on the loop's own thread, which holds the reply's reader
        # It did not wait out the 30 s join timeout: it read the reply itself.
        assert time.monotonic() - started < 10
        assert (await pending)["y"][0, 0] == 6.0

    _on_loops(run)


def test_a_batch_the_loop_cannot_send_goes_to_the_model_thread(toy_repo: Path) -> None:
    """The worker dies between the check that it is up and the send: the loop
    neither waits for its exit nor restarts it; a model thread does."""

    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "poison") as model:
            worker = model.executor.workers[0]
            dead = worker.process
            assert dead is not None
            await _parked(model)
            dead.kill()
            dead.wait(10)
            dead.poll = lambda: None  # type: ignore[method-assign]  # still looks alive
            launched_on = _record_launch_threads(model)
            replaced_on: list[int] = []
            replace = model.executor._replace  # type: ignore[attr-defined]

            def recording_replace(instance: int) -> object:
                replaced_on.append(threading.get_ident())
                return replace(instance)

            model.executor._replace = recording_replace  # type: ignore[attr-defined]
            loop_thread = threading.get_ident()
            assert (await model.infer(_x(4.0)))["y"].tolist() == [[8.0] * 4] * 3
            # Tried on the loop (the send failed), then sent by a model thread
            # that replaced the worker (by the standby, or a new start).
            assert launched_on[0] == loop_thread and launched_on[1] != loop_thread
            assert replaced_on and loop_thread not in replaced_on
            assert model.executor.workers[0].pid != dead.pid  # type: ignore[attr-defined]

    _on_loops(run)


def test_a_large_batch_is_padded_on_a_model_thread_not_on_the_loop(
    toy_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorserve.batching import batcher

    monkeypatch.setattr(batcher, "DIRECT_MAX_ELEMENTS", 12)  # one item of 3 x 4

    async def run() -> None:
        async with ServedModel.from_repository(toy_repo, "poison") as model:
            launched_on = _record_launch_threads(model)
            await _parked(model)
            assert (await model.infer(_x(1.0)))["y"].tolist() == [[2.0] * 4] * 3  # 12: direct
            await _parked(model)
            long = {"x": np.full((4, 4), 1.0, np.float32)}  # 16 elements
            assert (await model.infer(long))["y"].tolist() == [[2.0] * 4] * 4
            loop_thread = threading.get_ident()
            assert launched_on[0] == loop_thread and launched_on[1] != loop_thread

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
    from tensorserve.runtime.cpus import available_cpus

    if available_cpus() < 2:
        pytest.skip("auto picks a thread on one CPU (checked above)")
    with ServedModel.from_repository(REPOSITORY, "embedder", warmup={"enabled": False}) as model:
        assert model.config.isolation == "process"
        assert type(model.executor).__name__ == "ProcessExecutor"
    function = ServedModel.from_function(lambda x: x, inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
                                         outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}])
    assert function.config.isolation == "thread"

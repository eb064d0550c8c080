"""When the scheduler process reads its front ends' sockets
(``frontends/pacing.py``), on the real hub and a real model's scheduler in
this process, spoken to over a socket pair as a front end speaks: while
the model is busy, what a front end sends waits in its socket; when the
batch ends it is all read before the next batch forms, so it goes into
that batch; and a long batch still lets it in after ``MAX_PAUSE_S``.
"""

from __future__ import annotations

import asyncio
import builtins
import socket
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tensorserve.dataplane.assembly import build_plane, models_served
from tensorserve.frontends import pacing
from tensorserve.frontends.hub import FrontEndHub
from tensorserve.settings import Settings
from tests.helpers import ECHO, write_toy_model
from tests.test_frontends_intake import FrontEnd, row

# The model's forward waits for the test to open its gate (one process:
# the model module and the test share ``builtins``).
GATED = """
    import builtins
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            assert builtins._tensorserve_test_gate.wait(30), "the test never opened the gate"
            return x
"""


@pytest.fixture
async def gated(
    tmp_path: Path,
) -> AsyncIterator[tuple[FrontEndHub, FrontEnd, threading.Event]]:
    gate = threading.Event()
    builtins._tensorserve_test_gate = gate  # type: ignore[attr-defined]
    write_toy_model(
        tmp_path, "echo", GATED, **{**ECHO, "max_batch_size": 4,
                                    "dynamic_batching": {"max_queue_delay_ms": 0.0}}
    )  # fmt: skip
    settings = Settings(model_repository=str(tmp_path), isolation="thread", log_level="WARNING")
    plane, loop_lag = build_plane(settings, role="scheduler")
    ours, theirs = socket.socketpair()
    gate.set()  # the warm-up batches run
    async with models_served(plane, loop_lag, wait_for_models=True):
        gate.clear()
        hub = FrontEndHub(plane, asyncio.get_running_loop())
        hub.start()
        hub.attach(ours, pid=1)
        front_end = FrontEnd(theirs)
        await asyncio.to_thread(front_end.read, lambda: front_end.table)
        yield hub, front_end, gate
        gate.set()
        hub.stop()
    theirs.close()
    del builtins._tensorserve_test_gate  # type: ignore[attr-defined]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the loop run until ``condition()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


async def test_while_the_model_is_busy_requests_wait_in_the_socket_and_join_the_next_batch(
    gated: tuple[FrontEndHub, FrontEnd, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 60.0)  # only a batch's end reads them here
    hub, front_end, gate = gated
    scheduler = hub.plane.registry.ready_model("echo", None).batcher.scheduler
    (connection,) = hub.connections.values()
    front_end.send([(1, [row(1)])])
    await until(lambda: any(scheduler.running))  # request 1 is on the (blocked) model
    assert connection.link.paused  # every model busy: its socket is not watched
    front_end.send([(2, [row(2)]), (3, [row(3)])])
    front_end.send([(4, [row(4)]), (5, [row(5)])])
    await asyncio.sleep(0.1)  # loop iterations in which a watched socket would be read
    assert len(scheduler.queue) == 0 and connection.link.paused
    batches = scheduler.results.stats.total_batches
    gate.set()
    await asyncio.to_thread(front_end.read, lambda: len(front_end.replies) == 5)
    for rid in range(1, 6):
        assert front_end.replies[rid][0]["y"][0, 0] == rid, rid
    # Requests 2-5 went in one batch: all read when batch 1 ended, before it formed.
    assert scheduler.results.stats.total_batches == batches + 2
    await until(lambda: not connection.link.paused)  # nothing runs: the socket is watched


async def test_behind_a_long_batch_the_socket_is_still_read_after_the_longest_pause(
    gated: tuple[FrontEndHub, FrontEnd, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "MAX_PAUSE_S", 0.05)
    hub, front_end, gate = gated
    scheduler = hub.plane.registry.ready_model("echo", None).batcher.scheduler
    (connection,) = hub.connections.values()
    front_end.send([(1, [row(1)])])
    await until(lambda: any(scheduler.running))
    assert connection.link.paused
    front_end.send([(2, [row(2)]), (3, [row(3)])])
    await until(lambda: len(scheduler.queue) == 2)  # the model still blocked: read anyway
    front_end.send([(4, [row(4)])])
    await until(lambda: len(scheduler.queue) == 3)  # and again, a pause later
    assert any(scheduler.running) and not gate.is_set() and connection.link.paused
    gate.set()
    await asyncio.to_thread(front_end.read, lambda: len(front_end.replies) == 4)
    assert all(front_end.replies[rid][0]["y"][0, 0] == rid for rid in range(1, 5))


def test_the_pause_is_short_beside_a_front_ends_silence_limit() -> None:
    from tensorserve.frontends.liveness import SILENT_S

    assert pacing.MAX_PAUSE_S * 100 <= SILENT_S

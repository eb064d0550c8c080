"""What a front end's message admits (``frontends/intake.py``), on the real
hub and a real model's scheduler in this process, spoken to over a socket
pair as a front end speaks: a run of plain one-item requests is admitted
whole, yet each caller gets its own row, is counted as its own request,
and, when the run does not fit, gets its own answer, as if admitted alone.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorserve.dataplane.assembly import build_plane, models_served
from tensorserve.errors import RequestTooLarge, ServerBusy
from tensorserve.frontends.hub import FrontEndHub
from tensorserve.frontends.protocol import error_from, in_runs
from tensorserve.ipc import messages
from tensorserve.settings import Settings
from tests.helpers import ECHO, write_toy_model

IDENTITY = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x
"""
# Eight may wait; batches of up to four.
SMALL_QUEUE = {
    **ECHO,
    "max_batch_size": 4,
    "dynamic_batching": {"max_queue_delay_ms": 1.0, "max_queue_size": 8},
}


class FrontEnd:
    """The test's end of the socket: sends requests as a front end does and
    reads every reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.reader = sock, messages.StreamReader()
        self.sock.setblocking(False)
        self.replies: dict[int, Any] = {}
        self.table: list[Any] = []
        self.runs: list[list[int]] = []  # the request ids of each run of rows replied

    def read(self, until: Any, timeout: float = 30.0) -> None:
        """Read (in a thread) until ``until()`` holds."""
        while not until():
            ready, _, _ = select.select([self.sock], [], [], timeout)
            assert ready, "no message from the hub"
            for header, tensors in self.reader.feed(self.sock) or []:
                self.table = header.get("models", self.table)
                arrays = list(tensors)  # taken from as the rows are read
                for reply in header.get("replies", ()):
                    if type(reply[0]) is list:  # a run of rows: [[rid, ...], names]
                        rids, names = reply
                        self.runs.append(rids)
                        for rid in rids:
                            self.replies[rid] = [dict(zip(names, arrays[: len(names)]))]
                            del arrays[: len(names)]
                        continue
                    rid, names, outcome = reply
                    if names is None:
                        self.replies[rid] = error_from(outcome)
                        continue
                    rows = []
                    for row_names in names:
                        rows.append(dict(zip(row_names, arrays[: len(row_names)])))
                        del arrays[: len(row_names)]
                    self.replies[rid] = rows

    def send(
        self,
        requests: list[tuple[int, list[dict[str, np.ndarray]]]],
        timeouts: dict[int, float] | None = None,
    ) -> None:
        """One message of ``(rid, items)``, its plain requests in runs as a
        front end sends them; ``timeouts`` in seconds by rid."""
        name, version, *_, generation = next(e for e in self.table if e[0] == "echo")
        infer, arrays = [], []
        for rid, items in requests:
            names = list(items[0])
            infer.append(
                [rid, name, str(version), generation, (timeouts or {}).get(rid), 0, {}, names, len(items), None,
                 f"caller-{rid}"]
            )  # fmt: skip
            arrays += [item[n] for item in items for n in names]
        buffers = messages.frames_in_order({"infer": in_runs(infer)}, arrays)
        self.sock.setblocking(True)
        self.sock.sendall(b"".join(buffers))
        self.sock.setblocking(False)


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[tuple[FrontEndHub, FrontEnd]]:
    write_toy_model(tmp_path, "echo", IDENTITY, **SMALL_QUEUE)
    settings = Settings(model_repository=str(tmp_path), isolation="thread", log_level="WARNING")
    loop = asyncio.get_running_loop()
    plane, loop_lag = build_plane(settings, role="scheduler")
    ours, theirs = socket.socketpair()
    async with models_served(plane, loop_lag, wait_for_models=True):
        hub = FrontEndHub(plane, loop)
        hub.start()
        hub.attach(ours, pid=1)
        front_end = FrontEnd(theirs)
        await asyncio.to_thread(front_end.read, lambda: front_end.table)
        yield hub, front_end
        hub.stop()
    theirs.close()


def row(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((2, 4), value, np.float32)}


async def test_a_run_of_one_item_requests_answers_each_caller_its_own_row(
    hub: tuple[FrontEndHub, FrontEnd],
) -> None:
    server, front_end = hub
    stats = server.plane.registry.ready_model("echo", None).batcher.stats
    before = (stats.total_requests, stats.total_items)
    # Runs broken by a request of two items and by one with a deadline of its own.
    requests = [(1, [row(1)]), (2, [row(2)]), (3, [row(3), row(30)]), (4, [row(4)]),
                (5, [row(5)]), (6, [row(6)]), (7, [row(7)])]  # fmt: skip
    front_end.send(requests, timeouts={5: 30.0})
    await asyncio.to_thread(front_end.read, lambda: len(front_end.replies) == len(requests))
    expected = {1: [1], 2: [2], 3: [3, 30], 4: [4], 5: [5], 6: [6], 7: [7]}
    for rid, values in expected.items():
        got = front_end.replies[rid]
        assert [r["y"].tolist() for r in got] == [np.full((2, 4), v).tolist() for v in values], rid
    assert (stats.total_requests, stats.total_items) == (before[0] + 7, before[1] + 8)
    # The one-item requests answered by one batch come back as one run of rows.
    assert any(len(rids) > 1 for rids in front_end.runs)
    assert sorted(rid for rids in front_end.runs for rid in rids) == [1, 2, 4, 5, 6, 7]


async def test_a_run_that_does_not_fit_is_answered_as_if_each_came_alone(
    hub: tuple[FrontEndHub, FrontEnd],
) -> None:
    _, front_end = hub
    # Eleven plain requests in one message: eight fit the queue (nothing runs
    # before the message is admitted), the last three are refused, each with
    # its own "queue is full", not all eleven and not "never fits".
    front_end.send([(rid, [row(rid)]) for rid in range(10, 21)])
    await asyncio.to_thread(front_end.read, lambda: len(front_end.replies) == 11)
    answered = {rid: r for rid, r in front_end.replies.items() if isinstance(r, list)}
    refused = {rid: r for rid, r in front_end.replies.items() if not isinstance(r, list)}
    assert sorted(answered) == list(range(10, 18))
    assert all(answered[rid][0]["y"][0, 0] == rid for rid in answered)
    assert sorted(refused) == [18, 19, 20]
    for error in refused.values():
        assert isinstance(error, ServerBusy) and not isinstance(error, RequestTooLarge)
        assert "queue is full (8 items waiting, limit 8)" in error.message

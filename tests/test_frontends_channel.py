"""The channel between the front ends and the scheduler process fails one
request at a time: a value that cannot be packed is its own caller's 400
(or its own request's error), never the loss of the message it would have
travelled in; a message that cannot be read breaks its link, cleanly; a
front end busy in a long C call is told apart from a stuck one; and asking
for a model that does not exist makes nothing in the registry.

The ``Outbox``, link and liveness tests are pure (no event loop, a stand-in
for one); one test runs a real server with ``--frontends 2``."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgpack
import numpy as np
import psutil
import pytest

from tensorserve import errors
from tensorserve.frontends import hub, remote
from tensorserve.frontends.liveness import BUSY_LIMIT_S, SILENT_S, Liveness, cpu_ticks
from tensorserve.frontends.protocol import Outbox, check_crossable, tensor_count
from tensorserve.ipc import messages
from tensorserve.ipc.link import Link
from tensorserve.serving.registry import ModelRegistry
from tests.conftest import ServerProcess
from tests.helpers import (
    ECHO,
    MSGPACK,
    FileGate,
    body,
    from_wire,
    toy_config,
    wait_until,
    write_toy_model,
)
from tests.test_ensemble import DOUBLE_PY, FLOATS, SHIFT_PY, TOY, _ensemble_toml, _step, _write
from tests.test_frontends import front_ends, start


def deep(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels - 1):
        value = [value]
    return value


UNPACKABLE = {
    "huge": 2**70,
    "surrogate": "\ud800",
    "deep": deep(1021),
}


class ManualLoop:
    """What an ``Outbox`` needs of a loop: ``call_soon``, run by hand."""

    def __init__(self) -> None:
        self.soon: list[Any] = []

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.soon.append((fn, args))

    def run(self) -> None:
        while self.soon:
            fn, args = self.soon.pop(0)
            fn(*args)


def read_back(sent: list[list[messages.Buffer]]) -> list[messages.InOrder]:
    """Each message sent, as the other side reads it."""
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"".join(bytes(b) for message in sent for b in message))
        left.close()
        right.setblocking(False)
        reader, got = messages.StreamReader(), []
        while True:
            try:
                read = reader.feed(right)
            except EOFError:
                return got
            got.extend(read or [])


def infer_entry(rid: int, parameters: dict[str, Any] | None = None) -> list[Any]:
    return [rid, "m", "1", 1, None, 0, parameters, ["x"], 1, None, f"id-{rid}"]


# -- admission ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(UNPACKABLE))
def test_a_value_that_cannot_cross_is_its_callers_400_naming_it(kind: str) -> None:
    with pytest.raises(errors.InvalidInput, match=r"^parameters\.bad cannot be passed on"):
        check_crossable({"good": 1, "bad": UNPACKABLE[kind]})
    with pytest.raises(errors.InvalidInput, match=r"^parameters\.priority cannot be passed on"):
        check_crossable({}, UNPACKABLE[kind])
    check_crossable({"fine": deep(1000), "text": "é", "big": 2**63 - 1, "low": -(2**63)}, 3)


# -- the outbox ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(UNPACKABLE))
def test_an_entry_that_cannot_be_packed_fails_alone_and_the_rest_is_sent(kind: str) -> None:
    """Before: ``flush`` emptied its sections, then the one pack raised: every
    request, cancel and report of that loop turn was lost, each caller left
    to wait for its deadline."""
    loop, sent, refused = ManualLoop(), [], []

    def unsendable(section: str, entry: Any, exc: Exception) -> list[Any]:
        refused.append((section, entry[0]))
        return (
            [[entry[0], None, ["InvalidInput", "cannot cross", None]]]
            if section == "replies"
            else []
        )

    outbox = Outbox(loop, sent.append, unsendable=unsendable)  # type: ignore[arg-type]
    a, b, c = (np.full(2, i, np.float32) for i in range(3))
    outbox.add("infer", infer_entry(1), [a])
    outbox.add("infer", infer_entry(2, {"p": UNPACKABLE[kind]}), [b])
    outbox.add("infer", infer_entry(3), [c])
    outbox.add("cancel", 7)
    outbox.add("replies", [8, [["y"]], [{"q": UNPACKABLE[kind]}]], [np.ones(1)])
    outbox.put("report", {"cpu": 1.5})
    loop.run()
    assert refused == [("infer", 2), ("replies", 8)]
    [(header, tensors)] = read_back(sent)
    assert [entry[0] for entry in header["infer"]] == [1, 3]
    assert [t.tolist() for t in tensors] == [a.tolist(), c.tolist()]  # its tensor left with it
    assert header["cancel"] == [7] and header["report"] == {"cpu": 1.5}
    assert header["replies"] == [[8, None, ["InvalidInput", "cannot cross", None]]]


def test_a_run_of_entries_counts_its_tensors() -> None:
    assert tensor_count("infer", infer_entry(1)) == 1
    assert tensor_count("infer", [[1, 2, 3], "m", "1", 1, None, 0, ["a", "b"], ["i"] * 3]) == 6
    assert tensor_count("replies", [[1, 2], ["y", "z"]]) == 4
    assert tensor_count("replies", [5, [["y"], ["y", "z"]], None]) == 3
    assert tensor_count("replies", [5, None, ["X", "m", None]]) == 0
    assert tensor_count("cancel", 3) == 0


async def test_a_front_end_answers_the_callers_of_an_entry_it_cannot_send() -> None:
    """The plain request's caller gets a 400 naming its value; each caller of
    a run the server's fault (their values were checked at admission)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        scheduler = remote.Scheduler(ours)
        loop = asyncio.get_running_loop()
        answers = {rid: loop.create_future() for rid in (1, 2, 3)}
        scheduler._waiting.update(answers)
        plain = infer_entry(1, {"p": 2**70})
        run = [[2, 3], "m", "1", 1, None, 0, ["x"], ["id-2", "id-3"]]
        assert scheduler._unsendable("infer", plain, OverflowError("too big")) == []
        assert scheduler._unsendable("infer", run, ValueError("odd")) == []
        assert scheduler._waiting == {}  # popped: no cancel follows
        with pytest.raises(errors.InvalidInput, match=r"^parameters\.p cannot be passed on"):
            answers[1].result()
        for rid in (2, 3):
            with pytest.raises(errors.TensorServeError, match="internal error"):
                answers[rid].result()


def test_the_scheduler_process_answers_a_reply_it_cannot_send_with_its_error() -> None:
    connection = SimpleNamespace(pid=7)
    one = hub.Connection._unsendable(
        connection, "replies", [4, [["y"]], [{"q": 2**70}]], OverflowError()
    )  # type: ignore[arg-type]
    assert [(rid, names, error[0]) for rid, names, error in one] == [(4, None, "ModelFailure")]
    answer = hub.Connection._unsendable(connection, "answers", [9, True, 2**70], OverflowError())  # type: ignore[arg-type]
    assert answer[0][:2] == [9, False] and answer[0][2][0] == "TensorServeError"


# -- the link -------------------------------------------------------------------------
def corrupt(header: dict[str, Any], tail: bytes = b"") -> bytes:
    head = msgpack.packb(header)
    return struct.pack("<I", len(head)) + head + tail


@pytest.mark.parametrize(
    "stream",
    [
        struct.pack("<I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        corrupt({"tensors": [["0", "float32", [-4]]]}),  # a negative size
        corrupt({"tensors": [["0", "float32", [2], [-3, 5]]]}, b"\0" * 8),  # a negative run
        corrupt({"tensors": [["0", "bytes", [1], -8]]}),
        corrupt({"tensors": [["0", "no-such-dtype", [1]]]}, b"\0" * 4),
        corrupt({"no tensors": 1}),
        corrupt({"tensors": 5}),
    ],
)
async def test_a_message_that_cannot_be_read_breaks_the_link_cleanly(stream: bytes) -> None:
    """Before: only EOFError and OSError broke the link; any other error
    escaped each read (a view of the buffer left attached, every later read
    failing), the link open and jammed for good, its requests waiting."""
    left, right = socket.socketpair()
    loop = asyncio.get_running_loop()
    lost, got = asyncio.Event(), []
    link = Link(right, loop, got.append, lost.set, many=True)
    with left, right:
        left.sendall(stream)
        await asyncio.wait_for(lost.wait(), 10)
        assert not link.open and got == []


def test_a_corrupt_header_leaves_no_view_of_the_read_buffer() -> None:
    reader = messages.StreamReader()
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")
        right.setblocking(False)
        with pytest.raises(Exception) as caught:
            reader.feed(right)
        # Its traceback still held (as a loop's exception handler holds it):
        # the buffer is resizable, no view of it left exporting it.
        reader._pending += b"more"
        assert caught.traceback


def test_a_frame_length_of_2_31_is_refused_before_any_allocation() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack("<I", 1 << 31))
        right.setblocking(False)
        with pytest.raises(ConnectionError, match="corrupt"):
            messages.StreamReader().feed(right)


# -- liveness -------------------------------------------------------------------------
def test_a_silent_front_end_whose_cpu_time_advances_is_busy_not_stuck() -> None:
    """Before: silent for 5 s was enough to be killed, busy or not."""
    busy = Liveness(attached=0.0, heard=100.0)
    ticks = iter(range(0, 10_000, 25))  # 25 ticks each look: a C call holding the GIL
    now = 100.0
    while now < 100.0 + BUSY_LIMIT_S:
        assert busy.check(now, lambda: next(ticks)) is None, now
        now += 0.25
    stuck = busy.check(now + 0.25, lambda: next(ticks))
    assert stuck is not None and stuck.for_s == BUSY_LIMIT_S


def test_a_silent_front_end_whose_cpu_time_stands_still_is_stuck_after_silent_s() -> None:
    stopped = Liveness(attached=0.0, heard=100.0)
    now = 100.0
    while now <= 100.0 + SILENT_S:
        assert stopped.check(now, lambda: 42) is None, now
        now += 0.25
    stuck = stopped.check(now, lambda: 42)
    assert stuck is not None and (stuck.for_s, stuck.why) == (SILENT_S, "using no CPU time either")
    # It talks again: alive, and the next silence starts from a new baseline.
    stopped.heard = now
    assert stopped.check(now + 1.0, lambda: 43) is None


def test_cpu_time_is_read_from_proc_advancing_for_a_busy_process_only() -> None:
    spinning = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = cpu_ticks(spinning.pid)
        assert first is not None
        wait_until(lambda: (cpu_ticks(spinning.pid) or 0) > first, "CPU time advancing", 30)
        spinning.send_signal(signal.SIGSTOP)
        wait_until(lambda: psutil.Process(spinning.pid).status() == "stopped", "stopped", 30)
        stopped = cpu_ticks(spinning.pid)
        assert stopped is not None and stopped > first
    finally:
        spinning.kill()
        spinning.wait()
    assert cpu_ticks(spinning.pid) is None  # gone: nothing to read


# -- the registry ---------------------------------------------------------------------
async def test_asking_for_a_model_that_does_not_exist_makes_no_lock(tmp_path: Path) -> None:
    """Before: a lock was made for any name asked for, before the name was
    checked: explicit model control grew without bound."""
    registry = ModelRegistry(tmp_path)
    for i in range(50):
        with pytest.raises(errors.ModelNotFound, match=f"'nope-{i}'"):
            await registry.load(f"nope-{i}")
        with pytest.raises(errors.ModelNotFound):
            await registry.unload(f"gone-{i}")
    assert registry._locks == {}
    # A folder is what makes a name real (a model that fails to load is still one).
    write_toy_model(tmp_path, "later", "raise ImportError('on purpose')\n", **ECHO)
    entry = await registry.load("later")
    assert entry.state.value == "FAILED" and list(registry._locks) == ["later"]


# -- a front end that loses its link --------------------------------------------------
async def test_a_front_end_whose_link_breaks_answers_its_callers_503_then_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the front end exited at once, its callers' connections cut
    with no answer (and a corrupt message jammed the link instead)."""
    exited = asyncio.Event()
    monkeypatch.setattr(remote, "_exit_now", exited.set)
    monkeypatch.setattr(remote, "EXIT_WRITE_S", 0.0)
    ours, theirs = socket.socketpair()
    scheduler = remote.Scheduler(ours)
    with ours, theirs:
        scheduler.connect()
        waiting = asyncio.ensure_future(scheduler.ask("health", ()))
        await asyncio.sleep(0)  # (its question is queued)
        theirs.sendall(struct.pack("<I", 3) + b"\xc1\xc1\xc1")  # a message that cannot be read
        with pytest.raises(errors.ModelNotReady, match="lost its link"):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(errors.ModelNotReady, match="lost its link"):
            scheduler.ready_model("m")  # a new caller: refused at once, not left waiting
        await asyncio.wait_for(exited.wait(), 10)
        scheduler.close()


# -- a real server with two front ends --------------------------------------------------
ECHO_PY = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * 2
"""
GOOD_CALLERS, GOOD_CALLS = 6, 25


@pytest.fixture(scope="module")
def two_front_ends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("channel")
    write_toy_model(repo, "echo", ECHO_PY, **ECHO)
    _write(repo, "double", toy_config({"x": FLOATS}, {"y": FLOATS}, **TOY), DOUBLE_PY)
    _write(repo, "shift", toy_config({"a": FLOATS, "b": FLOATS}, {"s": FLOATS}, **TOY), SHIFT_PY)
    steps = [
        _step("double", {"x": "X"}, {"y": "D"}),
        _step("shift", {"a": "D", "b": "X"}, {"s": "OUT"}),
    ]
    _write(repo, "pair", _ensemble_toml(steps), None)
    server = start(repo)
    yield server
    server.stop()


def good_caller(url: str, which: int) -> list[str]:
    """GOOD_CALLS requests, alternately to the model and the ensemble; what went wrong."""
    wrong = []
    with httpx.Client(timeout=60) as client:
        for i in range(GOOD_CALLS):
            value = float(which * 1000 + i)
            if i % 2:
                request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 2],
                                       "data": [value, value]}]}  # fmt: skip
                reply = client.post(f"{url}/v2/models/pair/infer", json=request)
                expected: Any = [3 * value + 0.5] * 2
                got = reply.json().get("outputs", [{}])[0].get("data")
            else:
                x = np.full((1, 4), value, np.float32)
                reply = client.post(f"{url}/v2/models/echo/infer", content=body([{"x": x}]),
                                    headers=MSGPACK)  # fmt: skip
                expected = (x * 2).tolist()
                outputs = msgpack.unpackb(reply.content).get("outputs")  # (an error: none)
                got = from_wire(outputs[0]["y"]).tolist() if outputs else None
            if reply.status_code != 200 or got != expected:
                wrong.append(f"{which}/{i}: {reply.status_code} {reply.text[:200]}")
    return wrong


def bad_ensemble_call(url: str, kind: str) -> httpx.Response:
    x = {"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    if kind == "deep":  # msgpack: JSON refuses it first
        return httpx.post(
            f"{url}/v2/models/pair/infer",
            content=body([{"X": np.ones(2, np.float32)}], parameters={"bad": UNPACKABLE[kind]}),
            headers=MSGPACK,
            timeout=15,
        )
    name = "priority" if kind == "priority" else "bad"
    value = 2**70 if kind == "priority" else UNPACKABLE[kind]
    text = json.dumps({"inputs": [x], "parameters": {name: value}})  # "\ud800" stays escaped
    return httpx.post(f"{url}/v2/models/pair/infer", content=text,
                      headers={"Content-Type": "application/json"}, timeout=15)  # fmt: skip


def test_an_ensemble_request_that_cannot_cross_is_its_own_400_and_costs_no_one_else(
    two_front_ends: ServerProcess,
) -> None:
    """Before: the bad caller was never answered (each timed out) and good
    callers whose requests shared its message waited for their deadlines."""
    url = two_front_ends.url
    kinds = ["huge", "surrogate", "deep", "priority"]
    with ThreadPoolExecutor(GOOD_CALLERS + len(kinds)) as pool:
        good = [pool.submit(good_caller, url, which) for which in range(GOOD_CALLERS)]
        bad = {kind: pool.submit(bad_ensemble_call, url, kind) for kind in kinds * 3}
        wrong = [line for future in good for line in future.result()]
        refused = {kind: future.result() for kind, future in bad.items()}
    assert wrong == []
    for kind, reply in refused.items():
        assert reply.status_code in (400,), (kind, reply.status_code, reply.text)
        error = reply.json()["error"] if kind != "deep" else msgpack.unpackb(reply.content)["error"]
        field = "priority" if kind == "priority" else "bad"
        assert f"parameters.{field}" in error, (kind, error)


def test_a_caller_waiting_when_the_scheduler_process_dies_is_answered_503(
    tmp_path: Path,
) -> None:
    """Before: its front end exited at once and the caller's connection was
    cut with no answer."""
    gate = FileGate(tmp_path)
    write_toy_model(tmp_path, "gated", gate.model(), **ECHO)
    server = start(tmp_path)
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post,
                f"{server.url}/v2/models/gated/infer",
                content=body([{"x": np.full((1, 4), 7, np.float32)}]),  # 7: held in the model
                headers=MSGPACK,
                timeout=30,
            )
            gate.wait_entered()
            processes = front_ends(server)
            assert server.process is not None
            server.process.send_signal(signal.SIGKILL)
            reply = held.result()
        assert reply.status_code == 503, reply.content
        assert "lost its link" in msgpack.unpackb(reply.content)["error"]
        for process in processes:
            process.wait(30)  # and then it exits (psutil.TimeoutExpired if not)
    finally:
        gate.open()
        server.stop()

"""The pieces between a front end and the scheduler process, without
processes: errors keep their class across, one loop iteration's traffic is
one message, a stream of messages is read whole however the reads cut it,
a front end's copy of the model table answers lookups as the registry
does, and its metrics report groups what it observed."""

from __future__ import annotations

import asyncio
import math
import socket
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorserve import errors
from tensorserve.frontends.protocol import (
    Outbox,
    each_of_run,
    error_entry,
    error_from,
    in_runs,
    split_items,
)
from tensorserve.frontends.remote import Scheduler
from tensorserve.frontends.report import RequestReport
from tensorserve.ipc import messages
from tensorserve.ipc.link import Link
from tensorserve.metrics.requests import LATENCY_BUCKETS
from tensorserve.repository.config import parse_config


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidInput("item 0: bad"),
        errors.ModelNotFound("unknown model 'x'"),
        errors.ModelNotReady("model 'x' is not ready (LOADING)"),
        errors.ServerBusy("queue full", retry_after=7.0),
        errors.WouldMissTarget("late", retry_after=3.0),
        errors.DeadlineExceeded("no result within 1 s"),
        errors.ModelFailure("it raised"),
        errors.WorkerCrashed("worker died", ran=True),
        errors.OutOfMemory("too big"),
        errors.ModelControlDisabled("cannot load"),
    ],
)
def test_an_error_keeps_its_class_code_and_retry_after_across(
    error: errors.TensorServeError,
) -> None:
    again = error_from(msgpack.unpackb(msgpack.packb(error_entry(error))))
    assert (again.code, again.message, again.http_status, again.grpc_status) == (
        error.code, error.message, error.http_status, error.grpc_status,
    )  # fmt: skip
    assert getattr(again, "retry_after", None) == getattr(error, "retry_after", None)


def test_any_other_exception_is_the_servers_fault_with_its_text() -> None:
    again = error_from(error_entry(KeyError("weights")))
    assert (type(again), again.code, again.message) == (
        errors.TensorServeError, "internal", "internal error: KeyError: 'weights'",
    )  # fmt: skip


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()


async def test_one_loop_iterations_entries_travel_as_one_message_in_order(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    loop = asyncio.get_running_loop()
    received: list[messages.Message] = []
    sender = Link(sockets[0], loop, lambda m: None, lambda: None, many=True)
    receiver = Link(sockets[1], loop, received.append, lambda: None, many=True)
    outbox = Outbox(asyncio.get_running_loop(), sender.send)
    a, b = np.arange(3, dtype=np.int64), np.ones((2, 2), np.float32)
    outbox.add("infer", [1, "m"], [a])
    outbox.add("infer", [2, "m"], [b])
    outbox.put("late", {"m": ["slow", 2.0]})
    while not received:
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.01)
    assert len(received) == 1
    header, tensors = received[0]
    assert header["infer"] == [[1, "m"], [2, "m"]] and header["late"] == {"m": ["slow", 2.0]}
    got = tensors  # in the order sent
    assert got[0].tolist() == a.tolist() and got[1].tolist() == b.tolist()
    sender.close()
    receiver.close()


def test_a_stream_is_read_whole_however_the_reads_cut_it(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    left, right = sockets
    big = np.arange(300_000, dtype=np.float32)  # larger than a read
    sent = [({"n": i}, {"t": np.full(i + 1, i, np.int16)}) for i in range(5)] + [
        ({"n": 5}, {"t": big})
    ]
    stream = b"".join(bytes(b) for h, t in sent for b in messages.frames(h, t))
    reader = messages.StreamReader()
    got: list[messages.InOrder] = []
    right.setblocking(False)
    for start in range(0, len(stream), 7919):  # cut anywhere, a message split or many in one
        left.sendall(stream[start : start + 7919])
        while (read := reader.feed(right)) is not None:
            got.extend(read)
    assert [h["n"] for h, _ in got] == [0, 1, 2, 3, 4, 5]
    assert got[2][1][0].tolist() == [2, 2, 2]
    assert np.array_equal(got[5][1][0], big)
    left.close()
    with pytest.raises(EOFError):
        reader.feed(right)


def test_every_kind_of_array_crosses_as_itself_through_each_way_of_sending(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    """A message's arrays are written as themselves (no memoryview each):
    0-d, empty, non-contiguous, a row of a larger batch and bytes all
    arrive equal, whether sent buffer by buffer or joined into one."""
    left, right = sockets
    batch = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    tensors = {
        "scalar": np.array(2.5, np.float64),
        "empty": np.zeros((0, 7), np.int64),
        "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
        "row": batch[2, :3],
        "bits": np.array([0x3F80, 0xC000], np.uint16),
        "strings": np.array([b"ab", b"", "é".encode()], dtype=object),
    }
    messages.send(left, {"n": 1}, tensors)
    left.sendall(b"".join(messages.frames({"n": 2}, tensors)))
    for n in (1, 2):
        header, got = messages.recv(right)
        assert header["n"] == n
        assert list(got) == list(tensors)
        for name, array in tensors.items():
            assert got[name].shape == array.shape, name
            assert got[name].dtype == array.dtype, name
            assert got[name].tolist() == array.tolist(), name


@st.composite
def array_sequences(draw: st.DrawFn) -> list[np.ndarray]:
    """What crosses between a front end and the scheduler process, in
    order: runs of one dtype and trailing shape, broken anywhere."""
    arrays: list[np.ndarray] = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["ids", "rows", "scalar", "bytes", "transposed"]))
        n = draw(st.integers(0, 5))
        if kind == "ids":
            arrays.append(np.arange(n, dtype=draw(st.sampled_from([np.int64, np.int32]))))
        elif kind == "rows":
            width = draw(st.sampled_from([0, 1, 9]))
            arrays.append(np.full((n, width), n, np.float32))
        elif kind == "scalar":
            arrays.append(np.array(float(n)))
        elif kind == "bytes":
            arrays.append(np.array([b"x" * i for i in range(n)], dtype=object))
        else:
            arrays.append(np.arange(n * 2, dtype=np.int16).reshape(n, 2).T)
    return arrays


@given(arrays=array_sequences(), cut=st.integers(1, 97))
@settings(max_examples=200, deadline=None)
def test_arrays_sent_in_order_arrive_in_order_as_themselves(
    arrays: list[np.ndarray], cut: int
) -> None:
    """Runs of arrays are announced once (``frames_in_order``); each still
    arrives with its own dtype, shape and values, however the reads cut
    the stream."""
    left, right = socket.socketpair()
    with left, right:
        stream = b"".join(bytes(b) for b in messages.frames_in_order({"n": 1}, arrays))
        reader, got = messages.StreamReader(), []
        right.setblocking(False)
        for start in range(0, len(stream), cut):
            left.sendall(stream[start : start + cut])
            while (read := reader.feed(right)) is not None:
                got.extend(read)
    [(header, received)] = got
    assert header == {"n": 1}
    # Read as one message (a worker's way), the same arrays come named in order.
    left, right = socket.socketpair()
    with left, right:
        left.sendall(stream)
        named_header, named = messages.recv(right)
    assert named_header == {"n": 1} and list(named) == [str(i) for i in range(len(arrays))]
    for back in (received, list(named.values())):
        assert len(back) == len(arrays)
        for sent, one in zip(arrays, back):
            assert (one.dtype, one.shape) == (sent.dtype, sent.shape)
            assert one.tolist() == sent.tolist()


async def test_a_large_message_never_blocks_the_loop_whatever_the_socket_buffer(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    left, right = sockets
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    loop = asyncio.get_running_loop()
    sender = Link(left, loop, lambda m: None, lambda: None, many=True)
    big = np.arange(2_000_000, dtype=np.int32)
    sender.send(messages.frames({"n": 1}, {"t": big}))  # returns at once, far from all sent
    assert sender.unsent_bytes > 0
    ticks = 0
    received: list[messages.InOrder] = []
    right.setblocking(False)
    reader = messages.StreamReader()
    while not received:
        ticks += 1  # the loop runs on while the rest goes out as the socket drains
        await asyncio.sleep(0)
        try:
            read = reader.feed(right)
        except BlockingIOError:
            read = None
        received.extend(read or [])
    assert ticks > 1 and np.array_equal(received[0][1][0], big)
    sender.close()


def test_requests_are_reported_grouped_by_outcome() -> None:
    report = RequestReport()
    report.observe("http", "m", "1", "ok", 200, 1, 0.01)
    report.observe("http", "m", "1", "ok", 200, 2, 0.02)
    report.observe("grpc", "m", "1", "invalid_input", 400, 0, 0.001)
    report.observe_encode("m", 0.0001)
    report.refused("m")
    report.in_flight.inc()
    taken = report.take()

    def buckets(*seconds: float) -> list[int]:  # as the histogram counts them
        counts = [0] * (len(LATENCY_BUCKETS) + 1)
        for value in seconds:
            counts[next(i for i, b in enumerate([*LATENCY_BUCKETS, math.inf]) if value <= b)] += 1
        return counts

    assert sorted(map(tuple, taken["requests"])) == [
        ("grpc", "m", "1", "invalid_input", 400, 1, 0, buckets(0.001), 0.001),
        ("http", "m", "1", "ok", 200, 2, 3, buckets(0.01, 0.02), 0.01 + 0.02),
    ]
    assert taken["encode"] == [["m", buckets(0.0001), 0.0001]] and taken["refused"] == [("m", 1)]
    assert taken["in_flight"] == 1 and not report.pending
    assert report.take() == {"in_flight": 1}


CONFIG = parse_config(
    {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
     "output": [{"name": "y", "dtype": "float32", "shape": [-1]}]},
    "m/config.toml",
).model_dump(mode="json")  # fmt: skip


def test_a_front_ends_table_answers_lookups_as_the_registry_does(
    sockets: tuple[socket.socket, socket.socket],
) -> None:
    scheduler = Scheduler(sockets[0])
    scheduler._models(
        [
            ["m", 1, "READY", "", CONFIG, False, 1],
            ["f", None, "FAILED", "bad weights", None, False, 2],
        ]
    )
    model = scheduler.ready_model("m")
    assert (model.name, model.version, model.config.input[0].name) == ("m", 1, "x")
    with pytest.raises(errors.ModelNotFound, match=r"^unknown model 'nope'$"):
        scheduler.ready_model("nope")
    with pytest.raises(errors.ModelNotFound, match=r"version '2' is not served"):
        scheduler.ready_model("m", "2")
    with pytest.raises(
        errors.ModelNotReady, match=r"^model 'f' is not ready \(FAILED\): bad weights$"
    ):
        scheduler.ready_model("f")
    scheduler.late = {"m": ["model 'm' would answer in ~900 ms", 4.0]}
    with pytest.raises(errors.WouldMissTarget) as refused:
        model.refuse_if_late()
    assert refused.value.retry_after == 4.0
    assert scheduler.metrics.requests.take()["refused"] == [("m", 1)]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),  # model
            st.sampled_from([None, 2.5]),  # timeout
            st.sampled_from([0, 1]),  # priority
            st.sampled_from([1, 1, 1, 2]),  # items
            st.sampled_from([{}, {}, {}, {"k": 1}]),  # parameters
            st.sampled_from([None, None, None, "00-trace"]),
        ),
        max_size=25,
    )
)
@settings(max_examples=200, deadline=None)
def test_plain_requests_travel_as_runs_that_stand_for_exactly_them(
    shapes: list[tuple[str, float | None, int, int, dict[str, int], str | None]],
) -> None:
    """``in_runs`` writes each stretch of consecutive plain requests (one
    item, no parameters, no trace, the rest shared) as one run, and only
    those: expanded again they are the requests, in order."""
    requests = [
        [rid, model, "1", 3, timeout, priority, parameters, ["x"], items, traced, f"id-{rid}"]
        for rid, (model, timeout, priority, items, parameters, traced) in enumerate(shapes)
    ]
    sent = in_runs(requests)
    expanded = [
        one for entry in sent for one in (each_of_run(entry) if type(entry[0]) is list else [entry])
    ]

    def without_parameters(request: list[Any]) -> list[Any]:  # none: {} or None alike
        return request[:6] + [request[6] or None] + request[7:]

    assert [without_parameters(r) for r in expanded] == [without_parameters(r) for r in requests]
    for entry in sent:
        if type(entry[0]) is list:
            assert len(entry[0]) > 1, "a run has two requests or more"
    for before, after in zip(sent, sent[1:]):  # two runs side by side would have been one
        if type(before[0]) is list and type(after[0]) is list:
            assert before[1:7] != after[1:7]


@given(st.integers(0, 3), st.integers(0, 5), st.integers(0, 4), st.integers(0, 3))
def test_a_messages_arrays_split_into_each_requests_items_by_name(
    width: int, items: int, before: int, after: int
) -> None:
    """``split_items`` reads ``items`` dicts of the names, in order, from
    where the request's arrays start, and says where the next begin."""
    names = [f"input_{k}" for k in range(width)]
    arrays = [np.full(1, i) for i in range(before + width * items + after)]
    split, end = split_items(arrays, before, names, items)
    assert end == before + width * items
    assert len(split) == items
    for i, item in enumerate(split):
        assert list(item) == names
        for k, name in enumerate(names):
            assert item[name] is arrays[before + i * width + k]


def test_a_record_crosses_as_the_array_of_its_fields_and_is_read_back_by_name() -> None:
    """``records.Request`` and ``Run`` are the wire's arrays, named: encoded
    they are the bytes of the list a front end sends, and a list read back
    is the record, each field where its name says."""
    import msgspec

    from tensorserve.frontends.records import Request, Run

    entry = [7, "m", "1", 3, 2.5, 1, {"k": 1}, ["x", "mask"], 2, "00-trace", "id-7"]
    request = Request(*entry)
    assert msgspec.msgpack.encode(request) == msgpack.packb(entry)
    assert (request.rid, request.items, request.request_id) == (7, 2, "id-7")
    assert msgspec.msgpack.decode(msgpack.packb(entry), type=Request) == request
    assert not request.plain() and Request(*entry[:6], None, ["x"], 1, None, "i").plain()
    run = [[1, 2], "m", "1", 3, None, 0, ["x"], ["id-1", "id-2"]]
    assert msgspec.msgpack.encode(Run(*run)) == msgpack.packb(run)
    assert [msgspec.structs.astuple(r) for r in Run(*run).requests()] == [
        tuple(r) for r in each_of_run(run)
    ]

"""Property test: no body, however malformed, gets a 5xx or hangs, on either
protocol, and the server still answers a correct request afterwards.

The bodies are structurally plausible (a native ``{"items": [...]}`` map, a
KServe v2 ``{"inputs": [...]}`` object, tensors with dtype, shape and data)
with hostile leaves anywhere: a wrong type where a name, dtype, shape or
parameter belongs (lists and maps included), unknown dtypes, impossible or
huge shapes, data that disagrees with its shape, non-finite and huge
numbers, junk keys. Bounded (``max_examples``) so it costs a few seconds.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Self

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorserve.http.app import create_app
from tensorserve.settings import Settings
from tensorserve.tensors.dtypes import DTYPES
from tests.helpers import MSGPACK, write_toy_model

MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, ids, real):  # each feature has its own length
            return ids.float() * 10 + real.sum(dim=1, keepdim=True)
"""
CONFIG: dict[str, Any] = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 0.0},
    "inputs": {
        "ids": {"dtype": "int64", "shape": [-1], "max_length": 64},
        "real": {"dtype": "float32", "shape": [-1], "max_length": 64},
    },
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
    "warmup": {"enabled": False},
}
ROUTE = "/v2/models/m/infer"
ANSWER_WITHIN_S = 10.0  # far above any honest answer: past it, the server hung
FUZZ = settings(
    max_examples=100,
    deadline=None,  # the per-request bound is ANSWER_WITHIN_S
    database=None,
    # One app for every example, on purpose: it must survive them all.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ---------------------------------------------------------------------- strategies
NAMES = ["ids", "real", "y", "", "IDS", "x" * 300]
DTYPE_NAMES = [*DTYPES, "int46", "float", "BYTES", "object", "<f4"]
V2_NAMES = [*(dt.v2 for dt in DTYPES.values()), "BYTES", "FP8", "int64", ""]
# msgpack holds integers from -2**63 to 2**64 - 1; JSON holds any.
NUMBERS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, 2**64 - 1, 1e300, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=6))
# Anything at all: what a hostile leaf may be, nested a little.
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def hostile(
    plausible: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = JUNK
) -> st.SearchStrategy[Any]:
    """The plausible value, or one time in eight anything: rare enough per
    field that most bodies get deep before something is wrong."""
    return st.integers(0, 7).flatmap(lambda n: junk if n == 3 else plausible)


SHAPES = st.lists(
    st.one_of(st.integers(0, 6), st.sampled_from([-1, 64, 65, 2**31, 2**62]), JUNK),
    max_size=4,
)
# Values a feature may hold: right for it, of the other kind, out of range,
# ragged, empty, too long (max_length is 64).
VALUES = {
    "ids": st.lists(st.integers(0, 1000), min_size=1, max_size=6),
    "real": st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=6),
}
BAD_VALUES = st.one_of(
    st.lists(NUMBERS, max_size=6),
    st.lists(st.lists(NUMBERS, max_size=3), max_size=3),
    st.lists(st.booleans(), max_size=4),
    st.just(list(range(65))),
)
DTYPE_OF = {"ids": "int64", "real": "float32"}


def as_array(values: Any, dtype: str, otherwise: tuple[int, ...]) -> np.ndarray:
    """The bytes a client would send for ``values`` (zeros where numpy cannot)."""
    try:
        with np.errstate(all="ignore"):  # an overflowing cast is fine: it is hostile data
            return np.asarray(values, dtype)
    except (ValueError, TypeError, OverflowError):
        return np.zeros(otherwise, dtype)


@st.composite
def native_tensor(draw: st.DrawFn, name: str) -> Any:
    """A feature as a plain list, or typed (dtype, shape, raw bytes), each
    part of it possibly wrong or missing."""
    values = draw(st.one_of(VALUES[name], VALUES[name], BAD_VALUES))
    if draw(st.booleans()):
        return values
    dtype = draw(hostile(st.sampled_from([DTYPE_OF[name]] * 4 + DTYPE_NAMES)))
    raw = as_array(values, DTYPE_OF[name], (3,))
    data = raw.tobytes()
    tensor = {
        "dtype": dtype,
        "shape": draw(hostile(st.just(list(raw.shape)), SHAPES | JUNK)),
        "data": draw(hostile(st.just(data), st.binary(max_size=48) | JUNK)),
    }
    for key in draw(st.sets(st.sampled_from(["dtype", "shape", "data"]), max_size=1)):
        if draw(st.integers(0, 7)) == 3:
            del tensor[key]
    return tensor


@st.composite
def native_item(draw: st.DrawFn) -> Any:
    item = {name: draw(hostile(native_tensor(name))) for name in ("ids", "real")}
    if draw(st.integers(0, 7)) == 3:
        del item[draw(st.sampled_from(["ids", "real"]))]
    if draw(st.integers(0, 7)) == 3:
        item[draw(st.sampled_from(NAMES))] = draw(JUNK)
    return item


@st.composite
def native_body(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 15)) == 3:
        return draw(st.binary(max_size=40))  # not msgpack at all, now and then
    message: dict[str, Any] = {
        "items": draw(hostile(st.lists(hostile(native_item()), min_size=1, max_size=3)))
    }
    if draw(st.booleans()):
        message["parameters"] = draw(
            hostile(st.fixed_dictionaries({"timeout_ms": hostile(st.floats(1, 60_000))}))
        )
    if draw(st.integers(0, 3)) == 2:
        message["id"] = draw(hostile(st.text(max_size=8)))
    if draw(st.integers(0, 7)) == 3:
        message[draw(st.text(max_size=5))] = draw(JUNK)
    return msgpack.packb(draw(hostile(st.just(message))))


@st.composite
def oip_input(draw: st.DrawFn, name: str, rows: int) -> tuple[dict[str, Any], bytes]:
    """One input (JSON data, or binary), and the bytes it puts after the header."""
    width = draw(st.integers(1, 4))
    values = draw(
        st.one_of(
            st.lists(VALUES[name], min_size=rows, max_size=rows),
            st.lists(VALUES[name].map(lambda v: v[:1] * width), min_size=rows, max_size=rows),
            BAD_VALUES,
        )
    )
    array = as_array(values, DTYPE_OF[name], (rows, width))
    tensor: dict[str, Any] = {
        "name": draw(hostile(st.sampled_from([name] * 6 + NAMES))),
        "datatype": draw(hostile(st.sampled_from([DTYPES[DTYPE_OF[name]].v2] * 6 + V2_NAMES))),
        "shape": draw(hostile(st.just(list(array.shape)), SHAPES | JUNK)),
    }
    binary = b""
    if draw(st.booleans()):
        tensor["data"] = draw(hostile(st.just(values), BAD_VALUES | JUNK))
    else:
        binary = array.tobytes()
        size = draw(hostile(st.just(len(binary)), st.integers(-4, 200)))
        tensor["parameters"] = {"binary_data_size": size}
    if draw(st.integers(0, 7)) == 3:
        tensor.setdefault("parameters", {})["shared_memory_region"] = draw(JUNK)
    if draw(st.integers(0, 7)) == 3:
        del tensor[draw(st.sampled_from(["name", "datatype", "shape"]))]
    return tensor, binary


@st.composite
def oip_body(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    rows = draw(st.integers(1, 3))
    drawn = [draw(oip_input(name, rows)) for name in ("ids", "real")]
    inputs = [tensor for tensor, _ in drawn]
    if draw(st.integers(0, 7)) == 3:
        inputs = inputs[: draw(st.integers(0, 1))] + draw(st.lists(JUNK, max_size=2))
    message: dict[str, Any] = {"inputs": draw(hostile(st.just(inputs)))}
    if draw(st.booleans()):
        message["parameters"] = draw(
            hostile(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "timeout": hostile(st.integers(0, 10**8)),
                        "priority": hostile(st.integers(0, 3)),
                        "binary_data_output": hostile(st.booleans()),
                        "sequence_id": hostile(st.just(0)),
                    },
                )
            )
        )
    if draw(st.booleans()):
        output = st.fixed_dictionaries(
            {"name": hostile(st.sampled_from(["y", "y", *NAMES]))},
            optional={"parameters": hostile(st.fixed_dictionaries({"binary_data": st.booleans()}))},
        )
        message["outputs"] = draw(hostile(st.lists(hostile(output), max_size=2)))
    if draw(st.integers(0, 3)) == 2:
        message["id"] = draw(hostile(st.text(max_size=8)))
    # NaN and Infinity as JSON's extensions write them.
    header = json.dumps(draw(hostile(st.just(message)))).encode()
    binary = b"".join(part for _, part in drawn)
    if not binary and draw(st.booleans()):
        return header, {"Content-Type": "application/json"}
    junk_length = st.integers(-5, 200) | st.text(alphabet="0123456789x -+.", max_size=4)
    length = draw(hostile(st.just(len(header)), junk_length))
    return header + binary, {"Inference-Header-Content-Length": str(length)}


# ---------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("hostile")
    write_toy_model(repo, "m", MODEL, **CONFIG)
    return repo


@pytest.fixture
async def client(aiohttp_client: Any, repository: Path) -> Any:
    return await aiohttp_client(
        create_app(Settings(model_repository=repository), wait_for_models=True)
    )


async def post(client: Any, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    async def exchange() -> tuple[int, bytes]:
        response = await client.post(ROUTE, data=data, headers=headers)
        return response.status, await response.read()

    return await asyncio.wait_for(exchange(), ANSWER_WITHIN_S)


async def assert_still_serving(client: Any) -> None:
    ids, real = [1, 2, 3], [0.5, 0.25, 0.0]
    good = msgpack.packb({"items": [{"ids": ids, "real": real}]})
    status, reply = await post(client, good, MSGPACK)
    assert status == 200, reply
    y = msgpack.unpackb(reply)["outputs"][0]["y"]
    got = np.frombuffer(y["data"], dtype=y["dtype"]).reshape(y["shape"])
    np.testing.assert_array_equal(got, np.array(ids) * 10 + np.float32(sum(real)))


def assert_refused_or_served(status: int, reply: bytes, body: bytes) -> None:
    if status == 504:
        # A well-formed body whose own deadline (a fuzzed timeout of a
        # millisecond or so) passed before a busy machine ran it: an honest
        # refusal the client asked for, not a server error.
        code = (msgpack.unpackb(reply) if reply[:1] != b"{" else json.loads(reply))["code"]
        assert code == "deadline_exceeded", f"{status} {reply[:300]!r} for {body[:300]!r}"
        return
    assert status < 500, f"{status} {reply[:300]!r} for {body[:300]!r}"


@FUZZ
@given(body=native_body())
async def test_native_bodies_never_get_a_5xx(client: Any, body: bytes) -> None:
    status, reply = await post(client, body, MSGPACK)
    assert_refused_or_served(status, reply, body)
    await assert_still_serving(client)


@FUZZ
@given(request=oip_body())
async def test_oip_bodies_never_get_a_5xx(
    client: Any, request: tuple[bytes, dict[str, str]]
) -> None:
    body, headers = request
    status, reply = await post(client, body, headers)
    assert_refused_or_served(status, reply, body)
    if status == 400:  # a refusal says why, in the protocol's error shape
        assert json.loads(reply)["code"] == "invalid_input"
    await assert_still_serving(client)


# ---------------------------------------------------------------------- gRPC
# Hostile ModelInferRequests (every field the message allows, with hostile
# values) to the gRPC front end, serving the same app's data plane: never
# INTERNAL or UNKNOWN (a server fault), never a hang, and still serving after.
INT64 = st.integers(-(2**63), 2**63 - 1)
SHAPE_DIM = st.one_of(st.integers(-3, 70), INT64)


@st.composite
def grpc_parameter(draw: st.DrawFn) -> Any:
    from tensorserve.grpc.generated import grpc_service_pb2 as pb

    value = pb.InferParameter()
    kind = draw(st.sampled_from(["bool", "int64", "uint64", "double", "string", "none"]))
    if kind == "bool":
        value.bool_param = draw(st.booleans())
    elif kind == "int64":
        value.int64_param = draw(INT64)
    elif kind == "uint64":
        value.uint64_param = draw(st.integers(0, 2**64 - 1))
    elif kind == "double":
        value.double_param = draw(st.floats())
    elif kind == "string":
        value.string_param = draw(st.text(max_size=20))
    return value


@st.composite
def grpc_request(draw: st.DrawFn) -> Any:
    from tensorserve.grpc.generated import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["m", "m", "m", "", "nope"])),
        model_version=draw(st.sampled_from(["", "", "1", "2", "x"])),
        id=draw(st.text(max_size=10)),
    )
    keys = st.sampled_from(["timeout", "priority", "sequence_id", "binary_data_output", "junk"])
    for key in draw(st.lists(keys, max_size=3)):
        request.parameters[key].CopyFrom(draw(grpc_parameter()))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(
            name=draw(st.sampled_from(NAMES)),
            datatype=draw(st.sampled_from(V2_NAMES)),
            shape=draw(st.lists(SHAPE_DIM, max_size=4)),
        )
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=300)))
        elif draw(st.booleans()):
            tensor.contents.int64_contents.extend(draw(st.lists(INT64, max_size=70)))
        else:
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=70)))
    if raw and draw(st.booleans()):  # one more raw tensor than inputs
        request.raw_input_contents.append(b"\0" * 8)
    for name in draw(st.lists(st.sampled_from(NAMES), max_size=2)):
        request.outputs.add(name=name)
    return request


@pytest.fixture
async def grpc_stub(client: Any) -> Any:
    import grpc

    from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc
    from tensorserve.grpc.server import GrpcFrontEnd
    from tensorserve.http.keys import PLANE

    plane = client.server.app[PLANE]
    plane.settings = plane.settings.model_copy(update={"host": "127.0.0.1", "grpc_port": 0})
    front_end = GrpcFrontEnd(plane)
    await front_end.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{front_end.port}")
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    await channel.close()
    await front_end.stop_accepting()
    await front_end.close()


async def assert_grpc_still_serving(stub: Any) -> None:
    from tensorserve.grpc.generated import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="ids", datatype="INT64", shape=[1, 3]).contents.int64_contents.extend(
        [1, 2, 3]
    )
    request.inputs.add(name="real", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend(
        [0.5, 0.25]
    )
    reply = await asyncio.wait_for(stub.ModelInfer(request), ANSWER_WITHIN_S)
    got = np.frombuffer(reply.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(got, np.array([10, 20, 30], np.float32) + np.float32(0.75))


@FUZZ
@given(request=grpc_request())
async def test_grpc_requests_never_get_a_server_fault(grpc_stub: Any, request: Any) -> None:
    import grpc

    try:
        await asyncio.wait_for(grpc_stub.ModelInfer(request), ANSWER_WITHIN_S)
    except grpc.aio.AioRpcError as error:
        status = error.code()
        assert status not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (
            f"{status} {error.details()!r} for {request!r}"[:600]
        )
        if status is grpc.StatusCode.INVALID_ARGUMENT:  # a refusal says why, with its code
            assert dict(error.trailing_metadata())["tensorserve-code"] == "invalid_input"
    await assert_grpc_still_serving(grpc_stub)


async def test_a_refused_grpc_request_is_freed_without_a_gc_pass(grpc_stub: Any) -> None:
    """Nothing keeps a refused call's request message in a reference cycle
    (``context.abort`` did: its error, held by grpc, held the handler's frame),
    where each one (~45 MB for a 4 MiB message of a million strings) waited
    for a full gc pass."""
    import gc

    import grpc

    from tensorserve.grpc.generated import grpc_service_pb2 as pb
    from tensorserve.grpc.service import RawInferRequest

    refused = pb.ModelInferRequest(model_name="m")  # parsed, then refused by the decoder
    ids = refused.inputs.add(name="ids", datatype="INT32", shape=[1, 3])
    ids.contents.int_contents.extend([1, 2, 3])
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass finds unreachable stays in gc.garbage
    try:
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(grpc_stub.ModelInfer(refused), ANSWER_WITHIN_S)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "does not match the model's INT64" in (caught.value.details() or "")
            assert dict(caught.value.trailing_metadata())["tensorserve-code"] == "invalid_input"
        await assert_grpc_still_serving(grpc_stub)  # the refused calls' handlers are over
        gc.collect()
        held = (pb.ModelInferRequest, RawInferRequest)
        cycles = [type(o).__name__ for o in gc.garbage if isinstance(o, held)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cycles == [], f"{len(cycles)} request messages were freed only by a gc pass"


# ---------------------------------------------------------------------- floods
# Bodies built to cost the server far more than their size (issue #52), each
# sent to a real server process while a good caller loops beside it: each gets
# a 4xx, the good caller never fails and never waits a second, and the server
# grows by at most 4x the body plus 50 MB. Scaled to a few MiB each; the full
# sizes are in benchmarks/hostile_bodies.py.
FLOOD_WORDS = """
    import numpy as np
    import torch

    class Model(torch.nn.Module):
        def forward(self, words):
            return {"n": torch.tensor([[len(row)] for row in words])}
"""
FLOOD_WORDS_IO: dict[str, Any] = {
    "max_batch_size": 8,
    "inputs": {"words": {"dtype": "bytes", "shape": [-1], "max_length": 64}},
    "outputs": {"n": {"dtype": "int64", "shape": [1]}},
    "warmup": {"enabled": False},
}
GOOD_WORST_S = 1.0
RSS_SLACK = 50 << 20
MANY = 1 << 20


def _oip_header(tensor: dict[str, Any]) -> bytes:
    return json.dumps({"inputs": [{"name": "words", "datatype": "BYTES", **tensor}]}).encode()


def _flood_bodies() -> dict[str, tuple[bytes, dict[str, str], str]]:
    """name -> (body, headers, a phrase of the refusal)."""
    import gzip
    import struct

    empty = gzip.compress(b"", mtime=0)
    frames = (struct.pack("<I", 1) + b"a") * MANY  # a million 1-byte strings
    binary = _oip_header({"shape": [MANY, 1], "parameters": {"binary_data_size": len(frames)}})
    return {
        "gzip members": (
            empty * ((2 << 20) // len(empty)),
            {"Content-Encoding": "gzip", "Content-Type": "application/json"},
            "more than 64 members",
        ),
        "kserve json strings": (
            _oip_header({"shape": [1, 1], "data": ["ab"] * MANY}),
            {"Content-Type": "application/json"},
            "strings or more",
        ),
        "binary bytes rows": (
            binary + frames,
            {"Inference-Header-Content-Length": str(len(binary))},
            "the batch dimension is",
        ),
        "native strings": (
            msgpack.packb({"items": [{"words": ["ab"] * (2 * MANY)}]}),
            MSGPACK,
            "max_array_len",
        ),
    }


FLOODS = _flood_bodies()


class GoodCaller:
    """A thread that asks the small model again and again, on one keep-alive
    connection, recording each answer's latency and any failure."""

    def __init__(self, port: int) -> None:
        import threading

        self.port = port
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import http.client
        import time

        good = msgpack.packb({"items": [{"ids": [1, 2, 3], "real": [0.5, 0.25, 0.0]}]})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("POST", ROUTE, good, MSGPACK)
                reply = connection.getresponse()
                data = reply.read()
                if reply.status != 200:
                    self.failures.append(f"{reply.status} {data[:200]!r}")
            except OSError as exc:
                self.failures.append(repr(exc))
                connection.close()
            self.latencies.append(time.perf_counter() - started)
        connection.close()

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(60)


class PeakRss:
    """The server tree's RSS, sampled every 10 ms until stopped."""

    def __init__(self, server: Any) -> None:
        import threading

        self.server = server
        self.baseline = server.usage().rss_bytes
        self.peak = self.baseline
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, self.server.usage().rss_bytes)

    def grown(self) -> int:
        self.stop.set()
        self.thread.join(10)
        self.peak = max(self.peak, self.server.usage().rss_bytes)
        return self.peak - self.baseline


@pytest.fixture(scope="module", params=["1", "2"], ids=["one process", "frontends 2"])
def flood_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import shutil

    from tests.conftest import ROOT, ServerProcess

    repo = tmp_path_factory.mktemp("floods")
    write_toy_model(repo, "m", MODEL, **CONFIG)
    write_toy_model(repo, "words", FLOOD_WORDS, **FLOOD_WORDS_IO)
    shutil.copytree(ROOT / "model_repository" / "tokenizer", repo / "tokenizer")
    server = ServerProcess(repo, "--frontends", request.param)
    yield server
    server.stop()


def _front_ends(server: Any) -> set[int]:
    """The pids of the server's front-end processes (none in one process).
    A child that has just exited (a zombie until the server reaps it: a
    spare template or worker that was stopped) has no command line, and is
    no front end."""
    import psutil

    def command(child: psutil.Process) -> str:
        try:
            return " ".join(child.cmdline())
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            return ""

    return {
        child.pid
        for child in psutil.Process(server.process.pid).children()
        if "tensorserve.frontends.process" in command(child)
    }


def _assert_calm(good: GoodCaller, rss: PeakRss, size: int, front_ends: set[int]) -> None:
    assert not good.failures, good.failures[:3]
    assert good.latencies, "the good caller got no answer at all"
    assert max(good.latencies) < GOOD_WORST_S, f"worst {max(good.latencies):.2f} s"
    grown = rss.grown()
    assert grown <= 4 * size + RSS_SLACK, f"grew {grown >> 20} MiB for a {size >> 20} MiB body"
    assert _front_ends(rss.server) == front_ends, "a front end was killed and replaced"


@pytest.mark.parametrize("attack", list(FLOODS))
def test_a_flood_is_refused_while_a_good_caller_is_served(flood_server: Any, attack: str) -> None:
    import urllib.error
    import urllib.request

    body, headers, phrase = FLOODS[attack]
    host = flood_server.url
    route = f"{host}/v2/models/words/infer"
    front_ends = _front_ends(flood_server)
    rss = PeakRss(flood_server)
    with GoodCaller(flood_server.port) as good:
        for _ in range(3):
            request = urllib.request.Request(route, data=body, headers=headers, method="POST")
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=60)
            reply = caught.value.read()
            caught.value.close()
            assert 400 <= caught.value.code < 500, reply[:300]
            assert phrase in reply.decode("utf-8", "replace"), reply[:300]
    _assert_calm(good, rss, len(body), front_ends)


def test_a_grpc_flood_is_refused_while_a_good_caller_is_served(flood_server: Any) -> None:
    import grpc

    from tensorserve.grpc.generated import grpc_service_pb2 as pb
    from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc

    def words(values: list[bytes]) -> Any:
        request = pb.ModelInferRequest(model_name="words")
        tensor = request.inputs.add(name="words", datatype="BYTES", shape=[1, 1])
        tensor.contents.bytes_contents.extend(values)
        return request

    flood = words([b"ab"] * MANY)
    options = [("grpc.max_send_message_length", 64 << 20)]
    with grpc.insecure_channel(flood_server.grpc_address, options=options) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        # A server that has answered gRPC before: its first call's set-up is no flood's.
        assert stub.ModelInfer(words([b"ab"]), timeout=60).raw_output_contents
        front_ends = _front_ends(flood_server)
        rss = PeakRss(flood_server)
        with GoodCaller(flood_server.port) as good:
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ModelInfer(flood, timeout=60)
                error: Any = caught.value
                assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "bytes_contents holds" in error.details()
    _assert_calm(good, rss, flood.ByteSize(), front_ends)


def test_long_texts_to_the_tokenizer_are_served_while_a_good_caller_is_served(
    flood_server: Any,
) -> None:
    """Eight texts of 1 MiB at once (one batch): the tokenizer cuts each
    before encoding, so they cost milliseconds, not seconds and a GB (before:
    8 such texts took the scheduler's RSS to 1.6 GB and held others 7.3 s)."""
    import threading
    import urllib.request

    text = ("lorem ipsum, dolor sit amet " * (1 << 20))[: 1 << 20]
    data = json.dumps(
        {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}
    ).encode()
    route = f"{flood_server.url}/v2/models/tokenizer/infer"
    answers: list[Any] = []

    def ask() -> None:
        request = urllib.request.Request(route, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as reply:
            answers.append(json.loads(reply.read()))

    front_ends = _front_ends(flood_server)
    rss = PeakRss(flood_server)
    with GoodCaller(flood_server.port) as good:
        askers = [threading.Thread(target=ask) for _ in range(8)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(60)
    assert len(answers) == 8
    for answer in answers:
        ids = next(o for o in answer["outputs"] if o["name"] == "input_ids")
        assert ids["shape"] == [1, 512]  # truncated to max_length, [CLS] ... [SEP]
    _assert_calm(good, rss, 8 * len(data), front_ends)

"""BYTES tensors end to end (issue #39, item 1): the framing and the host
array (pure), collate and the worker socket, then one real server with a
model that upper-cases strings, reached over every protocol.

The model answers each row with its own string upper-cased, its length and
the size of the batch it ran in: a caller given another caller's row, or a
batch that never formed, shows at once. Co-batching is made certain, not
likely: a first caller holds the model (the string ``hold``) until the test
has seen the others queued, then they run as one batch.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tensorserve_client import Client
from tensorserve_client import InvalidInput as ClientInvalidInput
from tritonclient.utils import InferenceServerException

from tensorserve.batching.collate import pad, unpad
from tensorserve.errors import ConfigError, InvalidInput
from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tensorserve.repository.config import parse_config
from tensorserve.ipc import messages as ipc
from tensorserve.tensors.bytes_tensor import bytes_array, frame, unframe
from tests.conftest import ServerProcess
from tests.helpers import wait_until, write_toy_model

MAX_ELEMENT = 64  # the server's --max-bytes-element-length in these tests
MAX_ITEM = 100  # its --max-bytes-item-bytes: two elements of the longest fit, not three
CALLERS = 3  # queued behind the held batch, so they form one batch together

UPPER_MODEL = """
    import os, time
    import numpy as np
    import torch

    GATE = {gate!r}

    class Model(torch.nn.Module):
        def forward(self, text):
            assert isinstance(text, np.ndarray) and text.dtype == object, type(text)
            if any(element == b"hold" for element in text.reshape(-1)):
                open(GATE + ".entered", "w").close()
                deadline = time.monotonic() + 30
                while not os.path.exists(GATE) and time.monotonic() < deadline:
                    time.sleep(0.01)
            upper = np.empty(text.shape, dtype=object)
            for index, element in np.ndenumerate(text):
                assert isinstance(element, bytes), type(element)
                upper[index] = element.upper()
            lengths = torch.tensor([[len(row[0])] for row in text], dtype=torch.int64)
            batch = torch.full((len(text), 1), len(text), dtype=torch.int64)
            return {{"upper": upper, "length": lengths, "batch": batch}}
"""
UPPER_IO: dict[str, Any] = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "inputs": {"text": {"dtype": "bytes", "shape": [1]}},
    "outputs": {
        "upper": {"dtype": "bytes", "shape": [1]},
        "length": {"dtype": "int64", "shape": [1]},
        "batch": {"dtype": "int64", "shape": [1]},
    },
}

# A variable axis of strings: padded with b"", which the model counts.
WORDS_MODEL = """
    import numpy as np
    import torch

    class Model(torch.nn.Module):
        def forward(self, words):
            upper = np.vectorize(lambda w: w.upper(), otypes=[object])(words)
            blanks = torch.tensor([[sum(w == b"" for w in row)] for row in words])
            return {"upper": upper, "blanks": blanks}
"""
WORDS_IO: dict[str, Any] = {
    "max_batch_size": 8,
    # One request's items always form one batch: FIFO, no budget. The learnt
    # length-aware choice may split a 3-word item from a 1-word one once its
    # cost model finds padding dearer than a batch (seen on a busy CI machine).
    "dynamic_batching": {"policy": "fifo", "max_batch_tokens": 0},
    "inputs": {"words": {"dtype": "bytes", "shape": [-1]}},
    "outputs": {
        "upper": {"dtype": "bytes", "shape": [-1]},
        "blanks": {"dtype": "int64", "shape": [1]},
    },
}


# ---------------------------------------------------------------------- pure parts
def test_the_framing_round_trips_and_is_tritons() -> None:
    array = np.array([[b"hi", b""], ["é".encode(), b"\x00\xff"]], dtype=object)
    framed = frame(array)
    assert framed[:6] == b"\x02\x00\x00\x00hi"
    assert framed[6:10] == b"\x00\x00\x00\x00"
    back = unframe(framed, [2, 2], "x")
    assert back.dtype == object and back.tolist() == array.tolist()


@pytest.mark.parametrize(
    ("data", "shape", "message"),
    [
        (b"\x05\x00\x00\x00abc", [1], "element 0 says it is 5 bytes long, but only 3"),
        (b"\x01\x00", [1], "cannot hold 1 BYTES elements"),
        (b"\x03\x00\x00\x00abc\x01\x00", [2], "ends inside the length of element 1"),
        (b"\x01\x00\x00\x00ab", [1], "1 bytes are left after the 1 BYTES elements"),
        (b"", [10**9], "cannot hold 1000000000 BYTES elements"),
        (b"", [2**32] * 8, r"cannot hold \d+ BYTES elements"),  # no int64 wrap-around
    ],
)
def test_a_malformed_framing_is_a_sentence(data: bytes, shape: list[int], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        unframe(data, shape, "input 'text'")


def test_the_host_array_takes_str_and_bytes_and_refuses_the_rest() -> None:
    assert bytes_array([["a", b"b"]], "x").tolist() == [[b"a", b"b"]]
    assert bytes_array(np.array(["ab", "c"]), "x").tolist() == [b"ab", b"c"]
    with pytest.raises(InvalidInput, match=r"holds 3 \(int\); datatype BYTES needs strings"):
        bytes_array(["a", 3], "x")
    with pytest.raises(InvalidInput, match="not a rectangular list"):
        bytes_array([["a"], "b"], "x")


def test_collate_pads_a_variable_bytes_axis_with_empty_bytes() -> None:
    config = parse_config(
        {
            "max_batch_size": 4,
            "input": [{"name": "words", "dtype": "bytes", "shape": [-1]}],
            "output": [{"name": "echo", "dtype": "bytes", "shape": [-1]}],
        },
        "words",
    )
    items = [
        {"words": np.array([b"a", b"b", b"c"], dtype=object)},
        {"words": np.array([b"d"], dtype=object)},
    ]
    batch = pad(items, config.input)
    words = batch.features["words"]
    assert isinstance(words, np.ndarray) and words.dtype == object  # never a torch tensor
    assert words.tolist() == [[b"a", b"b", b"c"], [b"d", b"", b""]]
    rows = unpad({"echo": words}, batch, config.output, {"echo": "words"})
    assert [row["echo"].tolist() for row in rows] == [[b"a", b"b", b"c"], [b"d"]]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_value": 0}, "min_value and max_value are for integer and float inputs, not bytes"),
        ({"platform": "onnxruntime_onnx"}, "dtype bytes ('text') needs a model.py"),
    ],
)
def test_a_config_that_cannot_serve_bytes_says_why(fields: dict[str, Any], message: str) -> None:
    text = {"name": "text", "dtype": "bytes", "shape": [1]}
    platform = {k: v for k, v in fields.items() if k == "platform"}
    spec = {**text, **{k: v for k, v in fields.items() if k != "platform"}}
    data = {"input": [spec], "output": [{"name": "n", "dtype": "int64", "shape": [1]}], **platform}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(data, "strings")


def test_bytes_cross_the_worker_socket_without_pickle() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        text = np.array([[b"x" * 3], [b""]], dtype=object)
        ipc.send(ours, {"n": 1}, {"text": text, "ids": np.arange(4)})
        header, tensors = ipc.recv(theirs)
        assert header == {"n": 1}
        assert tensors["text"].tolist() == text.tolist()
        assert tensors["ids"].tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    repo = tmp_path_factory.mktemp("bytes_repo")
    gates = repo / "gates"
    gates.mkdir()
    for name, isolation in (("upper", "thread"), ("upper_proc", "process")):
        model = UPPER_MODEL.format(gate=str(gates / name))
        write_toy_model(repo, name, model, isolation=isolation, **UPPER_IO)
    write_toy_model(repo, "words", WORDS_MODEL, **WORDS_IO)
    server = ServerProcess(
        repo,
        "--max-bytes-element-length",
        str(MAX_ELEMENT),
        "--max-bytes-item-bytes",
        str(MAX_ITEM),
    )
    yield server, gates
    server.stop()


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, Any]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read(), reply.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers


def _queue_depth(server: ServerProcess, model: str) -> int:
    with urllib.request.urlopen(f"{server.url}/v2/models/{model}/stats", timeout=10) as reply:
        return int(json.load(reply)["batching"]["queue_depth"])


# Each protocol's one call: a string in, (upper, length, batch) out.
Call = Callable[[ServerProcess, str, str], tuple[bytes, int, int]]


def native_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    body = msgpack.packb({"items": [{"text": {"dtype": "bytes", "shape": [1], "data": [text]}}]})
    url = f"{server.url}/v2/models/{model}/infer"
    status, raw, _ = _post(url, body, {"Content-Type": "application/msgpack"})
    assert status == 200, raw
    outputs = msgpack.unpackb(raw)["outputs"][0]
    assert outputs["upper"]["dtype"] == "bytes" and outputs["upper"]["shape"] == [1]
    length = np.frombuffer(outputs["length"]["data"], "<i8")[0]
    batch = np.frombuffer(outputs["batch"]["data"], "<i8")[0]
    return outputs["upper"]["data"][0], int(length), int(batch)


def json_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    request = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [text]}]}
    url = f"{server.url}/v2/models/{model}/infer"
    status, raw, _ = _post(url, json.dumps(request).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw
    outputs = {out["name"]: out for out in json.loads(raw)["outputs"]}
    assert outputs["upper"]["datatype"] == "BYTES" and outputs["upper"]["shape"] == [1, 1]
    return (
        outputs["upper"]["data"][0].encode(),
        outputs["length"]["data"][0],
        outputs["batch"]["data"][0],
    )


def binary_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    data = frame(np.array([text.encode()], dtype=object))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    status, raw, headers = _post(
        f"{server.url}/v2/models/{model}/infer",
        header + data,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, raw
    length = int(headers["Inference-Header-Content-Length"])
    reply, offset, values = json.loads(raw[:length]), length, {}
    for out in reply["outputs"]:
        size = out["parameters"]["binary_data_size"]
        values[out["name"]] = (out["datatype"], raw[offset : offset + size])
        offset += size
    assert values["upper"][0] == "BYTES"
    upper = unframe(values["upper"][1], [1, 1], "upper")[0, 0]
    return (
        upper,
        int(np.frombuffer(values["length"][1], "<i8")[0]),
        int(np.frombuffer(values["batch"][1], "<i8")[0]),
    )


def grpc_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    """gRPC with ``bytes_contents`` (tritonclient sends raw contents: tested below)."""
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    tensor.contents.bytes_contents.append(text.encode())
    with grpc.insecure_channel(server.grpc_address) as channel:
        reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    raw = dict(zip((out.name for out in reply.outputs), reply.raw_output_contents))
    return (
        unframe(raw["upper"], [1, 1], "upper")[0, 0],
        int(np.frombuffer(raw["length"], "<i8")[0]),
        int(np.frombuffer(raw["batch"], "<i8")[0]),
    )


def client_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    with Client(server.url) as client:
        result = client.infer(model, {"text": np.array([text], dtype=object)})
    assert result["upper"].dtype == object
    return result["upper"][0], int(result["length"][0]), int(result["batch"][0])


def client_grpc_call(server: ServerProcess, model: str, text: str) -> tuple[bytes, int, int]:
    with Client(f"grpc://{server.grpc_address}") as client:
        result = client.infer(model, {"text": np.array([text.encode()], dtype=object)})
    assert result["upper"].dtype == object
    return result["upper"][0], int(result["length"][0]), int(result["batch"][0])


@pytest.mark.parametrize("model", ["upper", "upper_proc"])
@pytest.mark.parametrize(
    "call",
    [native_call, json_call, binary_call, grpc_call, client_call, client_grpc_call],
    ids=["native", "json", "binary", "grpc", "client", "client-grpc"],
)
def test_concurrent_callers_share_a_batch_and_each_gets_its_row(
    served: tuple[ServerProcess, Path], model: str, call: Call
) -> None:
    server, gates = served
    gate = gates / model
    entered = gates / f"{model}.entered"
    answers: dict[str, Any] = {}

    def ask(text: str) -> None:
        try:
            answers[text] = call(server, model, text)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            answers[text] = exc

    texts = [f"caller {i} héllo".ljust(10 + i, "x") for i in range(CALLERS)]
    held = threading.Thread(target=ask, args=("hold",))
    callers = [threading.Thread(target=ask, args=(text,)) for text in texts]
    try:
        held.start()
        wait_until(lambda: entered.exists() or "hold" in answers, "the held batch", timeout=30)
        assert "hold" not in answers, answers["hold"]
        for thread in callers:
            thread.start()
        wait_until(lambda: _queue_depth(server, model) >= CALLERS, "every caller queued", 30)
    finally:
        gate.touch()
        for thread in [held, *callers]:
            if thread.ident is not None:  # started
                thread.join(60)
        gate.unlink(missing_ok=True)
        entered.unlink(missing_ok=True)
    assert answers["hold"] == (b"HOLD", 4, 1)
    for text in texts:
        expected = text.encode().upper()
        assert answers[text] == (expected, len(text.encode()), CALLERS), text


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_variable_axis_is_padded_with_empty_bytes_and_unpadded(
    served: tuple[ServerProcess, Path], transport: str
) -> None:
    """Two items of 3 and 1 words in one call: one batch (the model counts
    the b"" padding of the short row), each row un-padded to its length.
    Over gRPC the client sends them as two requests (their shapes differ)."""
    server, _ = served
    url = server.url if transport == "http" else f"grpc://{server.grpc_address}"
    with Client(url) as client:
        rows = client.infer_batch(
            "words",
            [{"words": np.array(["a", "bc", "d"], dtype=object)}, {"words": [b"xyz"]}],
        )
        (strings,) = client.infer_batch("words", [{"words": np.array(["ab", "c"])}])
    assert [row["upper"].tolist() for row in rows] == [[b"A", b"BC", b"D"], [b"XYZ"]]
    if transport == "http":  # one request, one batch
        assert [row["blanks"].tolist() for row in rows] == [[0], [2]]
    assert strings["upper"].tolist() == [b"AB", b"C"]  # numpy's fixed-width str array


# ---------------------------------------------------------------------- tritonclient
def test_tritonclient_http_sends_and_reads_bytes_unchanged(
    served: tuple[ServerProcess, Path],
) -> None:
    server, _ = served
    client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        text = np.array([[b"abc"], ["d\u00e9f".encode()]], dtype=object)
        for binary in (True, False):
            tensor = triton_http.InferInput("text", [2, 1], "BYTES")
            tensor.set_data_from_numpy(text, binary_data=binary)
            outputs = [
                triton_http.InferRequestedOutput(name, binary_data=binary)
                for name in ("upper", "length")
            ]
            result = client.infer("upper", [tensor], outputs=outputs)
            upper = result.as_numpy("upper").tolist()
            if not binary:  # tritonclient gives JSON strings back as str
                upper = [[element.encode() for element in row] for row in upper]
            assert upper == [[b"ABC"], ["DéF".encode()]], binary
            assert result.as_numpy("length").tolist() == [[3], [4]]
    finally:
        client.close()


def test_tritonclient_grpc_sends_and_reads_bytes_unchanged(
    served: tuple[ServerProcess, Path],
) -> None:
    server, _ = served
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        text = np.array([[b"abc"], [b"\xff\x00"]], dtype=object)
        tensor = triton_grpc.InferInput("text", [2, 1], "BYTES")
        tensor.set_data_from_numpy(text)
        result = client.infer("upper", [tensor])
        assert result.as_numpy("upper").tolist() == [[b"ABC"], [b"\xff\x00"]]
        assert result.as_numpy("length").tolist() == [[3], [2]]
        config = client.get_model_config("upper").config
        assert triton_grpc.model_config_pb2.DataType.Name(config.input[0].data_type) == (
            "TYPE_STRING"
        )
    finally:
        client.close()


# ---------------------------------------------------------------------- errors
def test_an_element_longer_than_the_limit_is_a_400_naming_the_input(
    served: tuple[ServerProcess, Path],
) -> None:
    server, _ = served
    long = "y" * (MAX_ELEMENT + 1)
    request = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [long]}]}
    status, raw, _ = _post(
        f"{server.url}/v2/models/upper/infer",
        json.dumps(request).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 400
    assert json.loads(raw)["error"] == (
        f"item 0, feature 'text': element 0 is {MAX_ELEMENT + 1} bytes long; the server's "
        f"max_bytes_element_length is {MAX_ELEMENT}"
    )
    with Client(server.url) as client, pytest.raises(ClientInvalidInput, match="'text'.*65 bytes"):
        client.infer("upper", {"text": [long]})
    # exactly the limit is fine
    assert json_call(server, "upper", "z" * MAX_ELEMENT)[1] == MAX_ELEMENT


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_an_item_holding_more_than_the_limit_is_a_400_naming_the_input(
    served: tuple[ServerProcess, Path], transport: str
) -> None:
    """Each element within max_bytes_element_length, but together more than
    max_bytes_item_bytes: refused, naming the input; exactly the limit is served."""
    server, _ = served
    url = server.url if transport == "http" else f"grpc://{server.grpc_address}"
    with Client(url) as client:
        with pytest.raises(ClientInvalidInput) as caught:
            client.infer("words", {"words": [b"w" * MAX_ELEMENT] * 2})
        assert str(caught.value).endswith(
            f"feature 'words': its 2 elements hold {2 * MAX_ELEMENT} bytes together; the "
            f"server's max_bytes_item_bytes is {MAX_ITEM}"
        )
        words = [b"w" * MAX_ELEMENT, b"v" * (MAX_ITEM - MAX_ELEMENT)]
        assert client.infer("words", {"words": words})["upper"].tolist() == [
            word.upper() for word in words
        ]


def test_a_malformed_binary_length_prefix_is_a_400(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    data = struct.pack("<I", 1000) + b"short"
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "text",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    ).encode()
    status, raw, _ = _post(
        f"{server.url}/v2/models/upper/infer",
        header + data,
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400
    assert json.loads(raw)["error"] == (
        "input 'text': BYTES element 0 says it is 1000 bytes long, but only 5 bytes are left"
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"datatype": "BYTES", "shape": [1, 1], "data": [7]},
            "input 'text': 'data' holds 7 (int); datatype BYTES needs strings or bytes",
        ),
        (
            {"datatype": "INT64", "shape": [1, 1], "data": [7]},
            "input 'text': datatype INT64 does not match the model's BYTES",
        ),
        (  # a caller's error, not a 500 with a traceback (issue #52)
            {"datatype": "BYTES", "shape": [1, 1], "data": ["\ud800"]},
            "input 'text': 'data' element 0 is not valid Unicode text: surrogates not allowed "
            "at position 0",
        ),
    ],
    ids=["non-string element", "dtype mismatch", "lone surrogate"],
)
def test_json_refusals(
    served: tuple[ServerProcess, Path], inputs: dict[str, Any], message: str
) -> None:
    server, _ = served
    request = {"inputs": [{"name": "text", **inputs}]}
    status, raw, _ = _post(
        f"{server.url}/v2/models/upper/infer",
        json.dumps(request).encode(),
        {"Content-Type": "application/json"},
    )
    assert (status, json.loads(raw)["error"]) == (400, message)


def test_native_dtype_mismatch_and_numbers_for_bytes_are_400s(
    served: tuple[ServerProcess, Path],
) -> None:
    server, _ = served
    url = f"{server.url}/v2/models/upper/infer"
    typed = {"dtype": "int64", "shape": [1], "data": np.int64(5).tobytes()}
    for feature, message in (
        (typed, "item 0, feature 'text': dtype int64 does not match the declared bytes"),
        ([5], "item 0, feature 'text': the list holds 5 (int); datatype BYTES needs strings"),
    ):
        body = msgpack.packb({"items": [{"text": feature}]})
        status, raw, _ = _post(url, body, {"Content-Type": "application/msgpack"})
        assert status == 400
        assert msgpack.unpackb(raw)["error"].startswith(message)


def test_grpc_errors_are_invalid_argument(served: tuple[ServerProcess, Path]) -> None:
    server, _ = served
    client = triton_grpc.InferenceServerClient(server.grpc_address)
    try:
        tensor = triton_grpc.InferInput("text", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"q" * (MAX_ELEMENT + 1)]], dtype=object))
        with pytest.raises(InferenceServerException, match="max_bytes_element_length is 64"):
            client.infer("upper", [tensor])
        tensor = triton_grpc.InferInput("text", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 1), np.float32))
        with pytest.raises(InferenceServerException, match="FP32 does not match the model's"):
            client.infer("upper", [tensor])
    finally:
        client.close()

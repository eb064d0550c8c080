"""The client's pure core: encoding, decoding, error mapping and retry
decisions, without a server or an event loop."""

from __future__ import annotations

import builtins
import email.utils
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from tensorserve_client import (
    BadRequest,
    Client,
    ConnectionError,
    DeadlineExceeded,
    InternalError,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    ModelNotReady,
    ProtocolError,
    RequestTimeout,
    RetryPolicy,
    ServerBusy,
    ServerError,
    ServerUnavailable,
    TensorServeError,
    Timeout,
    _protocol,
)
from tensorserve_client._protocol import Response
from tensorserve_client._retry import parse_retry_after
from tensorserve_client._tensors import decode_tensor, encode_feature

from tests.client.helpers import error_body, outputs_body


def sent(call: _protocol.Call) -> dict:
    assert call.body is not None
    return msgpack.unpackb(call.body, raw=False)


# ----------------------------------------------------------------- encoding
def test_numpy_arrays_travel_typed_with_their_bytes() -> None:
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    message = sent(_protocol.infer("tagger", [{"input_ids": ids}]))
    wire = message["items"][0]["input_ids"]
    assert (wire["dtype"], wire["shape"]) == ("int64", [2, 3])
    assert np.array_equal(np.frombuffer(wire["data"], np.int64).reshape(2, 3), ids)


def test_non_contiguous_and_big_endian_arrays_are_sent_as_c_order_little_endian() -> None:
    base = np.arange(12, dtype=">i4").reshape(3, 4)
    view = base[:, ::2]  # strided and big-endian
    wire = encode_feature(view, "x")
    assert isinstance(wire, dict) and wire["dtype"] == "int32" and wire["shape"] == [3, 2]
    assert np.array_equal(np.frombuffer(bytes(wire["data"]), "<i4").reshape(3, 2), view)


def test_lists_and_numbers_are_sent_as_is_for_the_server_to_cast() -> None:
    message = sent(
        _protocol.infer("m", [{"a": [[1, 2], [3, 4]], "b": 2.5, "c": (1, 2), "d": [np.int64(7)]}])
    )
    assert message["items"][0] == {"a": [[1, 2], [3, 4]], "b": 2.5, "c": [1, 2], "d": [7]}


def test_unsupported_values_are_refused_naming_the_item_and_feature() -> None:
    with pytest.raises(TypeError, match=r"item 1, feature 'x': numpy dtype complex64"):
        _protocol.infer("m", [{"x": [1]}, {"x": np.zeros(2, np.complex64)}])
    with pytest.raises(TypeError, match=r"item 0, feature 'x': expected a numpy array.*got str"):
        _protocol.infer("m", [{"x": "hello"}])
    with pytest.raises(TypeError, match=r"item 0: expected a mapping"):
        _protocol.infer("m", [[1, 2, 3]])  # type: ignore[list-item]


def test_timeout_becomes_the_servers_deadline_without_touching_the_callers_parameters() -> None:
    parameters = {"custom": 1}
    call = _protocol.infer("m", [{"x": [1]}], parameters=parameters, timeout=0.25)
    assert sent(call)["parameters"] == {"custom": 1, "timeout_ms": 250.0}
    assert parameters == {"custom": 1} and call.timeout == 0.25
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        _protocol.infer("m", [{"x": [1]}], timeout=0)


def test_model_and_version_are_quoted_into_the_path() -> None:
    assert (
        _protocol.infer("a/b", [{"x": [1]}], version=2).path == "/v2/models/a%2Fb/versions/2/infer"
    )
    assert _protocol.stats("tagger").path == "/v2/models/tagger/stats"
    assert _protocol.ready().path == "/v2/health/ready"
    with pytest.raises(ValueError, match="model must be a non-empty model name"):
        _protocol.metadata("")


def test_an_empty_batch_is_answered_without_sending() -> None:
    call = _protocol.infer("m", [])
    assert not call.send and call.complete(Response(200, "", b"")) == []


# ----------------------------------------------------------------- decoding
def ok(body: bytes) -> Response:
    return Response(200, "application/msgpack", body)


def test_outputs_come_back_as_writable_numpy_in_item_order() -> None:
    first, second = np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float32)
    call = _protocol.infer("m", [{"x": [1]}, {"x": [2]}])
    results = call.complete(ok(outputs_body({"y": first}, {"y": second})))
    assert [r["y"].tolist() for r in results] == [first.tolist(), second.tolist()]
    assert results[0]["y"].flags.writeable and results[0]["y"].dtype == np.float32


def test_an_answer_with_the_wrong_number_of_outputs_is_a_protocol_error() -> None:
    call = _protocol.infer("m", [{"x": [1]}, {"x": [2]}])
    with pytest.raises(ProtocolError, match="sent 2 items but the answer holds 1 outputs"):
        call.complete(ok(outputs_body({"y": np.zeros(1, np.float32)})))
    with pytest.raises(ProtocolError, match="not msgpack"):
        call.complete(ok(b"\xc1"))


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_a_protocol_error() -> None:
    bad = {"dtype": "float32", "shape": [3], "data": b"\x00" * 8}
    with pytest.raises(ProtocolError, match="8 bytes do not hold shape"):
        decode_tensor(bad, "output 0", return_torch=False)


def test_bfloat16_comes_back_as_exact_float32_in_numpy() -> None:
    values = np.array([1.0, -2.5, 0.15625, 2.0**100], dtype=np.float32)
    patterns = (values.view(np.uint32) >> 16).astype(np.uint16)  # exact in bfloat16
    wire = {"dtype": "bfloat16", "shape": [4], "data": patterns.tobytes()}
    decoded = decode_tensor(wire, "o", return_torch=False)
    assert decoded.dtype == np.float32 and np.array_equal(decoded, values)


# ----------------------------------------------------------------- errors
def test_the_tree() -> None:
    assert issubclass(InvalidInput, BadRequest) and issubclass(ModelNotFound, BadRequest)
    assert issubclass(ModelNotReady, ServerUnavailable) and issubclass(
        ServerBusy, ServerUnavailable
    )
    assert issubclass(ModelFailure, ServerError) and issubclass(InternalError, ServerError)
    assert issubclass(DeadlineExceeded, Timeout) and issubclass(RequestTimeout, Timeout)
    assert issubclass(Timeout, builtins.TimeoutError)
    assert issubclass(ConnectionError, builtins.ConnectionError)
    for cls in (
        BadRequest,
        ServerUnavailable,
        Timeout,
        ServerError,
        ConnectionError,
        ProtocolError,
    ):
        assert issubclass(cls, TensorServeError)


@pytest.mark.parametrize(
    "status, code, cls",
    [
        (400, "invalid_input", InvalidInput),
        (404, "model_not_found", ModelNotFound),
        (503, "model_not_ready", ModelNotReady),
        (503, "server_busy", ServerBusy),
        (504, "deadline_exceeded", DeadlineExceeded),
        (500, "model_failure", ModelFailure),
        (500, "internal", InternalError),
        (413, "http_error", BadRequest),
        (429, "http_error", ServerBusy),
        (502, "http_error", ServerError),
        (504, "http_error", Timeout),
        (503, "something_new", ServerUnavailable),
    ],
)
def test_error_bodies_rebuild_the_servers_classes(
    status: int, code: str, cls: type[TensorServeError]
) -> None:
    error = _protocol.error_from(Response(status, "application/msgpack", error_body("why", code)))
    assert type(error) is cls
    assert (str(error), error.status, error.code) == ("why", status, code)


def test_json_error_bodies_and_foreign_answers_keep_their_text() -> None:
    json_error = Response(
        404, "application/json", b'{"error": "unknown model \'x\'", "code": "model_not_found"}'
    )
    assert str(_protocol.error_from(json_error)) == "unknown model 'x'"
    proxy = _protocol.error_from(Response(502, "text/html", b"<h1>Bad Gateway</h1>"))
    assert isinstance(proxy, ServerError) and str(proxy) == "HTTP 502: <h1>Bad Gateway</h1>"


def test_ready_reads_503_and_unreachable_as_not_ready() -> None:
    call = _protocol.ready("m")
    assert call.complete(Response(200, "application/json", b'{"ready": true}')) is True
    assert call.complete(Response(503, "application/json", b'{"ready": false}')) is False
    assert call.complete(ConnectionError("refused")) is False
    assert not call.retry
    with pytest.raises(ModelNotFound):
        call.complete(
            Response(
                404, "application/json", b'{"error": "unknown model", "code": "model_not_found"}'
            )
        )


# ----------------------------------------------------------------- retry decisions
DEFAULT = RetryPolicy()


def decide(
    outcome: _protocol.Outcome,
    retry: int = 0,
    remaining: float | None = None,
    policy: RetryPolicy = DEFAULT,
) -> float | None:
    call = _protocol.metadata("m")
    return _protocol.next_delay(policy, call, outcome, retry, remaining, random.Random(0), 1e9)


def test_only_not_now_answers_are_retried() -> None:
    assert decide(Response(503, "", b"")) is not None
    assert decide(Response(429, "", b"")) is not None
    assert decide(ConnectionError("refused")) is not None
    for status in (400, 404, 413, 500, 504):
        assert decide(Response(status, "", b"")) is None, status
    assert decide(RequestTimeout("slow")) is None  # the item may still be running


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    policy = RetryPolicy(retries=10, backoff=0.1, max_backoff=1.0)
    for retry, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)]:
        delays = {policy.delay(retry, None, None, random.Random(seed)) for seed in range(50)}
        assert all(cap / 2 <= d <= cap for d in delays), (retry, delays)
        assert len(delays) > 1  # jittered
    assert policy.delay(10, None, None, random.Random(0)) is None  # retries spent


def test_retry_after_is_honoured_capped_and_bounded_by_the_deadline() -> None:
    busy = Response(503, "", b"", retry_after="2")
    assert 2.0 <= decide(busy) <= 2.1  # type: ignore[operator]
    assert decide(busy, remaining=1.5) is None  # would outlive the caller's deadline
    assert decide(Response(503, "", b"", retry_after="3600")) is None  # > max_retry_after
    assert decide(Response(503, "", b""), remaining=0.0) is None


def test_retry_after_parses_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    assert parse_retry_after("3", now) == 3.0
    assert parse_retry_after(email.utils.formatdate(now + 5, usegmt=True), now) == 5.0
    assert parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now) == 0.0  # in the past
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None


def test_settings_are_checked_with_a_sentence() -> None:
    with pytest.raises(ValueError, match="retries must be a whole number >= 0"):
        RetryPolicy(retries=-1)
    with pytest.raises(ValueError, match="backoff must be a finite number"):
        RetryPolicy(backoff=float("nan"))
    with pytest.raises(ValueError, match="url must look like http://host:port"):
        Client("localhost:8000")
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        Client(timeout=-1)


# ----------------------------------------------------------------- small footprint
def test_the_client_never_imports_torch_itself() -> None:
    code = (
        "import sys, numpy as np\n"
        "from tensorserve_client import _protocol, Client\n"
        "_protocol.infer('m', [{'x': np.zeros(3, np.float32), 'y': [1, 2]}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=30
    )
    assert result.returncode == 0, result.stderr


def test_missing_torch_or_tqdm_is_a_clear_error_before_sending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(ImportError, match="return_torch=True needs torch"):
        _protocol.infer("m", [{"x": [1]}], return_torch=True)
    with (
        Client("http://127.0.0.1:9") as client,
        pytest.raises(ImportError, match=r"progress=True needs tqdm: pip install"),
    ):
        client.map("m", [], progress=True)

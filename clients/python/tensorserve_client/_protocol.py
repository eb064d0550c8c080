"""What each client method sends and how its answer is read — with no I/O.

A method is a ``Call``: the request (method, path, msgpack body) plus
``complete``, which turns the final outcome (a ``Response``, or the transport
error that stood in for one) into the method's result or raises the error the
server's answer stands for. ``next_delay`` decides whether an outcome is worth
another attempt and how long to wait first. ``Client`` and ``AsyncClient`` only
carry calls to the server and back (``_transport.py``); everything else is here,
once.

A call also says what it asks in transport-neutral terms (``Call.op``), for a
transport that builds its own messages (gRPC, ``_grpc.py``): its outcome is an
``Answer`` that reads into the method's value, or an error value.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar
from urllib.parse import quote

import msgpack

from tensorserve_client._ops import IndexOp, InferOp, ModelOp, Op, ReadyOp, RepositoryOp
from tensorserve_client._retry import RetryPolicy, parse_retry_after
from tensorserve_client._tensors import decode_tensor, encode_item, pack_default, require_torch
from tensorserve_client.errors import (
    ConnectionError,
    ProtocolError,
    ServerUnavailable,
    TensorServeError,
    error_for,
)

T = TypeVar("T")

MSGPACK = "application/msgpack"
JSON = "application/json"
RETRY_STATUSES = frozenset({429, 503})

Features = Mapping[str, Any]


class InferResult(dict):  # type: ignore[type-arg]  # output name -> np.ndarray (or torch.Tensor)
    """One item's outputs (a dict of output name -> array), and in
    ``parameters`` the output parameters the model returned for this item
    (empty when it returns none)."""

    __slots__ = ("parameters",)

    def __init__(self, outputs: Mapping[str, Any], parameters: Mapping[str, Any] | None = None):
        super().__init__(outputs)
        self.parameters: dict[str, Any] = dict(parameters or {})


Result = InferResult


@dataclass(frozen=True, slots=True)
class Response:
    """An HTTP answer, reduced to what the protocol reads."""

    status: int
    content_type: str  # media type, lower case, without parameters
    body: bytes
    retry_after: str | None = None
    attempts: int = 1  # how many times the request was sent


@dataclass(frozen=True, slots=True)
class Answer:
    """A success that a transport read itself (gRPC): ``read()`` builds the
    method's value, on the caller's thread for the blocking ``Client``."""

    read: Callable[[], Any]
    attempts: int = 1


# An HTTP response, a transport's own reading of a success, or the error in
# their place: a transport failure (ConnectionError, RequestTimeout), or over
# gRPC the error the server's status stands for.
Outcome = Response | Answer | TensorServeError


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    complete: Callable[[Outcome], T]
    body: bytes | None = None
    timeout: float | None = None
    """The caller's deadline for this call, all attempts included (None: only
    the client's per-attempt timeout applies)."""
    retry: bool = True
    send: bool = True
    """False: the answer is known without asking (an empty batch)."""
    op: Op | None = None
    """What the call asks, for transports that do not speak HTTP."""


# ----------------------------------------------------------------- retrying
def retryable(outcome: Outcome) -> bool:
    """ "Not now" answers: no connection, 503 (not ready, busy) and 429, and
    over gRPC UNAVAILABLE (an error value, ``ServerUnavailable``)."""
    if isinstance(outcome, Response):
        return outcome.status in RETRY_STATUSES
    return isinstance(outcome, (ConnectionError, ServerUnavailable))


def next_delay(
    policy: RetryPolicy,
    call: Call[Any],
    outcome: Outcome,
    retry: int,
    remaining: float | None,
    rng: random.Random,
    now: float,
) -> float | None:
    """Seconds before retry number ``retry`` of ``call``, or None: ``outcome`` is final.

    ``remaining``: seconds left before the caller's deadline; ``now``: POSIX time
    (for ``Retry-After`` dates).
    """
    if not call.retry or not retryable(outcome):
        return None
    if isinstance(outcome, Response):
        retry_after = parse_retry_after(outcome.retry_after, now)
    else:
        retry_after = outcome.retry_after if isinstance(outcome, TensorServeError) else None
    return policy.delay(retry, retry_after, remaining, rng)


# ----------------------------------------------------------------- reading answers
def error_from(response: Response) -> TensorServeError:
    """The error a non-2xx answer stands for, carrying the server's message."""
    message, code = None, None
    try:
        if response.content_type == MSGPACK:
            payload = msgpack.unpackb(response.body, raw=False)
        elif response.content_type == JSON:
            payload = json.loads(response.body)
        else:
            payload = None
    except Exception:  # noqa: BLE001 - msgpack and json raise many unrelated types
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        message = payload["error"]
        code = payload.get("code") if isinstance(payload.get("code"), str) else None
    if message is None:  # not a tensorserve error body (a proxy, a stray server)
        text = response.body.decode("utf-8", "replace").strip()[:500]
        message = f"HTTP {response.status}" + (f": {text}" if text else "")
    retry_after = parse_retry_after(response.retry_after, time.time())
    error = error_for(response.status, code, message, retry_after)
    error.attempts = response.attempts
    return error


def answered(read_http: Callable[[Outcome], T]) -> Callable[[Outcome], T]:
    """``read_http`` for HTTP responses and error values; an ``Answer`` reads itself."""

    def complete(outcome: Outcome) -> T:
        if isinstance(outcome, Answer):
            value: T = outcome.read()
            return value
        return read_http(outcome)

    return complete


def _ok(outcome: Outcome) -> Response:
    if isinstance(outcome, TensorServeError):
        raise outcome
    if isinstance(outcome, Answer):  # complete() is wrapped in answered(): not reached
        raise ProtocolError("an answer read by its transport reached the HTTP reader")
    if not 200 <= outcome.status < 300:
        raise error_from(outcome)
    return outcome


def _json(outcome: Outcome) -> Any:
    response = _ok(outcome)
    try:
        return json.loads(response.body)
    except ValueError as exc:
        raise ProtocolError(f"answer is not JSON: {exc}", status=response.status) from None


def _outputs(outcome: Outcome, count: int, return_torch: bool) -> list[Result]:
    response = _ok(outcome)
    try:
        message = msgpack.unpackb(response.body, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many unrelated types
        raise ProtocolError(f"answer is not msgpack: {exc}", status=response.status) from None
    outputs = message.get("outputs") if isinstance(message, dict) else None
    if not isinstance(outputs, list) or len(outputs) != count:
        got = len(outputs) if isinstance(outputs, list) else "no"
        raise ProtocolError(f"sent {count} items but the answer holds {got} outputs")
    # The model's output parameters: one map per item, when it returns any.
    parameters = message.get("parameters") or [{}] * count
    if not isinstance(parameters, list) or len(parameters) != count:
        raise ProtocolError(f"sent {count} items but the answer's parameters are not {count} maps")
    results = []
    for index, (output, params) in enumerate(zip(outputs, parameters)):
        if not isinstance(output, dict):
            raise ProtocolError(f"output {index}: expected a map of output name to tensor")
        if not isinstance(params, dict):
            raise ProtocolError(f"output {index}: parameters must be a map")
        tensors = {
            name: decode_tensor(tensor, f"output {index}, {name!r}", return_torch)
            for name, tensor in output.items()
        }
        results.append(InferResult(tensors, params))
    return results


# ----------------------------------------------------------------- the calls
def _model_path(model: str, version: str | int | None, suffix: str = "") -> str:
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty model name, got {model!r}")
    path = f"/v2/models/{quote(model, safe='')}"
    if version is not None:
        path += f"/versions/{quote(str(version), safe='')}"
    return path + suffix


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")


class InferOptions(TypedDict):
    """What ``infer`` takes besides the items, kept by a bulk call to send
    each item of a failed request again alone (``_bulk.Batch``)."""

    version: str | int | None
    parameters: Mapping[str, Any] | None
    timeout: float | None
    return_torch: bool


def infer(
    model: str,
    items: Iterable[Features],
    *,
    version: str | int | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    return_torch: bool = False,
    first_index: int = 0,
) -> Call[list[Result]]:
    """Many items in one request; results in the items' order. ``first_index``
    numbers the items in client-side errors (a map's position in its stream)."""
    path = _model_path(model, version, "/infer")
    _check_timeout(timeout)
    if return_torch:
        require_torch()  # fail before sending, not after
    encoded = [encode_item(features, index) for index, features in enumerate(items, first_index)]
    count = len(encoded)
    message: dict[str, Any] = {"items": encoded}
    params = dict(parameters or {})
    if timeout is not None:
        params["timeout_ms"] = timeout * 1000.0  # the server drops the item past it: 504
    if params:
        message["parameters"] = params
    op = InferOp(
        model,
        None if version is None else str(version),
        encoded,
        dict(parameters or {}),
        timeout,
        return_torch,
        first_index,
    )
    return Call(
        "POST",
        path,
        answered(lambda outcome: _outputs(outcome, count, return_torch) if count else []),
        body=msgpack.packb(message, default=pack_default) if count else None,
        timeout=timeout,
        send=count > 0,
        op=op,
    )


def infer_one(
    model: str,
    features: Features,
    *,
    version: str | int | None = None,
    parameters: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    return_torch: bool = False,
) -> Call[Result]:
    many = infer(
        model,
        [features],
        version=version,
        parameters=parameters,
        timeout=timeout,
        return_torch=return_torch,
    )
    return Call(
        many.method,
        many.path,
        lambda outcome: many.complete(outcome)[0],
        body=many.body,
        timeout=timeout,
        op=many.op,
    )


def _ready(outcome: Outcome) -> bool:
    # A readiness probe: "not reachable" and 503 both mean "do not send work yet".
    if isinstance(outcome, (ConnectionError, ServerUnavailable)):
        return False
    if isinstance(outcome, Response) and outcome.status == 503:
        return False
    _ok(outcome)
    return True


def ready(model: str | None = None, version: str | int | None = None) -> Call[bool]:
    path = "/v2/health/ready" if model is None else _model_path(model, version, "/ready")
    op = ReadyOp(model, None if version is None else str(version))
    return Call("GET", path, answered(_ready), retry=False, op=op)


def models() -> Call[list[dict[str, Any]]]:
    def complete(outcome: Outcome) -> list[dict[str, Any]]:
        index = _json(outcome)
        if not isinstance(index, dict) or not isinstance(index.get("models"), list):
            raise ProtocolError("model index has no 'models' list")
        listed: list[dict[str, Any]] = index["models"]
        return listed

    return Call("GET", "/v2/models", answered(complete), op=IndexOp())


def metadata(model: str, version: str | int | None = None) -> Call[dict[str, Any]]:
    op = ModelOp("metadata", model, None if version is None else str(version))
    return Call("GET", _model_path(model, version), answered(_json), op=op)


def stats(model: str, version: str | int | None = None) -> Call[dict[str, Any]]:
    op = ModelOp("stats", model, None if version is None else str(version))
    return Call("GET", _model_path(model, version, "/stats"), answered(_json), op=op)


# ----------------------------------------------------------------- model control
def repository_action(action: str, model: str) -> Call[dict[str, Any]]:
    """Load (or reload) or unload a model: the server's answer is the model's
    index entry. Not retried: a server that refuses (403 ModelControlDisabled,
    ApiRestricted) or fails to load it answers the same the next time."""
    if action not in ("load", "unload"):
        raise ValueError(f"action must be 'load' or 'unload', got {action!r}")
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty model name, got {model!r}")
    return Call(
        "POST",
        f"/v2/repository/models/{quote(model, safe='')}/{action}",
        answered(_json),
        retry=False,
        op=RepositoryOp(action, model),
    )

"""The client's error tree. Every class the server can answer with is rebuilt
from the response body's ``code`` (falling back to the HTTP status), and
``str(error)`` is the server's own message, so it names the model, item or
feature at fault.

    TensorServeError                     .message .code .status .attempts
    ├── BadRequest                  4xx  the request is wrong as sent; never retried
    │   ├── InvalidInput            400  invalid_input: an item's dtype, shape or size
    │   ├── ModelNotFound           404  model_not_found: unknown model or version
    │   ├── RequestTooLarge         413  request_too_large: more items than the queue holds
    │   ├── OutOfMemory             413  out_of_memory: one item too large for the model
    │   └── Forbidden               403  refused by the server's settings, whoever asks
    │       ├── ModelControlDisabled 403 model_control_disabled: the API may not load or unload
    │       └── ApiRestricted       403  api_restricted: the API's header is missing or wrong
    ├── ServerUnavailable           503  try again later; retried with backoff
    │   ├── ModelNotReady           503  model_not_ready: loading, failed or unloaded
    │   └── ServerBusy         503, 429  server_busy: a bounded queue is full
    │       ├── WouldMissTarget  503     would_miss_target: the latency target would be missed
    │       └── MemoryTight      503     memory_tight: the device's memory is tight for now
    ├── Timeout                          also a builtin TimeoutError
    │   ├── DeadlineExceeded        504  deadline_exceeded: the server dropped the item
    │   └── RequestTimeout               no answer within the client's timeout
    ├── ServerError                 5xx  the server failed; never retried
    │   ├── ModelFailure            500  model_failure: the model raised
    │   └── InternalError           500  internal: a bug in the server
    ├── ConnectionError                  also a builtin ConnectionError; retried
    └── ProtocolError                    the answer is not a tensorserve answer

``status`` is the HTTP status (``None`` when no answer came back; over gRPC,
the status the same error has over HTTP); ``code`` is the server's stable
error code (``"http_error"`` for HTTP-level refusals such as 413, ``None``
when no answer came back); ``attempts`` is how many times the request was
sent, retries included; ``retry_after`` the seconds the server asked to wait
before trying again (``Retry-After``, gRPC's ``retry-after``), None when it
did not say.
"""

from __future__ import annotations

import builtins

__all__ = [
    "ApiRestricted",
    "BadRequest",
    "ConnectionError",
    "DeadlineExceeded",
    "Forbidden",
    "InternalError",
    "InvalidInput",
    "MemoryTight",
    "ModelControlDisabled",
    "ModelFailure",
    "ModelNotFound",
    "ModelNotReady",
    "OutOfMemory",
    "ProtocolError",
    "RequestTimeout",
    "RequestTooLarge",
    "ServerBusy",
    "ServerError",
    "ServerUnavailable",
    "TensorServeError",
    "Timeout",
    "WouldMissTarget",
    "error_for",
]


class TensorServeError(Exception):
    """Base class of every error the client raises for a request."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.attempts = attempts
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, code={self.code!r})"


class BadRequest(TensorServeError):
    """The server refused the request as sent (4xx); retrying will not help."""


class InvalidInput(BadRequest):
    """An item does not match the model's inputs (dtype, shape, size, names)."""


class ModelNotFound(BadRequest):
    """No such model, or no such version of it."""


class RequestTooLarge(BadRequest):
    """More items in one request than the model's queue can ever hold: split it."""


class OutOfMemory(BadRequest):
    """One item too large for the model's memory even alone: send a smaller one."""


class Forbidden(BadRequest):
    """The server's settings refuse this request, whoever sends it (403); the
    message names the setting that would allow it."""


class ModelControlDisabled(Forbidden):
    """Loading and unloading through the API is off: the server runs with
    ``--model-control-mode none`` (or ``poll``, where its repository's files
    decide). The model is left as it was."""


class ApiRestricted(Forbidden):
    """The endpoint belongs to an API the server restricts (``--restricted-api``):
    give the client its header (``Client(url, headers={name: value})``)."""


class ServerUnavailable(TensorServeError):
    """The server cannot take the request now (503); retried with backoff."""


class ModelNotReady(ServerUnavailable):
    """The model is loading, failed to load, or was unloaded."""


class ServerBusy(ServerUnavailable):
    """A bounded queue is full (503 server_busy, or 429)."""


class WouldMissTarget(ServerBusy):
    """The model's latency target would be missed behind the work queued
    ahead (503 would_miss_target): retry later or on another replica."""


class MemoryTight(ServerBusy):
    """One item ran out of the device's memory while a batch at least as large
    had fit (503 memory_tight): memory is tight for now; retry later."""


class Timeout(TensorServeError, builtins.TimeoutError):
    """The request took too long, on the server or on the way."""


class DeadlineExceeded(Timeout):
    """The server dropped the item after it waited longer than its timeout (504)."""


class RequestTimeout(Timeout):
    """No answer arrived within the client's timeout; the item may still run."""


class ServerError(TensorServeError):
    """The server failed to process a valid request (5xx)."""


class ModelFailure(ServerError):
    """The model raised while running the batch holding this item."""


class InternalError(ServerError):
    """An unexpected error inside the server."""


class ConnectionError(TensorServeError, builtins.ConnectionError):
    """The server could not be reached, or dropped the connection mid-request."""


class ProtocolError(TensorServeError):
    """The answer could not be understood (not msgpack/JSON, wrong shape)."""


# The server's stable codes -> (the HTTP status it answers each with, the class
# rebuilt here). A copy of the server's table (tensorserve/errors.py CODES and
# tensorserve/http/errors.py STATUS): this package never imports the server, and
# the server's tests/test_error_codes.py holds the two code for code and status
# for status.
CODES: dict[str, tuple[int, type[TensorServeError]]] = {
    "invalid_input": (400, InvalidInput),
    "model_not_found": (404, ModelNotFound),
    "request_too_large": (413, RequestTooLarge),
    "out_of_memory": (413, OutOfMemory),
    "model_control_disabled": (403, ModelControlDisabled),
    "api_restricted": (403, ApiRestricted),
    "model_not_ready": (503, ModelNotReady),
    "server_busy": (503, ServerBusy),
    "would_miss_target": (503, WouldMissTarget),
    "memory_tight": (503, MemoryTight),
    "deadline_exceeded": (504, DeadlineExceeded),
    "model_failure": (500, ModelFailure),
    "internal": (500, InternalError),
}
BY_CODE: dict[str, type[TensorServeError]] = {code: cls for code, (_, cls) in CODES.items()}

# When the body carries no known code (a proxy, or an HTTP-level refusal).
BY_STATUS: dict[int, type[TensorServeError]] = {
    403: Forbidden,
    429: ServerBusy,
    503: ServerUnavailable,
    504: Timeout,
}


def error_for(
    status: int, code: str | None, message: str, retry_after: float | None = None
) -> TensorServeError:
    """The error for an answer with a non-2xx ``status``."""
    cls = BY_CODE.get(code or "") or BY_STATUS.get(status)
    if cls is None:
        cls = BadRequest if 400 <= status < 500 else ServerError
    return cls(message, status=status, code=code, retry_after=retry_after)

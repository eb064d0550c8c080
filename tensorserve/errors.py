"""One transport-free error tree for the whole server.

Every error carries a stable ``code``; the HTTP layer maps codes to statuses
(``tensorserve/http/errors.py``) and the client rebuilds the same classes from
the response body. Nothing here knows about HTTP.

    TensorServeError                 code
    ├── InvalidInput                 invalid_input     bad item: wrong dtype, shape, size
    ├── ModelNotFound                model_not_found   unknown model or version
    ├── ModelNotReady                model_not_ready   loading, failed to load, or unloading
    ├── ServerBusy                   server_busy       a bounded queue is full
    ├── DeadlineExceeded             deadline_exceeded the item waited longer than its timeout
    └── ModelFailure                 model_failure     the model (or batch function) raised
"""

from __future__ import annotations


class TensorServeError(Exception):
    """Base class; ``code`` is stable and part of the wire protocol."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(TensorServeError):
    code = "invalid_input"


class ModelNotFound(TensorServeError):
    code = "model_not_found"


class ModelNotReady(TensorServeError):
    code = "model_not_ready"


class ServerBusy(TensorServeError):
    code = "server_busy"


class DeadlineExceeded(TensorServeError):
    code = "deadline_exceeded"


class ModelFailure(TensorServeError):
    code = "model_failure"


class ConfigError(Exception):
    """A model's configuration or files are invalid. Reported as the model's
    not-ready reason; never reaches a caller as a request error."""


def as_model_failure(exc: BaseException, model: str) -> TensorServeError:
    """What a caller sees when the model raised ``exc``."""
    if isinstance(exc, TensorServeError):
        return exc
    failure = ModelFailure(f"model {model!r} failed: {type(exc).__name__}: {exc}")
    failure.__cause__ = exc  # the model's own traceback, for the server's log
    return failure

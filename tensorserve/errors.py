"""One transport-free error tree for the whole server, and the one table of
its error codes (``CODES``).

Every error carries a stable ``code``, whether the same request may succeed
if sent again later (``retry_later``), and the reason the metrics count it
under when it is a rejection (``rejection``: refused or abandoned before a
model answered, through no fault of the model). Each class also declares
what every front end answers with it: its HTTP status (``http_status``)
and its gRPC status code, by name (``grpc_status``: a ``grpc.StatusCode``
member's name, so nothing here imports a transport). The rest is generated
from or tested against ``CODES`` (tests/test_error_codes.py): the HTTP
statuses (``tensorserve/http/errors.py STATUS``), the gRPC statuses
(``tensorserve/grpc/errors.py``), the metrics' rejection reasons
(``tensorserve/metrics/requests.py``) and the classes the client rebuilds
from a response's code (``clients/python/tensorserve_client/errors.py``).

    class                            code              HTTP gRPC                when
    TensorServeError                 internal          500  INTERNAL            a bug in the server
    ├── InvalidInput                 invalid_input     400  INVALID_ARGUMENT    bad item: wrong dtype, shape, size
    ├── ModelNotFound                model_not_found   404  NOT_FOUND           unknown model or version
    ├── ModelNotReady                model_not_ready   503  UNAVAILABLE         loading, failed to load, or unloading
    ├── ServerBusy                   server_busy       503  UNAVAILABLE         a bounded queue is full
    │   └── WouldMissTarget          would_miss_target 503  UNAVAILABLE         the queue ahead would make it miss the latency target
    ├── RequestTooLarge              request_too_large 413  RESOURCE_EXHAUSTED  more items than the queue can ever hold
    ├── DeadlineExceeded             deadline_exceeded 504  DEADLINE_EXCEEDED   the item waited longer than its timeout
    ├── ModelFailure                 model_failure     500  INTERNAL            the model (or batch function) raised
    │   ├── WorkerCrashed            model_failure                          its worker process died (or the watchdog killed it)
    │   ├── DeviceLost               model_failure                          a sticky CUDA error lost this process's CUDA context
    │   └── BatchOutOfMemory         model_failure                          the padded batch did not fit (split and retried)
    ├── OutOfMemory                  out_of_memory     413  RESOURCE_EXHAUSTED  one item does not fit in memory even alone
    ├── ModelControlDisabled         model_control_disabled 403 PERMISSION_DENIED load/unload through the API is off
    └── ApiRestricted                api_restricted    403  PERMISSION_DENIED   a restricted API without its header

Retried later: ``ModelNotReady`` and ``ServerBusy``. Not rejections (errors
of the model or the server): ``ModelFailure`` and ``internal``.

``RowErrors`` is not a caller's error: a model raises it to fail some rows of
a batch only (docs/model-repository.md, "Failing single rows").
"""

from __future__ import annotations


class TensorServeError(Exception):
    """Base class; ``code`` is stable and part of the wire protocol."""

    code = "internal"
    # The same request, sent again later, may succeed (the client retries it).
    retry_later = False
    # The metrics' reason when this is a rejection; None: an error of the server
    # or of the model.
    rejection: str | None = None
    # What each front end answers: an HTTP status, a gRPC status code's name.
    http_status = 500
    grpc_status = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(TensorServeError):
    http_status = 400
    grpc_status = "INVALID_ARGUMENT"
    code = "invalid_input"
    rejection = "invalid_input"


class ModelNotFound(TensorServeError):
    http_status = 404
    grpc_status = "NOT_FOUND"
    code = "model_not_found"
    rejection = "unknown_model"


class ModelNotReady(TensorServeError):
    http_status = 503
    grpc_status = "UNAVAILABLE"
    code = "model_not_ready"
    retry_later = True
    rejection = "not_ready"


class ServerBusy(TensorServeError):
    """A bounded queue is full: retry after ``retry_after`` seconds (an
    estimate from the queue ahead and how fast it drains)."""

    http_status = 503
    grpc_status = "UNAVAILABLE"
    code = "server_busy"
    retry_later = True
    rejection = "queue_full"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WouldMissTarget(ServerBusy):
    """The model has a latency target (``target_p99_ms``) and the work queued
    ahead would make this request late: refused at once rather than queued
    to miss it (batching.target). Retry after ``retry_after`` seconds, or
    send it to another replica."""

    code = "would_miss_target"
    rejection = "would_miss_target"


class MemoryTight(ServerBusy):
    """One item ran out of the device's memory, but a batch at least as large
    fit since memory last ran out: memory is tight for now (another process,
    fragmentation), not too small for the item (that is ``OutOfMemory``'s
    413). Retry after ``retry_after`` seconds, or on another replica."""

    code = "memory_tight"
    rejection = "memory_tight"


class RequestTooLarge(TensorServeError):
    """A request that could never be admitted, however long it waited (more
    items than the model's queue holds): split it; retrying cannot help."""

    http_status = 413
    grpc_status = "RESOURCE_EXHAUSTED"
    code = "request_too_large"
    rejection = "too_large"


class DeadlineExceeded(TensorServeError):
    http_status = 504
    grpc_status = "DEADLINE_EXCEEDED"
    code = "deadline_exceeded"
    rejection = "deadline"


class ModelFailure(TensorServeError):
    code = "model_failure"


class WorkerCrashed(ModelFailure):
    """The worker process running (``ran``) or holding the batch died. A batch
    that never ran is sent again whole; one that ran is split (batching.recovery).
    ``behind``: the batch was launched behind the one the worker was running
    (a CUDA worker holds two); it may have run and caused the crash, so it is
    a suspect, but the crash is not counted against its items."""

    def __init__(
        self, message: str, *, ran: bool, watchdog: bool = False, behind: bool = False
    ) -> None:
        super().__init__(message)
        self.ran = ran
        self.watchdog = watchdog  # killed for running too long, not a crash of its own
        self.behind = behind


class DeviceLost(ModelFailure):
    """A sticky CUDA error (a device-side assert, an illegal memory access)
    lost the CUDA context of the process that ran the batch: nothing can run
    on CUDA there again. Never split and retried in that process; readiness
    and liveness fail so that the platform restarts it (runtime/device.py)."""


class BatchOutOfMemory(ModelFailure):
    """The device (or host) ran out of memory on this padded batch; the
    executor has already freed its caches. The batcher splits and retries."""


class OutOfMemory(TensorServeError):
    """One item that does not fit in memory even alone: a smaller item may."""

    http_status = 413
    grpc_status = "RESOURCE_EXHAUSTED"
    code = "out_of_memory"
    rejection = "too_large"


class ModelControlDisabled(TensorServeError):
    """Loading and unloading through the repository API is off
    (``model_control_mode`` none, or poll, where the repository's files
    decide): the model is left as it was."""

    http_status = 403
    grpc_status = "PERMISSION_DENIED"
    code = "model_control_disabled"
    rejection = "forbidden"


class ApiRestricted(TensorServeError):
    """The endpoint belongs to an API restricted by ``restricted_api`` and the
    request lacks its header, or carries another value."""

    http_status = 403
    grpc_status = "PERMISSION_DENIED"
    code = "api_restricted"
    rejection = "forbidden"


# The one table of error codes: each code and the class that owns it.
CODES: dict[str, type[TensorServeError]] = {
    cls.code: cls
    for cls in (
        TensorServeError,
        InvalidInput,
        ModelNotFound,
        ModelNotReady,
        ServerBusy,
        WouldMissTarget,
        MemoryTight,
        RequestTooLarge,
        DeadlineExceeded,
        ModelFailure,
        OutOfMemory,
        ModelControlDisabled,
        ApiRestricted,
    )
}


class RowErrors(Exception):
    """Raised by a model's forward to fail some rows of a batch only: ``errors``
    maps row index (in the padded batch) to a message for that caller. The
    other rows run again without the failed ones, and get their results.

        bad = (input_ids >= self.vocab).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise RowErrors({row: "token id out of vocabulary" for row in bad})
    """

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__(
            f"{len(errors)} row(s) failed: "
            + "; ".join(f"row {row}: {message}" for row, message in sorted(errors.items())[:3])
        )
        self.errors = {int(row): str(message) for row, message in errors.items()}


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

"""The one place where tensorserve errors become gRPC statuses, from the one
table (``errors.CODES``: each class's ``grpc_status``).

Every failed call ends with its status, the message as its details, and
trailing metadata: ``tensorserve-code`` (the stable error code, as the HTTP
body's ``code``), ``x-request-id``, and for a call worth retrying later
(overload, not ready) ``retry-after`` in whole seconds, as HTTP's header.
"""

from __future__ import annotations

import math

import grpc

from tensorserve import errors

# Error code -> gRPC status code; tests/test_error_codes.py holds every code
# retried later to UNAVAILABLE.
STATUS: dict[str, grpc.StatusCode] = {
    code: grpc.StatusCode[cls.grpc_status] for code, cls in errors.CODES.items()
}
CODE_KEY = "tensorserve-code"
RETRY_AFTER_KEY = "retry-after"


class Failure:
    """What a call that failed answers: status, details, trailing metadata."""

    __slots__ = ("code", "message", "retry_after", "status")

    def __init__(self, exc: BaseException) -> None:
        self.retry_after: float | None = None
        if isinstance(exc, errors.TensorServeError):
            self.code, self.message = exc.code, exc.message
            # A model's own subclass with a code of its own: INTERNAL.
            self.status = STATUS.get(exc.code, grpc.StatusCode.INTERNAL)
            if exc.retry_later:
                self.retry_after = getattr(exc, "retry_after", 1.0)
        else:
            self.code = errors.TensorServeError.code
            self.message = f"internal error: {type(exc).__name__}: {exc}"
            self.status = grpc.StatusCode.INTERNAL

    @property
    def http_status(self) -> int:
        """The status the same failure has over HTTP (what the request metrics
        and log lines use to tell a rejection from a fault)."""
        return self.http_status_of(self.code)

    @staticmethod
    def http_status_of(code: str) -> int:
        cls = errors.CODES.get(code)
        return cls.http_status if cls is not None else (200 if code == "ok" else 500)

    def trailing_metadata(self, request_id: str) -> tuple[tuple[str, str], ...]:
        metadata: tuple[tuple[str, str], ...] = (
            (CODE_KEY, self.code),
            ("x-request-id", request_id),
        )
        if self.retry_after is not None:
            metadata += ((RETRY_AFTER_KEY, str(math.ceil(self.retry_after))),)
        return metadata

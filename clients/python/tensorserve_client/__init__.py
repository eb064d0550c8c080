"""Python client for tensorserve: ``Client`` (blocking) and ``AsyncClient``
(asyncio), twins with the same methods. See docs/client.md.

    from tensorserve_client import Client

    with Client("http://localhost:8000") as client:
        out = client.infer("tagger", {"input_ids": ids, "attention_mask": mask})
        out["logits"]  # np.ndarray
        out.parameters  # the model's output parameters for this item ({} if none)
"""

from tensorserve_client._async import AsyncClient
from tensorserve_client._protocol import InferResult
from tensorserve_client._retry import RetryPolicy
from tensorserve_client._sync import Client
from tensorserve_client._version import __version__
from tensorserve_client.errors import (
    ApiRestricted,
    BadRequest,
    ConnectionError,
    DeadlineExceeded,
    Forbidden,
    InternalError,
    InvalidInput,
    MemoryTight,
    ModelControlDisabled,
    ModelFailure,
    ModelNotFound,
    ModelNotReady,
    OutOfMemory,
    ProtocolError,
    RequestTimeout,
    RequestTooLarge,
    ServerBusy,
    ServerError,
    ServerUnavailable,
    TensorServeError,
    Timeout,
    WouldMissTarget,
)

__all__ = [
    "ApiRestricted",
    "AsyncClient",
    "BadRequest",
    "Client",
    "ConnectionError",
    "DeadlineExceeded",
    "Forbidden",
    "InferResult",
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
    "RetryPolicy",
    "ServerBusy",
    "ServerError",
    "ServerUnavailable",
    "TensorServeError",
    "Timeout",
    "WouldMissTarget",
    "__version__",
]

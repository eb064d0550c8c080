"""tensorserve: a Triton-style tensor inference server that dynamically
batches variable-length inputs by padding them, and un-pads every output."""

__version__ = "0.1.0"

from tensorserve.errors import (  # noqa: E402
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    ModelNotReady,
    ServerBusy,
    TensorServeError,
)
from tensorserve.serving import ServedModel  # noqa: E402

__all__ = [
    "DeadlineExceeded",
    "InvalidInput",
    "ModelFailure",
    "ModelNotFound",
    "ModelNotReady",
    "ServedModel",
    "ServerBusy",
    "TensorServeError",
    "__version__",
]

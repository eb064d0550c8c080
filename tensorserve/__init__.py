"""tensorserve: a Triton-style tensor inference server that dynamically
batches variable-length inputs by padding them, and un-pads every output.

``import tensorserve`` is cheap: the error types (and the plain
``WithParameters`` a model returns output parameters in) load at once, and
``ServedModel`` (which needs torch) only when it is first used, so the
command line's ``--help`` and code that only handles errors never pay for
importing torch.
"""

from typing import TYPE_CHECKING, Any

from tensorserve.errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    ModelNotReady,
    OutOfMemory,
    RowErrors,
    ServerBusy,
    TensorServeError,
)
from tensorserve.tensors.results import RowResult, WithParameters

if TYPE_CHECKING:
    from tensorserve.serving.model import ServedModel

__version__ = "0.1.0"

__all__ = [
    "DeadlineExceeded",
    "InvalidInput",
    "ModelFailure",
    "ModelNotFound",
    "ModelNotReady",
    "OutOfMemory",
    "RowErrors",
    "RowResult",
    "ServedModel",
    "ServerBusy",
    "TensorServeError",
    "WithParameters",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "ServedModel":
        from tensorserve.serving.model import ServedModel

        return ServedModel
    raise AttributeError(f"module 'tensorserve' has no attribute {name!r}")

"""What a client call asks, in terms no transport owns: the gRPC transport
(``_grpc.py``) builds its messages from these; the HTTP transport sends the
call's method, path and body instead (``_protocol.py`` makes both at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensorserve_client._tensors import Wire


@dataclass(frozen=True, slots=True)
class InferOp:
    model: str
    version: str | None
    items: list[dict[str, Wire]]  # each item as _tensors.encode_item gave it
    parameters: dict[str, Any]  # the caller's (the deadline is ``timeout``)
    timeout: float | None
    return_torch: bool
    first_index: int


@dataclass(frozen=True, slots=True)
class ReadyOp:
    model: str | None  # None: the server
    version: str | None


@dataclass(frozen=True, slots=True)
class ModelOp:
    what: str  # "metadata" or "stats"
    model: str
    version: str | None


@dataclass(frozen=True, slots=True)
class IndexOp:
    pass


@dataclass(frozen=True, slots=True)
class RepositoryOp:
    action: str  # "load" or "unload"
    model: str


Op = InferOp | ReadyOp | ModelOp | IndexOp | RepositoryOp

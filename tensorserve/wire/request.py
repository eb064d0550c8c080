"""What every protocol decodes a request into and encodes its reply from, so
the HTTP handler is decode -> infer -> encode whatever the protocol.

A codec is a module (``wire/native.py``, ``wire/oip.py``) providing the
``Codec`` functions below. Everything a protocol needs to know lives in its
codec: the body format, its parameters (checked there), which outputs the
caller asked for and how each goes back, and which requests cost enough to
decode or encode in a worker thread rather than on the event loop.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from tensorserve.errors import InvalidInput
from tensorserve.repository.config import ModelConfig
from tensorserve.settings import MAX_TIMEOUT_S
from tensorserve.tensors.dtypes import DType
from tensorserve.tensors.results import row_parameters

Results = Sequence[Mapping[str, np.ndarray]]


class RequestedOutput(NamedTuple):  # a NamedTuple: built per request, and cheap to build
    """One output the caller gets back, in the order it asked for them."""

    name: str
    dt: DType
    binary: bool = True  # OIP: raw bytes after the JSON header, else JSON ``data``


@dataclass(slots=True)
class InferRequest:
    """A decoded infer request, the same for every protocol.

    ``items`` go to ``ServedModel.infer_many`` as they are: one map per item
    of feature name to a ``WireTensor``, or to a plain (nested) list of
    numbers that ``wire.validate`` casts strictly to the declared dtype.
    """

    items: list[dict[str, Any]]
    outputs: list[RequestedOutput]
    id: str | None = None
    timeout: float | None = None  # seconds; None: no deadline
    parameters: dict[str, Any] = field(default_factory=dict)  # the raw map, checked


class EncodedResponse(NamedTuple):
    chunks: list[bytes | memoryview]  # the body, in order
    content_type: str
    headers: dict[str, str] | None = None

    @property
    def body(self) -> bytes | memoryview:
        return self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)


class Codec(Protocol):
    """A protocol module: four pure functions (no I/O, no event loop)."""

    def decode_request(
        self, body: bytes, headers: Mapping[str, str], config: ModelConfig, max_items: int
    ) -> InferRequest:
        """The request, checked against the model's config, or ``InvalidInput``
        naming what is wrong."""
        ...

    def encode_response(
        self,
        request: InferRequest,
        results: Results,
        model_name: str,
        model_version: str,
        config: ModelConfig,
    ) -> EncodedResponse:
        """The reply to ``request``; ``results`` holds one map per item, in order."""
        ...

    def decode_is_costly(self, body: bytes) -> bool:
        """Whether decoding ``body`` would hold the event loop long enough to
        stall other connections (so the handler runs it in a thread)."""
        ...

    def encode_is_costly(self, request: InferRequest, results: Results) -> bool:
        """Whether encoding ``results`` would hold the event loop that long."""
        ...


def effective_timeout(
    requested_s: float | None,
    model_default_ms: float | None,
    server_default_ms: float | None,
    max_ms: float,
) -> float:
    """A request's deadline in seconds: its own timeout, else its model's
    ``default_timeout_ms``, else the server's; never more than ``max_ms``
    (a longer one is lowered to it: the caller said it would wait that
    long at most, and the server keeps nothing longer than its maximum)."""
    if requested_s is not None:
        return min(requested_s, max_ms / 1000)
    default_ms = model_default_ms if model_default_ms is not None else server_default_ms
    return min(default_ms, max_ms) / 1000 if default_ms is not None else max_ms / 1000


def timeout_seconds(
    value: Any, name: str, unit: str, unit_s: float, *, integral: bool, zero_means_none: bool
) -> float | None:
    """A client's timeout (``value`` in ``unit``, each ``unit_s`` seconds) in
    seconds, or None when absent (or 0, where that means "no timeout").
    Anything else than a positive number of at most ``MAX_TIMEOUT_S`` (an
    integer if ``integral``) is ``InvalidInput`` naming ``name``."""
    if value is None:
        return None
    limit = round(MAX_TIMEOUT_S / unit_s)
    is_number = isinstance(value, int) if integral else isinstance(value, (int, float))
    # NaN fails every comparison, so it is refused with the rest.
    if is_number and not isinstance(value, bool) and 0 <= value <= limit:
        if value:
            return value / round(1 / unit_s)  # 50_000 µs is 0.05 s, not 0.049999999999999996
        if zero_means_none:
            return None
    if zero_means_none:
        rule = f"a non-negative {'integer' if integral else 'number'} ({unit}), 0 for no timeout"
    else:
        rule = f"a positive {'integer' if integral else 'number'} ({unit})"
    raise InvalidInput(
        f"{name} must be {rule}, at most {limit} (one hour); got {reprlib.repr(value)}"
    )


def response_parameters(results: Results, batched: bool) -> dict[str, Any]:
    """The OIP response's ``parameters`` from the rows' output parameters
    (``tensorserve.WithParameters``): per name, the rows' values in order,
    like the outputs' batch dimension; a model without a batch dimension
    (one item per request) gives the value itself. {} when there are none."""
    rows = [row_parameters(result) for result in results]
    if not any(rows):
        return {}
    if not batched:
        return rows[0]
    names = dict.fromkeys(name for row in rows for name in row)
    return {name: [row.get(name) for row in rows] for name in names}

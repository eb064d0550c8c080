"""``OipJsonTarget``: the KServe v2 (Open Inference Protocol) JSON spelling of
an ``HttpTarget`` request, so a benchmark can send the same items over both of
the server's protocols (``wire/oip.py`` reads them).

One request carries its items as rows of a leading batch dimension: for a
model that batches (``max_batch_size`` > 1) the server expects every input as
``[k, *item_shape]``, so a single item of ``n`` tokens is ``shape [1, n]``.
A model that does not batch takes exactly one item, without that dimension.
The rows of one request share their shape: items of different lengths cannot
travel in one OIP request (send them one per request).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tensorserve.bench.items import Item
from tensorserve.bench.targets import HttpTarget


def oip_json_body(
    items: Sequence[Item], dtypes: Mapping[str, str], *, batched: bool = True
) -> bytes:
    """The JSON body of one infer request for ``items`` (``data`` inline, flat
    row-major). ``dtypes``: feature name -> the model's dtype name (numpy
    style, as in config.toml); an unknown feature keeps its array's dtype."""
    from tensorserve.tensors.dtypes import dtype as lookup  # imports torch: only when encoding

    if not items:
        raise ValueError("an OIP request needs at least one item")
    if not batched and len(items) != 1:
        raise ValueError(
            f"a model that does not batch takes one item per request, not {len(items)}"
        )
    inputs: list[dict[str, Any]] = []
    for name in items[0]:
        rows = [np.asarray(item[name]) for item in items]
        if any(row.shape != rows[0].shape for row in rows):
            shapes = sorted({tuple(row.shape) for row in rows})
            raise ValueError(f"feature {name!r}: rows of one OIP request differ in shape {shapes}")
        tensor = np.stack(rows) if batched else rows[0]
        dt = lookup(dtypes.get(name, tensor.dtype.name))
        inputs.append(
            {
                "name": name,
                "shape": list(tensor.shape),
                "datatype": dt.v2,
                "data": tensor.reshape(-1).tolist(),
            }
        )
    return json.dumps({"inputs": inputs}, separators=(",", ":")).encode()


class OipJsonTarget(HttpTarget):
    """An ``HttpTarget`` that spells its requests in KServe v2 JSON (same route,
    ``Content-Type: application/json``); discovery, counters and ``send`` are
    the native target's."""

    kind = "http (oip json)"
    content_type = "application/json"

    def __init__(self, url: str, model: str, *, timeout: float = 60.0) -> None:
        super().__init__(url, model, timeout=timeout)
        self.batched = True  # until discover() reads the model's max_batch_size

    async def discover(self) -> None:
        await super().discover()
        if self._config is not None and "max_batch_size" in self._config:
            self.batched = int(self._config["max_batch_size"]) > 1

    def encode_body(self, items: Sequence[Item]) -> tuple[bytes, Mapping[str, str]]:
        dtypes = {s.name: s.dtype for s in self.specs}
        return oip_json_body(items, dtypes, batched=self.batched), {}

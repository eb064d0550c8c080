"""A batch's ragged outputs (``ragged = true``) on their way to the host.

The model returns a ragged output as a list of one tensor per row, each its
own length. Each row travels under its own key, ``"{row}/{name}"`` (the keys
a worker process already sends per-item results under), beside the batched
outputs: on CUDA in the same queued copy to pinned memory, read after the
batch's one event. ``join_rows`` gathers them back into one list per output
for ``batching.collate.unpad``, which takes each row as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tensorserve.errors import ModelFailure
from tensorserve.repository.config import OutputSpec
from tensorserve.tensors.bytes_tensor import bytes_output


def split_rows(
    named: Mapping[str, Any], specs: Sequence[OutputSpec], batch: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Each row of each ragged output under ``"{row}/{name}"``: numeric rows
    as tensors of the declared dtype (still on the device), bytes rows as
    object arrays of ``bytes``. A value that is not one row per item of the
    batch fails the batch with a sentence naming the output (``batch`` None:
    a packed batch, whose rows un-packing counts, ``collate.ragged_rows``)."""
    tensors: dict[str, torch.Tensor] = {}
    strings: dict[str, np.ndarray] = {}
    for spec in specs:
        rows = named[spec.name]
        if not isinstance(rows, (list, tuple)) or len(rows) != (batch or len(rows)):
            got = f"{len(rows)} rows" if isinstance(rows, (list, tuple)) else type(rows).__name__
            raise ModelFailure(
                f"ragged output {spec.name!r} must be a list of one tensor per row; got "
                f"{got} for a batch of {batch}"
            )
        for i, row in enumerate(rows):
            key = f"{i}/{spec.name}"
            if spec.dt.is_bytes:
                strings[key] = bytes_output(row, spec.name)
            else:
                tensors[key] = torch.as_tensor(row).to(spec.dt.torch_dtype)
    return tensors, strings


def join_rows(
    host: Mapping[str, np.ndarray], names: Sequence[str]
) -> dict[str, np.ndarray | list[np.ndarray]]:
    """The outputs with each ragged one's rows gathered back into a list."""
    joined: dict[str, np.ndarray | list[np.ndarray]] = dict(host)
    for name in names:
        rows: list[np.ndarray] = []
        while (key := f"{len(rows)}/{name}") in joined:
            rows.append(joined.pop(key))  # type: ignore[arg-type]
        joined[name] = rows
    return joined


def flat_rows(outputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``join_rows`` undone: each ragged output's rows under ``"{row}/{name}"``
    again, to cross a worker's socket as plain tensors (never pickled)."""
    flat: dict[str, np.ndarray] = {}
    for name, value in outputs.items():
        if isinstance(value, list):
            flat.update({f"{i}/{name}": row for i, row in enumerate(value)})
        else:
            flat[name] = value
    return flat

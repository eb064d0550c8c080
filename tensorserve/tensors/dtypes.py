"""The dtype table: numpy names (the native protocol and config.toml), torch
dtypes (the model), and KServe v2 datatypes (the Open Inference Protocol).

numpy has no bfloat16, so on the host a bfloat16 tensor travels as its raw
2-byte patterns in a ``uint16`` array and is reinterpreted as bfloat16 only
once it is a torch tensor (``as_torch`` / ``from_torch``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    name: str  # numpy-style name used in config.toml and the native protocol
    numpy: np.dtype  # host representation (little-endian)
    torch: torch.dtype
    v2: str  # KServe v2 / OIP datatype

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


def _entry(name: str, np_name: str, th: torch.dtype, v2: str) -> DType:
    return DType(name, np.dtype(np_name).newbyteorder("<"), th, v2)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _entry("bool", "bool", torch.bool, "BOOL"),
        _entry("uint8", "uint8", torch.uint8, "UINT8"),
        _entry("uint16", "uint16", torch.uint16, "UINT16"),
        _entry("uint32", "uint32", torch.uint32, "UINT32"),
        _entry("uint64", "uint64", torch.uint64, "UINT64"),
        _entry("int8", "int8", torch.int8, "INT8"),
        _entry("int16", "int16", torch.int16, "INT16"),
        _entry("int32", "int32", torch.int32, "INT32"),
        _entry("int64", "int64", torch.int64, "INT64"),
        _entry("float16", "float16", torch.float16, "FP16"),
        _entry("float32", "float32", torch.float32, "FP32"),
        _entry("float64", "float64", torch.float64, "FP64"),
        _entry("bfloat16", "uint16", torch.bfloat16, "BF16"),
    )
}
BY_V2: dict[str, DType] = {d.v2: d for d in DTYPES.values()}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in DTYPES.values()}


def dtype(name: str) -> DType:
    """Look a dtype up by its numpy-style name; KeyError names the choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def as_torch(array: np.ndarray, dt: DType) -> torch.Tensor:
    """Zero-copy view of a host array as a torch tensor of ``dt``."""
    tensor = torch.from_numpy(array)
    if dt.name == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def from_torch(tensor: torch.Tensor) -> np.ndarray:
    """Host tensor -> numpy (bfloat16 as its uint16 bit patterns)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()

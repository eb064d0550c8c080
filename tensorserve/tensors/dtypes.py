"""The dtype table: numpy names (the native protocol and config.toml), torch
dtypes (the model), and KServe v2 datatypes (the Open Inference Protocol).

numpy has no bfloat16, so on the host a bfloat16 tensor travels as its raw
2-byte patterns in a ``uint16`` array and is reinterpreted as bfloat16 only
once it is a torch tensor (``as_torch`` / ``from_torch``).

``bytes`` (KServe v2 ``BYTES``) is the one dtype that is not numeric: on the
host it is a numpy object array of ``bytes``, and it never becomes a torch
tensor (``torch`` is None): a model gets and returns the object array
itself (``as_feature`` / ``host_array``). How it travels on each wire is
``tensors/bytes_tensor.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TorchDType = torch.dtype  # (inside DType, ``torch`` names the field)


@dataclass(frozen=True)
class DType:
    name: str  # numpy-style name used in config.toml and the native protocol
    numpy: np.dtype  # host representation (little-endian)
    torch: torch.dtype | None  # None: bytes, which stays a numpy object array
    v2: str  # KServe v2 / OIP datatype

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_bytes(self) -> bool:
        return self.torch is None

    @property
    def torch_dtype(self) -> TorchDType:
        """The torch dtype of a numeric dtype (bytes has none: a sentence says so)."""
        if self.torch is None:
            raise TypeError(f"dtype {self.name} has no torch dtype: it stays a numpy object array")
        return self.torch


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
        DType("bytes", np.dtype(object), None, "BYTES"),
    )
}
BYTES = DTYPES["bytes"]
NUMERIC: dict[str, DType] = {name: d for name, d in DTYPES.items() if not d.is_bytes}
BY_V2: dict[str, DType] = {d.v2: d for d in DTYPES.values()}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in NUMERIC.values() if d.torch is not None}
# What a model's forward gets for one feature, and returns for one output:
# a torch tensor, or (bytes) a numpy object array of ``bytes``.
Feature = torch.Tensor | np.ndarray


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


def as_feature(array: np.ndarray, dt: DType) -> Feature:
    """A host array as the model gets it: a zero-copy torch view, or the
    object array itself for bytes."""
    return array if dt.is_bytes else as_torch(array, dt)


def host_array(feature: Feature) -> np.ndarray:
    """A feature or output back on the host as numpy (``from_torch`` for a tensor)."""
    return feature if isinstance(feature, np.ndarray) else from_torch(feature)

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

import functools
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    TorchDType = torch.dtype  # (inside DType, ``torch`` names the property)
    # What a model's forward gets for one feature, and returns for one output:
    # a torch tensor, or (bytes) a numpy object array of ``bytes``.
    Feature = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class DType:
    """One dtype's names. Its torch dtype is looked up when first asked for:
    a front-end process (``--frontends N``) decodes, validates and encodes
    with this table and never imports torch."""

    name: str  # numpy-style name used in config.toml and the native protocol
    numpy: np.dtype  # host representation (little-endian)
    torch_name: str | None  # the torch dtype's name (``torch.<name>``); None: bytes
    v2: str  # KServe v2 / OIP datatype

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def is_bytes(self) -> bool:
        return self.torch_name is None

    @property
    def is_float(self) -> bool:
        return self.numpy.kind == "f" or self.name == "bfloat16"

    # Looked up once, then kept on the instance (read per batch by the model's side).
    @functools.cached_property
    def torch(self) -> TorchDType | None:
        """The torch dtype (imports torch); None: bytes, which stays a numpy
        object array."""
        return None if self.torch_name is None else _torch_dtype(self.torch_name)

    @functools.cached_property
    def torch_dtype(self) -> TorchDType:
        """The torch dtype of a numeric dtype (bytes has none: a sentence says so)."""
        if self.torch_name is None:
            raise TypeError(f"dtype {self.name} has no torch dtype: it stays a numpy object array")
        return _torch_dtype(self.torch_name)


@functools.cache
def _torch_dtype(name: str) -> TorchDType:
    dtype: TorchDType = getattr(importlib.import_module("torch"), name)
    return dtype


def _entry(name: str, np_name: str, v2: str) -> DType:
    return DType(name, np.dtype(np_name).newbyteorder("<"), name, v2)


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        _entry("bool", "bool", "BOOL"),
        _entry("uint8", "uint8", "UINT8"),
        _entry("uint16", "uint16", "UINT16"),
        _entry("uint32", "uint32", "UINT32"),
        _entry("uint64", "uint64", "UINT64"),
        _entry("int8", "int8", "INT8"),
        _entry("int16", "int16", "INT16"),
        _entry("int32", "int32", "INT32"),
        _entry("int64", "int64", "INT64"),
        _entry("float16", "float16", "FP16"),
        _entry("float32", "float32", "FP32"),
        _entry("float64", "float64", "FP64"),
        _entry("bfloat16", "uint16", "BF16"),
        DType("bytes", np.dtype(object), None, "BYTES"),
    )
}
BYTES = DTYPES["bytes"]
NUMERIC: dict[str, DType] = {name: d for name, d in DTYPES.items() if not d.is_bytes}
BY_V2: dict[str, DType] = {d.v2: d for d in DTYPES.values()}


@functools.cache
def _by_torch() -> dict[TorchDType, DType]:
    return {d.torch_dtype: d for d in NUMERIC.values()}


def by_torch(torch_dtype: TorchDType) -> DType | None:
    """The dtype of a torch tensor's ``dtype`` (None: none of the table's)."""
    return _by_torch().get(torch_dtype)


def __getattr__(name: str) -> Any:
    # Names whose value is torch's: made when first imported (by the code
    # that runs models), so that importing this module does not import torch.
    if name == "Feature":
        import torch

        return torch.Tensor | np.ndarray
    if name == "TorchDType":
        import torch

        return torch.dtype
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype(name: str) -> DType:
    """Look a dtype up by its numpy-style name; KeyError names the choices."""
    try:
        return DTYPES[name]
    except KeyError:
        raise KeyError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None


def as_torch(array: np.ndarray, dt: DType) -> torch.Tensor:
    """Zero-copy view of a host array as a torch tensor of ``dt``."""
    import torch

    tensor = torch.from_numpy(array)
    if dt.name == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def from_torch(tensor: torch.Tensor) -> np.ndarray:
    """Host tensor -> numpy (bfloat16 as its uint16 bit patterns)."""
    import torch

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


def bfloat16_bits(floats: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (``uint16``), rounded as torch
    rounds them (to nearest, ties to even; a NaN stays a NaN, the quiet
    0x7FC0), in numpy: a front end reads a JSON request's BF16 data without
    torch."""
    values = np.asarray(floats, dtype=np.float32, order="C")
    bits = values.view(np.uint32)
    # Adding 0x7FFF, or 0x8000 when the kept half is odd, carries into it
    # exactly when the dropped half is past halfway (or at it, to even).
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded.astype(np.uint16))


def bfloat16_floats(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (``uint16``) as the float32 values they hold (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

"""How many NVIDIA GPUs this process can see, without initialising CUDA.

The server decides its front-end processes at start-up, before any model is
placed, so it must not ask torch: ``torch.cuda.device_count()`` may
initialise the CUDA driver in the server process, and a process that forks
after that cannot use CUDA in its children. NVML, the driver's management
library, never creates a CUDA context: it is loaded with ctypes (no
dependency, nothing at import) and asked for the GPUs the driver knows, and
then ``CUDA_VISIBLE_DEVICES`` narrows them by CUDA's own rule:

- unset: every GPU;
- empty, or an invalid first entry: none;
- a list of indices, or of UUIDs (``GPU-...``, a unique prefix is enough):
  the entries up to the first invalid one (an index past the last GPU, an
  unknown UUID) count; a repeated entry makes the list invalid (none).

No NVML library (no NVIDIA driver, a CPU-only container) is no GPU.

NVML counts the driver's GPUs, which a CPU-only torch wheel cannot use:
``torch_has_cuda`` says whether the installed torch is a CUDA build, read
from ``torch/version.py`` without importing torch (nor initialising CUDA).
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
_UUID_BUFFER = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE


@dataclass(frozen=True)
class DriverGpus:
    """What NVML reports: the driver's GPUs in its order (their UUIDs), before
    ``CUDA_VISIBLE_DEVICES``."""

    uuids: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.uuids)


def read_nvml(library: str = NVML_LIBRARY) -> DriverGpus | None:
    """The driver's GPUs through NVML; None when NVML cannot be loaded or
    fails to initialise (no driver: the caller counts no GPU)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != NVML_SUCCESS:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != NVML_SUCCESS:
            return None
        uuids = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            buffer = ctypes.create_string_buffer(_UUID_BUFFER)
            got = nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
            if got == NVML_SUCCESS:
                got = nvml.nvmlDeviceGetUUID(handle, buffer, _UUID_BUFFER)
            # A GPU whose UUID cannot be read still counts for indices.
            uuids.append(buffer.value.decode() if got == NVML_SUCCESS else f"?{index}")
        return DriverGpus(tuple(uuids))
    finally:
        nvml.nvmlShutdown()


@functools.cache
def _driver_gpus() -> DriverGpus | None:
    # Read once a process: the driver's GPUs do not change while it runs, and
    # nvmlInit takes up to a second on a node without persistence mode.
    return read_nvml()


def _leading_int(entry: str) -> int | None:
    """CUDA reads each index like ``strtoul``: the digits it starts with
    (``"1gpu"`` is 1); None when it starts with none."""
    entry = entry.strip()
    digits = len(entry) - len(entry.lstrip("0123456789"))
    return int(entry[:digits]) if digits else None


def visible_count(driver: DriverGpus, cuda_visible_devices: str | None) -> int:
    """The GPUs CUDA will show a process given ``CUDA_VISIBLE_DEVICES``
    (None: unset), by the rule in the module docstring."""
    if cuda_visible_devices is None:
        return driver.count
    seen: list[int | str] = []
    for entry in cuda_visible_devices.split(","):
        device = _device(driver, entry.strip())
        if device is None:
            break  # this entry and every one after it are hidden
        if device in seen:
            return 0  # CUDA refuses a list naming one device twice
        seen.append(device)
    return len(seen)


def _device(driver: DriverGpus, entry: str) -> int | str | None:
    """The device an entry names: a driver index (a number, or the one GPU
    whose UUID starts with it), a MIG instance (its ``MIG-`` UUID, which is
    no GPU's: NVML lists whole GPUs), or None: not a visible device."""
    if entry.startswith("MIG-"):
        return entry if driver.count and entry[4:] else None
    if entry.startswith("GPU-"):
        found = [i for i, uuid in enumerate(driver.uuids) if uuid.startswith(entry)]
        return found[0] if len(found) == 1 else None
    index = _leading_int(entry)
    return index if index is not None and index < driver.count else None


def visible_gpus(driver: DriverGpus | None = None, environ: dict[str, str] | None = None) -> int:
    """The NVIDIA GPUs this process can see (0: none, or no NVML), without
    initialising CUDA. ``driver`` and ``environ`` are for tests."""
    driver = _driver_gpus() if driver is None else driver
    if driver is None:
        return 0
    environ = dict(os.environ) if environ is None else environ
    return visible_count(driver, environ.get("CUDA_VISIBLE_DEVICES"))


@functools.cache
def torch_has_cuda() -> bool:
    """Whether the installed torch was built with CUDA (``torch.version.cuda``
    is set), without initialising CUDA: from the module if torch is imported
    already, else from ``torch/version.py``'s text, so that a process that has
    not imported torch (a supervisor deciding its front ends) does not pay
    for it. No torch is no CUDA."""
    version = getattr(sys.modules.get("torch"), "version", None)
    if version is not None:
        return getattr(version, "cuda", None) is not None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return False
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        try:
            tree = ast.parse((Path(folder) / "version.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        return _cuda_assigned(tree)
    return False


def _cuda_assigned(tree: ast.Module) -> bool:
    """``cuda`` in torch/version.py is set to something other than None
    (``cuda: Optional[str] = '12.4'``; a CPU build's is ``None``)."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "cuda" for target in targets):
            return not (isinstance(value, ast.Constant) and value.value is None)
    return False

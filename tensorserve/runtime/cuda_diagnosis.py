"""Why CUDA is missing, in one line an operator can act on.

torch reports only "not available" when the node's NVIDIA driver is older
than its CUDA build needs, when the device plugin gave the pod no GPU, or
when the image holds torch's CPU build. The line names what tells these
apart: torch's version, the CUDA version it was built for
(``torch.version.cuda``, None for a CPU build) and the driver, when it can
be read. ``describe`` is pure, so it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import threading
from pathlib import Path

log = logging.getLogger(__name__)
# Held once this process said that ``device = "auto"`` found no CUDA: every
# model left to auto runs on the CPU for the same reason.
_no_cuda_said = threading.Lock()

# The oldest Linux driver each CUDA major version runs on, through minor
# version compatibility (docs.nvidia.com/deploy/cuda-compatibility,
# "Minor Version Compatibility"); docs/deployment.md has the table.
MIN_DRIVER = {11: 450, 12: 525, 13: 580}

PROC_VERSION = Path("/proc/driver/nvidia/version")


def parse_proc_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's first line
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug ...")."""
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def driver_version() -> str | None:
    """The NVIDIA driver of this node, if the container can see it: the
    kernel module's /proc file, else nvidia-smi; None when neither answers."""
    with contextlib.suppress(OSError):
        if found := parse_proc_version(PROC_VERSION.read_text()):
            return found
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def describe(torch_version: str, cuda_version: str | None, driver: str | None) -> str:
    """One line: torch, the CUDA it was built for, the driver, and which of
    them is the likely cause."""
    built = f"built for CUDA {cuda_version}" if cuda_version else "a CPU-only build (no CUDA)"
    seen = f"NVIDIA driver {driver}" if driver else "no NVIDIA driver visible"
    line = f"torch {torch_version}, {built}; {seen}"
    if cuda_version is None:
        return f"{line}: install torch's CUDA build"
    major = int(cuda_version.split(".")[0])
    need = MIN_DRIVER.get(major)
    if driver is None:
        return f"{line}: is a GPU assigned to this container (nvidia.com/gpu, --gpus)?"
    if need is not None and int(driver.split(".")[0]) < need:
        return f"{line}: CUDA {major}.x needs driver >= {need}"
    return line


def cuda_missing() -> str:
    """``describe`` for this process."""
    import torch

    return describe(torch.__version__, torch.version.cuda, driver_version())


def warn_auto_on_cpu() -> None:
    """Once per process: ``device = "auto"`` found no CUDA. A GPU node whose
    driver is too old for this torch, or a pod without its GPU, would
    otherwise serve on the CPU, slowly, with nothing in the logs."""
    if _no_cuda_said.acquire(blocking=False):
        log.warning(
            'device = "auto" found no CUDA, so models run on the CPU (%s); --device cpu '
            "silences this warning, --device cuda makes it an error",
            cuda_missing(),
        )

"""The packages form layers with no cycles, only tensorserve.http imports
aiohttp, ``import tensorserve`` and a front-end process stay light (no
torch), and modules stay small enough to read in one sitting. The contracts live in pyproject.toml
(``[tool.importlinter]``); docs/architecture.md explains them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project depends on tomli below 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tensorserve"
MAX_LINES = 400
# Modules allowed past MAX_LINES, each with a one-line reason:
# {"tensorserve/x.py": "why it cannot be split"}.
LONG_MODULES: dict[str, str] = {
    "tensorserve/grpc/generated/grpc_service_pb2_grpc.py":
        "generated from Triton's grpc_service.proto by scripts/regenerate_grpc_stubs.py",
}


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold() -> None:
    # --no-cache: a stale cache must never hide a new import.
    result = subprocess.run(
        [
            sys.executable, "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--config", "pyproject.toml", "--no-cache", "--no-logo",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert f"{len(_contracts())} kept, 0 broken" in result.stdout, report


def test_every_package_has_a_layer() -> None:
    """A new package (or top-level module) must be placed in the layers, or
    nothing would stop it importing anything."""
    (layers,) = [c for c in _contracts() if c["type"] == "layers"]
    placed = {name.strip() for line in layers["layers"] for name in line.split("|")}
    present = {
        f"tensorserve.{path.stem if path.is_file() else path.name}"
        for path in PACKAGE.iterdir()
        if (path.is_dir() and (path / "__init__.py").exists())
        or (path.suffix == ".py" and path.stem not in ("__init__", "__main__"))
    }
    assert present - placed == set(), f"packages in no layer: {sorted(present - placed)}"
    assert placed - present == set(), f"layers naming no package: {sorted(placed - present)}"


def test_import_tensorserve_does_not_import_torch() -> None:
    # The client-facing error types and `tensorserve --help` must not pay for torch.
    result = subprocess.run(
        [sys.executable, "-c", "import sys, tensorserve; print('torch' in sys.modules)"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# A front-end process (``--frontends N``): it imports its module, builds its
# app on a plane that asks the scheduler process, takes a model table (each
# config parsed and checked, bounds too), and validates a JSON request's
# BF16 data and a bounded float16 input: all with numpy, never torch.
FRONT_END = """
import socket, sys
import numpy as np
from tensorserve.frontends.process import build_app
from tensorserve.frontends.remote import Scheduler
from tensorserve.settings import Settings
from tensorserve.wire.validate import validate_item

ours, theirs = socket.socketpair()
scheduler = Scheduler(ours)
build_app(Settings(), scheduler)
config = {
    "max_batch_size": 4,
    "input": [{"name": "x", "dtype": "bfloat16", "shape": [-1]},
              {"name": "h", "dtype": "float16", "shape": [-1], "min_value": -1, "max_value": 1}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
}
scheduler._models([["m", 1, "READY", "", config, False, 1]])
model = scheduler.ready_model("m")
row = validate_item({"x": [1.0, 2.5], "h": np.array([0.5], np.float16)}, model.config.input, 0)
assert row["x"].tolist() == [0x3F80, 0x4020], row
print(sorted(m for m in ("torch", "safetensors") if m in sys.modules))
"""


def test_a_front_end_process_does_not_import_torch() -> None:
    # ~250 MB of RSS and ~1.3 s of start-up in each front end (docs/architecture.md).
    result = subprocess.run(
        [sys.executable, "-c", FRONT_END],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_no_module_is_longer_than_it_can_be_read() -> None:
    lengths = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    over = {
        name: lines for name, lines in sorted(lengths.items())
        if lines > MAX_LINES and name not in LONG_MODULES
    }
    assert not over, f"modules over {MAX_LINES} lines (split them, or allow one with a reason): {over}"
    stale = sorted(name for name in LONG_MODULES if lengths.get(name, 0) <= MAX_LINES)
    assert not stale, f"LONG_MODULES lists modules that are short enough now: {stale}"

"""The packages form layers with no cycles, no module imports another that
imports it back (not even for types), only tensorserve.http imports
aiohttp, ``import tensorserve`` and a front-end process stay light (no
torch), and modules stay small enough to read in one sitting. The contracts live in pyproject.toml
(``[tool.importlinter]``); docs/architecture.md explains them."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
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


# Every import counts: one under ``if TYPE_CHECKING:`` or in a function too.
# In a process of its own, as the contracts are checked: grimp's threads
# must not leave garbage behind for the tests that count the collector's.
IMPORTS = """
import grimp, json
graph = grimp.build_graph(
    "tensorserve", include_external_packages=True, exclude_type_checking_imports=False,
    cache_dir=None,
)
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}))
"""


@functools.cache
def _imports() -> dict[str, list[str]]:
    """Each module of tensorserve (and each package it imports, by its top
    name) -> the modules it imports itself."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    imports: dict[str, list[str]] = json.loads(result.stdout)
    return imports


def module_cycles(imports: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Each set of modules that import one another in a circle (a strongly
    connected component of more than one module, or one that imports
    itself), sorted; Tarjan's algorithm, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(imports.get(target, ())))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1 or module in imports.get(module, ()):
                    cycles.append(sorted(component))
    return sorted(cycles)


def test_module_cycles_are_found_whatever_their_length() -> None:
    imports = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["e"], "f": ["d"]}
    assert module_cycles(imports) == [["a", "b", "c"], ["e"]]
    assert module_cycles({"a": ["b"], "b": []}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    """A circle between modules, even one closed by an ``if TYPE_CHECKING:``
    import, means a type both sides use belongs in a lower module (or the
    lower one declares what it needs as a ``Protocol``)."""
    ours = {m for m in _imports() if m == "tensorserve" or m.startswith("tensorserve.")}
    imports = {m: [t for t in targets if t in ours] for m, targets in _imports().items()}
    assert len(ours) > 100, "the whole package was read"
    assert module_cycles(imports) == []


def test_only_the_http_package_imports_aiohttp() -> None:
    importers = {
        module
        for module, targets in _imports().items()
        if module.startswith("tensorserve") and "aiohttp" in targets
    }
    assert importers, "the HTTP front end imports aiohttp"
    outside = sorted(m for m in importers if not m.startswith("tensorserve.http."))
    assert outside == [], f"aiohttp imported outside tensorserve/http/: {outside}"


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

"""Writing a benchmark's results: one JSON file that says when and where it
was measured (the docs quote the date and the machine with every figure).

    save(path, payload)     a script's results, with ``date`` and ``machine``
    write_json(path, data)  any JSON result (``BenchResult.save`` uses it)
    machine_info()          the machine and versions, as ``BenchResult`` records them
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any


def save(path: str | Path, payload: dict[str, Any]) -> Path:
    """``payload`` with the date and the machine, as indented JSON at ``path``."""
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    path = write_json(path, {"date": time.strftime("%Y-%m-%d"), "machine": machine, **payload})
    print(f"saved {path}")
    return path


def write_json(path: str | Path, data: Any, *, indent: int = 2) -> Path:
    """``data`` as JSON at ``path`` (folders made). NaN (a point with no
    successful request, say) is written as null: strict JSON readers refuse
    NaN. Values JSON has no type for are written as their ``str``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_no_nan(data), indent=indent, default=str) + "\n")
    return path


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def machine_info() -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": version("torch"),
        "tensorserve": version("tensorserve"),
    }

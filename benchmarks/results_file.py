"""Saving a benchmark's results: one JSON file that says when and where it
was measured (the docs quote the date and the machine with every figure)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any


def save(path: str | Path, payload: dict[str, Any]) -> None:
    """``payload`` with the date and the machine, as indented JSON at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine, **payload},
                               indent=2))
    print(f"saved {path}")

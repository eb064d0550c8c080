"""The packages form layers with no cycles, and modules stay small enough to
read in one sitting. The contracts live in pyproject.toml
(``[tool.importlinter]``); docs/architecture.md explains them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400
# Modules allowed past MAX_LINES, each with the reason.
LONG_MODULES: dict[str, str] = {}


def test_the_import_contracts_hold() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_no_module_is_longer_than_it_can_be_read() -> None:
    long = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in (ROOT / "tensorserve").rglob("*.py")
    }
    over = {name: lines for name, lines in long.items() if lines > MAX_LINES and name not in LONG_MODULES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"

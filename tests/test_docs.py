"""Every Python example in the docs runs (against the real server process)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

DOCS = ["docs/protocol.md", "docs/model-repository.md", "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples() -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        path = ROOT / doc
        if path.exists():
            for index, code in enumerate(BLOCK.findall(path.read_text())):
                found.append((doc, index, code))
    return found


@pytest.mark.parametrize("doc, index, code", examples(), ids=lambda v: str(v)[:30])
def test_python_examples_in_the_docs_run(server_url: str, doc: str, index: int, code: str) -> None:
    for default in ("http://127.0.0.1:8000", "http://localhost:8000"):
        code = code.replace(default, server_url)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, f"{doc} example {index} failed:\n{result.stderr}"

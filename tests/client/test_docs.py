"""Every Python example in docs/client.md runs against the real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, ServerProcess

DOC = ROOT / "docs" / "client.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
EXAMPLES = BLOCK.findall(DOC.read_text())


def test_the_guide_has_examples_that_read_the_url_from_the_environment() -> None:
    assert len(EXAMPLES) >= 7
    for code in EXAMPLES:
        assert 'os.environ.get("TENSORSERVE_URL", "http://localhost:8000")' in code


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_example_runs(server: ServerProcess, code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        check=False,
        cwd=ROOT,
        env={**os.environ, "TENSORSERVE_URL": server.url,
             "TENSORSERVE_GRPC_URL": f"grpc://{server.grpc_address}"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 0, f"example failed:\n{code}\n{result.stderr}"

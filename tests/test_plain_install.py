"""A new user's install, for real: the server's wheel, built from this tree,
into a fresh virtual environment with nothing but torch before it
(``pip install tensorserve``, no extras), then ``tensorserve serve`` on the
default repository. Every model must be READY, ``/v2/health/ready`` 200 and
gRPC's ServerReady true; ``tensorserve bench`` says which package brings it.

It reaches the package index (as CI machines do), so it is slow, not skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tensorserve_bench.server import free_port

from tests.conftest import ROOT
from tests.helpers import build_server_wheel, wait_until

INSTALL_TIMEOUT_S = 900  # torch from the machine's wheel, the rest from the index
READY_TIMEOUT_S = 180


def _clean_env(home: Path) -> dict[str, str]:
    """This machine's environment less what would reach into this checkout
    (PYTHONPATH) or change the server's settings (TENSORSERVE_*)."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("TENSORSERVE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }  # fmt: skip
    env["HOME"] = str(home)
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=INSTALL_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh virtual environment with torch and the server's wheel, nothing else."""
    folder = tmp_path_factory.mktemp("plain_install")
    env = _clean_env(folder)
    wheel = build_server_wheel(folder, ROOT)
    _run([sys.executable, "-m", "venv", str(folder / "venv")], env, folder)
    python = folder / "venv" / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0"], env, folder)
    _run([str(python), "-m", "pip", "install", "-q", str(wheel)], env, folder)
    yield folder / "venv" / "bin", env


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + READY_TIMEOUT_S + 120)
def test_a_plain_install_serves_every_default_model(
    venv: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    import tritonclient.grpc as triton_grpc

    bin_dir, env = venv
    http_port, grpc_port = free_port(), free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [str(bin_dir / "tensorserve"), "serve", "--model-repository",
             str(ROOT / "model_repository"), "--host", "127.0.0.1",
             "--port", str(http_port), "--grpc-port", str(grpc_port)],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    try:
        def ready() -> bool:
            assert server.poll() is None, f"the server exited: {log_path.read_text()[-3000:]}"
            try:
                return _get(f"{url}/v2/health/ready")[0] == 200
            except OSError:
                return False  # not listening yet

        # Readiness is a poll for any client of the server: there is no event to hold.
        wait_until(ready, "/v2/health/ready 200", READY_TIMEOUT_S, poll=0.5)
        states = {m["name"]: m["state"] for m in json.loads(_get(f"{url}/v2/models")[1])["models"]}
        bundled = {p.name for p in (ROOT / "model_repository").iterdir() if (p / "config.toml").exists()}
        assert set(states) == bundled
        assert set(states.values()) == {"READY"}, states
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert client.is_server_ready() is True
        finally:
            client.close()
    finally:
        server.terminate()
        server.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)  # the first to run builds the environment
def test_without_the_bench_package_the_bench_command_says_what_to_install(
    venv: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    bin_dir, env = venv
    done = subprocess.run([str(bin_dir / "tensorserve"), "bench", "tagger"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr == (
        "tensorserve bench needs the tensorserve-bench package; from the repository's root: "
        "pip install -e bench\n"
    )
    shown = subprocess.run([str(bin_dir / "tensorserve"), "--help"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0 and "bench" in shown.stdout

"""The container image's recipe, checked without a container engine.

The entrypoint test runs the final stage's exact ENTRYPOINT + CMD with its
ENV on this machine, against the repository the image copies to /models,
then runs its exact HEALTHCHECK command until it passes, answers a request,
and sends STOPSIGNAL: the server must exit 0 within the stop timeout that
the docs and manifests give. Only three things differ from the container:
/opt/venv/bin is this interpreter's folder, /models is ./model_repository
(the folder the Dockerfile copies there), and the port is a free one.
scripts/build_image_debootstrap.sh does the same inside a real container.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from tensorserve_bench.server import free_port

from tensorserve.settings import Settings
from tests.conftest import ROOT
from tests.helpers import wait_until

STOP_TIMEOUT_S = 30  # docker run --stop-timeout / terminationGracePeriodSeconds in docs and manifests


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"the final stage has no {keyword}"
        return found[-1]

    def env(self, build_args: dict[str, str] | None = None) -> dict[str, str]:
        """The stage's ENV, its ``${ARG}``s expanded: the ARG's default, or
        the value ``build_args`` gives (``--build-arg``)."""
        values = {}
        for args in self.all("ARG"):
            name, _, default = args.partition("=")
            values[name] = (build_args or {}).get(name, default)
        env: dict[str, str] = {}
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], value)
        return env


def stages(text: str = "") -> list[Stage]:
    """The Dockerfile's stages: instructions with continuations joined,
    comments and parser directives dropped."""
    text = text or (ROOT / "Dockerfile").read_text()
    logical, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue  # comments, hadolint's directives, and comments inside a continuation
        pending = pending[:-1] + " " + line.strip() if pending.endswith("\\") else line.strip()
        if pending and not pending.endswith("\\"):
            logical.append(pending)
            pending = ""
    found: list[Stage] = []
    for instruction in logical:
        keyword, _, args = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            found.append(Stage(parts[0], parts[2] if len(parts) > 2 else None))
        elif found:
            found[-1].instructions.append((keyword, args.strip()))
    return found


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    return value


def healthcheck_command(stage: Stage) -> list[str]:
    args = stage.last("HEALTHCHECK")
    _, _, command = args.partition("CMD ")
    return exec_form(command)


def test_both_variants_install_the_server_without_extras() -> None:
    """The GPU and the CPU image differ only in build arguments: one install
    line, the plain one, which serves every model of the default repository."""
    installs = [args for args in stages()[0].all("RUN") if "pip install" in args and " ." in args]
    assert installs == ["pip install . ./clients/python"], installs


def test_the_image_is_multi_stage_non_root_and_complete() -> None:
    build, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2 and build.name == "build"
    assert not any("pip" in args for args in final.all("RUN")), "no installs in the final stage"
    assert any("--from=build" in args and "/opt/venv" in args for args in final.all("COPY"))
    user = final.last("USER")
    assert user not in ("root", "0") and user.split(":")[0].isdigit(), "a numeric non-root user"
    env = final.env()
    assert env["TENSORSERVE_MODEL_REPOSITORY"] == "/models"
    assert "model_repository /models" in " ".join(final.all("COPY"))
    assert final.last("EXPOSE") == env["TENSORSERVE_PORT"]
    assert final.last("STOPSIGNAL") == "SIGTERM"
    assert "/v2/health/ready" in " ".join(healthcheck_command(final))
    assert exec_form(final.last("ENTRYPOINT")) == ["tensorserve"]
    assert exec_form(final.last("CMD")) == ["serve"]


def test_every_tensorserve_variable_of_the_image_is_a_setting() -> None:
    env = stages()[-1].env()
    names = [k.removeprefix("TENSORSERVE_").lower() for k in env if k.startswith("TENSORSERVE_")]
    assert names, "the image sets its settings by environment"
    unknown = [n for n in names if n not in Settings.model_fields]
    assert not unknown, f"not settings: {unknown}"
    Settings.model_validate({n: env[f"TENSORSERVE_{n.upper()}"] for n in names})


def test_the_stop_timeout_covers_the_drain() -> None:
    env = stages()[-1].env()
    fields = Settings.model_fields
    drain = float(env.get("TENSORSERVE_DRAIN_DELAY_S", fields["drain_delay_s"].default))
    grace = float(env.get("TENSORSERVE_SHUTDOWN_GRACE_S", fields["shutdown_grace_s"].default))
    assert drain + grace + 5 <= STOP_TIMEOUT_S, "the engine would kill the server mid-drain"
    assert f"--stop-timeout {STOP_TIMEOUT_S}" in (ROOT / "Dockerfile").read_text()


# What the CPU variant's build passes (the Dockerfile's header, docs/deployment.md).
CPU_VARIANT = {"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu", "DEVICE": "cpu"}


def test_the_cpu_variant_is_a_build_argument() -> None:
    build = stages()[0]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126" in build.all("ARG")
    command = " ".join(f"--build-arg {k}={v}" for k, v in CPU_VARIANT.items())
    assert command in (ROOT / "Dockerfile").read_text()
    assert command in (ROOT / "docs" / "deployment.md").read_text()


def test_the_gpu_variant_requires_cuda_and_the_cpu_one_does_not() -> None:
    final = stages()[-1]
    assert final.env()["TENSORSERVE_DEVICE"] == "cuda"  # never quietly on the CPU
    assert final.env(CPU_VARIANT)["TENSORSERVE_DEVICE"] == "cpu"


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    for stage in stages():
        for args in stage.all("COPY"):
            if "--from=" in args:
                continue
            for source in args.split()[:-1]:
                assert f"!{source.rstrip('/')}" in ignore or f"!{source.rstrip('/')}/" in ignore, source


def image_environment(final: Stage, port: int, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSERVE_")}
    venv_bin = str(Path(sys.executable).parent)
    for key, value in final.env(CPU_VARIANT).items():  # this machine has no GPU
        if key == "PATH":
            assert value == "/opt/venv/bin:$PATH", value
            env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
        else:
            env[key] = value
    env["TENSORSERVE_MODEL_REPOSITORY"] = str(ROOT / "model_repository")  # what COPY put at /models
    env["TENSORSERVE_PORT"] = str(port)
    env["HOME"] = str(home)
    return env


@pytest.mark.timeout(240)
def test_the_image_entrypoint_serves_the_bundled_repository(tmp_path: Path) -> None:
    from tensorserve_client import Client

    final = stages()[-1]
    port = free_port()
    env = image_environment(final, port, tmp_path)
    command = exec_form(final.last("ENTRYPOINT")) + exec_form(final.last("CMD"))
    health = healthcheck_command(final)
    start_period = float(re.search(r"--start-period=(\d+)s", final.last("HEALTHCHECK")).group(1))
    log = (tmp_path / "server.log").open("w+")
    server = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            assert server.poll() is None, f"the server exited: {(tmp_path / 'server.log').read_text()}"
            checked = subprocess.run(health, env=env, capture_output=True, timeout=10, check=False)
            return checked.returncode == 0

        # The HEALTHCHECK is itself a poll: there is no event to wait on.
        wait_until(healthy, "ready within the HEALTHCHECK's start period", start_period, poll=0.2)

        with Client(f"http://127.0.0.1:{port}") as client:
            ids = np.array([101, 7, 8, 102], dtype=np.int64)
            out = client.infer("tagger", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        assert out["logits"].shape[0] == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models", timeout=10) as reply:
            states = {m["name"]: m["state"] for m in json.load(reply)["models"]}
        assert set(states) == {p.name for p in (ROOT / "model_repository").iterdir() if p.is_dir()}
        assert set(states.values()) == {"READY"}, states  # what the image installs serves them all

        server.send_signal(getattr(signal, final.last("STOPSIGNAL")))
        assert server.wait(timeout=STOP_TIMEOUT_S) == 0, (tmp_path / "server.log").read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
    lines = (tmp_path / "server.log").read_text().splitlines()
    if final.env().get("TENSORSERVE_LOG_FORMAT") == "json":  # one JSON object per line, for a collector
        records = [json.loads(line) for line in lines]
        assert records and all(isinstance(r, dict) and r.get("message") for r in records)
        assert any("shutdown" in r["message"] for r in records)  # the drain was logged


def test_the_debootstrap_build_script_uses_the_same_checks() -> None:
    script = (ROOT / "scripts" / "build_image_debootstrap.sh").read_text()
    for needed in ("healthcheck run", "--stop-timeout", "--format docker", "BASE_IMAGE", "/infer"):
        assert needed in script

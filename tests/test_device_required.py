"""A GPU that never silently becomes the CPU: ``--device cuda`` fails models
that would run without CUDA, saying why (torch, its CUDA, the driver);
``auto`` on the CPU says so once, in the log, the metadata and a metric.
The version report is pure and tested for every case; the server is tested
for real on this machine (with CUDA present, the FAILED case cannot happen
and is skipped)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest
import torch
from tensorserve_bench.server import ServerProcess as BareServer

from tensorserve import ServedModel
from tensorserve.repository.config import parse_config
from tensorserve.runtime.cuda_diagnosis import (
    cuda_missing,
    describe,
    driver_version,
    parse_proc_version,
)
from tests.helpers import ECHO, POISON_MODEL, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------- the report, pure
@pytest.mark.parametrize(("torch_version", "cuda", "driver", "expected"), [
    ("2.13.0+cpu", None, None,
     "torch 2.13.0+cpu, a CPU-only build (no CUDA); no NVIDIA driver visible: "
     "install torch's CUDA build"),
    ("2.13.0+cu126", "12.6", "470.82.01",
     "torch 2.13.0+cu126, built for CUDA 12.6; NVIDIA driver 470.82.01: "
     "CUDA 12.x needs driver >= 525"),
    ("2.13.0+cu126", "12.6", None,
     "torch 2.13.0+cu126, built for CUDA 12.6; no NVIDIA driver visible: is a GPU assigned "
     "to this container (nvidia.com/gpu, --gpus)?"),
    ("2.13.0+cu126", "12.6", "535.104.05",
     "torch 2.13.0+cu126, built for CUDA 12.6; NVIDIA driver 535.104.05"),
    ("2.13.0", "13.0", "570.86.10",
     "torch 2.13.0, built for CUDA 13.0; NVIDIA driver 570.86.10: CUDA 13.x needs driver >= 580"),
])  # fmt: skip
def test_the_report_names_torch_its_cuda_the_driver_and_the_likely_cause(
    torch_version: str, cuda: str | None, driver: str | None, expected: str
) -> None:
    assert describe(torch_version, cuda, driver) == expected


def test_the_driver_version_is_read_from_the_kernel_modules_proc_file() -> None:
    text = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC "
            "2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert parse_proc_version(text) == "535.104.05"
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
    assert parse_proc_version(open_module) == "570.86.15"
    assert parse_proc_version("no driver here") is None


# ---------------------------------------------------------------------- the server's default
def _config(**fields: object):  # type: ignore[no-untyped-def]
    data = {"input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
            "output": [{"name": "y", "dtype": "float32", "shape": [-1]}], **fields}
    return parse_config(data, "m/config.toml")


def test_the_server_device_replaces_only_what_a_model_leaves_to_auto() -> None:
    assert _config().with_default_device("cuda").device == "cuda"
    assert _config(device="cpu").with_default_device("cuda").device == "cpu"
    assert _config(device="cuda:1").with_default_device("cpu").device == "cuda:1"
    assert _config().with_default_device("auto") == _config()
    groups = [{"count": 1}, {"count": 2, "kind": "KIND_CPU"}, {"count": 1, "gpus": [1]}]
    on_gpu = _config(instance_group=groups).with_default_device("cuda")
    assert [(g.kind, g.gpus) for g in on_gpu.instance_group] == [
        ("KIND_GPU", None), ("KIND_CPU", None), ("KIND_GPU", [1])]
    on_cpu = _config(instance_group=groups).with_default_device("cpu")
    assert [(g.kind, g.gpus) for g in on_cpu.instance_group] == [
        ("KIND_CPU", None), ("KIND_CPU", None), ("KIND_CPU", None)]


def test_auto_on_the_cpu_warns_once_per_process_naming_the_flag_that_silences_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    import tensorserve.runtime.cuda_diagnosis

    monkeypatch.setattr(tensorserve.runtime.cuda_diagnosis, "_no_cuda_said", threading.Lock())  # unsaid
    spec = {k: v for k, v in ECHO.items() if k not in ("inputs", "outputs")}
    io = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 4]}],
          "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}]}
    with caplog.at_level(logging.WARNING, logger="tensorserve.runtime.cuda_diagnosis"):
        models = [ServedModel.from_function(lambda x: x, **io, device=device, **spec)
                  for device in ("cpu", "auto", "auto", "auto")]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tensorserve.runtime.cuda_diagnosis"]
    assert warnings == [
        f'device = "auto" found no CUDA, so models run on the CPU ({cuda_missing()}); '
        "--device cpu silences this warning, --device cuda makes it an error"
    ]
    assert f"torch {torch.__version__}" in warnings[0]
    assert [model.devices for model in models] == [["cpu"]] * 4


# ---------------------------------------------------------------------- a real server
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: nothing fails")
def test_device_cuda_without_cuda_fails_the_models_that_need_it_and_says_why(
    tmp_path: Path,
) -> None:
    write_toy_model(tmp_path, "needs_gpu", POISON_MODEL, **{**ECHO, "device": None})
    write_toy_model(tmp_path, "pinned_cpu", POISON_MODEL, **{**ECHO, "device": "cpu"})
    server = BareServer(str(tmp_path), ["--device", "cuda"])
    server.ready_url = f"{server.url}/v2/models/pinned_cpu/ready"  # never ready as a whole
    server.start()
    url = server.url
    try:
        def states() -> dict[str, dict]:
            return {m["name"]: m for m in httpx.get(f"{url}/v2/models").json()["models"]}

        wait_until(lambda: states()["needs_gpu"]["state"] == "FAILED", "needs_gpu FAILED", 60)
        reason = states()["needs_gpu"]["reason"]
        assert reason == "device 'cuda' requested but CUDA is not available: " + describe(
            torch.__version__, torch.version.cuda, driver_version()
        )
        assert f"torch {torch.__version__}" in reason and "\n" not in reason
        ready = httpx.get(f"{url}/v2/models/needs_gpu/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        metadata = httpx.get(f"{url}/v2/models/needs_gpu").json()
        assert metadata["state"] == "FAILED" and "device" not in metadata
        # A model pinned to the CPU is not touched by the server's default.
        assert httpx.get(f"{url}/v2/models/pinned_cpu").json()["device"] == "cpu"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tensorserve_model_device_info{device="cpu",model="pinned_cpu"} 1.0' in metrics
        assert 'model="needs_gpu"' not in metrics.split("tensorserve_model_device_info")[-1]
        assert 'tensorserve_model_state{model="needs_gpu",state="FAILED"} 1.0' in metrics
    finally:
        server.stop()


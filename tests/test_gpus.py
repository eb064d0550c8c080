"""The GPUs a server sees without initialising CUDA (NVML, then
CUDA_VISIBLE_DEVICES by CUDA's rule), and the front ends it starts by
default: ``auto`` where it feeds a GPU, else one process. Every case runs on
the CPU with a made-up driver; one real start shows the CPU default."""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest
import torch

from tensorserve import cli, gpus, host
from tensorserve.gpus import DriverGpus, visible_count, visible_gpus
from tensorserve.host import choose_frontends
from tensorserve.settings import Settings
from tests.conftest import ServerProcess
from tests.helpers import ECHO, POISON_MODEL, front_ends, write_toy_model

FOUR = DriverGpus(("GPU-aaaa-0", "GPU-bbbb-1", "GPU-abcd-2", "GPU-cccc-3"))


@pytest.mark.parametrize(
    ("value", "count"),
    [
        (None, 4),  # unset: every GPU
        ("", 0),  # empty: none
        ("0", 1),
        ("3,1", 2),
        (" 2 , 0 ", 2),  # CUDA strips blanks around each entry
        ("1gpu,2", 2),  # strtoul: the digits an entry starts with
        ("0,7,1", 1),  # 7 does not exist: it and everything after it are hidden
        ("7,0", 0),  # an invalid first entry: none
        ("-1", 0),
        ("x,0", 0),
        ("0,0", 0),  # a repeated entry: CUDA refuses the list
        ("GPU-bbbb", 1),  # a unique UUID prefix names its GPU
        ("GPU-bbbb-1,GPU-cccc-3", 2),
        ("GPU-a", 0),  # two UUIDs start with it: ambiguous, invalid
        ("GPU-cccc-3,GPU-ffff", 1),  # an unknown UUID hides the rest
        ("GPU-cccc-3,3", 0),  # the same GPU by UUID and by index
        ("MIG-1234", 1),  # a MIG instance is a device of its own
    ],
)
def test_cuda_visible_devices_narrows_the_drivers_gpus(value: str | None, count: int) -> None:
    assert visible_count(FOUR, value) == count


def test_no_nvml_or_no_gpu_is_zero_gpus() -> None:
    assert gpus.read_nvml("libnvidia-ml-that-does-not-exist.so.1") is None
    assert visible_gpus(DriverGpus(()), {}) == 0
    assert visible_count(DriverGpus(()), "MIG-1234") == 0
    assert visible_gpus(FOUR, {"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert visible_gpus(FOUR, {}) == 4


FAKE_NVML = r"""
#include <stdio.h>
#include <stdlib.h>
int shutdowns = 0;
static int count(void) { return atoi(getenv("FAKE_NVML_COUNT")); }
int nvmlInit_v2(void) { return getenv("FAKE_NVML_FAIL") ? 9 : 0; }
int nvmlShutdown(void) { shutdowns++; return 0; }
int nvmlDeviceGetCount_v2(unsigned int *n) { *n = count(); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) { *h = (void *)(long)(i + 1); return 0; }
int nvmlDeviceGetUUID(void *h, char *uuid, unsigned int length) {
    snprintf(uuid, length, "GPU-fake-%ld", (long)h - 1);
    return 0;
}
"""


def test_nvml_is_read_through_ctypes_and_shut_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake libnvidia-ml built here: the calls, their arguments and the
    shutdown, as the real library takes them."""
    import ctypes
    import shutil
    import subprocess

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    source, library = tmp_path / "nvml.c", tmp_path / "libfake-nvml.so"
    source.write_text(FAKE_NVML)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    shutdowns = ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "shutdowns")
    monkeypatch.setenv("FAKE_NVML_COUNT", "3")
    driver = gpus.read_nvml(str(library))
    assert driver == DriverGpus(("GPU-fake-0", "GPU-fake-1", "GPU-fake-2"))
    assert shutdowns.value == 1
    assert visible_gpus(driver, {"CUDA_VISIBLE_DEVICES": "GPU-fake-2,GPU-fake-0"}) == 2
    monkeypatch.setenv("FAKE_NVML_FAIL", "1")
    assert gpus.read_nvml(str(library)) is None  # no driver loaded: no GPU
    assert shutdowns.value == 1  # nothing to shut down


def test_without_a_driver_this_machine_sees_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: None)
    assert visible_gpus(environ={"CUDA_VISIBLE_DEVICES": "0"}) == 0


def test_gpus_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, tensorserve.gpus as g; g.visible_gpus(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------- the front ends
@pytest.mark.parametrize(
    ("frontends", "device", "gpu_count", "count", "shown"),
    [
        (None, "auto", 0, 1, "default → 1 (no GPU visible)"),
        (None, "cuda", 0, 1, "default → 1 (no GPU visible)"),
        (None, "auto", 1, 3, "default → 3 (auto: 1 GPU, 4 CPUs)"),
        (None, "cuda", 4, 3, "default → 3 (auto: 4 GPUs, 4 CPUs)"),
        (None, "cpu", 4, 1, "default → 1 (device=cpu)"),
        ("auto", "cpu", 0, 3, "auto → 3 (4 CPUs)"),  # the user's auto wins, GPU or not
        (1, "auto", 4, 1, "1"),  # the user's number wins
        (5, "cpu", 0, 5, "5"),
    ],
)
def test_the_default_is_auto_where_the_server_feeds_a_gpu(
    frontends: int | str | None, device: str, gpu_count: int, count: int, shown: str
) -> None:
    choice = choose_frontends(frontends, device, gpus=gpu_count, cpus=4, torch_cuda=True)
    assert (choice.count, choice.shown) == (count, shown)


def test_on_two_cpus_the_gpu_default_is_still_one_front_end() -> None:
    choice = choose_frontends(None, "auto", gpus=1, cpus=2, torch_cuda=True)
    assert choice.count == 1  # auto's rule: CPUs less one


def test_a_gpu_that_a_cpu_only_torch_cannot_use_keeps_one_front_end() -> None:
    choice = choose_frontends(None, "auto", gpus=1, cpus=4, torch_cuda=False)
    assert (choice.count, choice.shown) == (1, "default → 1 (1 GPU visible, but torch has no CUDA)")
    # The user's auto still wins.
    assert choose_frontends("auto", "auto", gpus=1, cpus=4, torch_cuda=False).count == 3


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_this_cpu_only_torch_keeps_one_front_end_whatever_nvml_counts() -> None:
    assert not gpus.torch_has_cuda()
    choice = choose_frontends(None, "auto", gpus=2, cpus=4)  # as NVML might on a driver's host
    assert (choice.count, choice.shown) == (
        1,
        "default → 1 (2 GPUs visible, but torch has no CUDA)",
    )


@pytest.mark.parametrize(
    ("text", "cuda"),
    [
        ("from typing import Optional\ncuda: Optional[str] = None\nhip = None\n", False),
        ("from typing import Optional\ncuda: Optional[str] = '12.4'\n", True),
        ("cuda = '11.8'\n", True),
        ("__version__ = '2.5.1'\n", False),
    ],
)
def test_a_cuda_build_is_read_from_torch_version_py(text: str, cuda: bool) -> None:
    assert gpus._cuda_assigned(ast.parse(text)) is cuda


def test_a_cuda_build_is_read_without_importing_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tensorserve.gpus as g; c = g.torch_has_cuda(); "
        "print(c, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(torch.version.cuda is not None), "False"]


def _settings(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    cli.add_serve_parser(parser.add_subparsers(dest="command"))
    return cli.settings_from_args(parser.parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    ("argv", "env", "count"),
    [
        ([], {}, 7),  # nothing set: auto's count, a GPU being visible
        ([], {"TENSORSERVE_DEVICE": "cpu"}, 1),
        (["--device", "cpu"], {}, 1),
        ([], {"TENSORSERVE_FRONTENDS": "1"}, 1),
        (["--frontends", "2"], {}, 2),
        (["--frontends", "1"], {"TENSORSERVE_FRONTENDS": "auto"}, 1),  # the flag beats the env
        ([], {"TENSORSERVE_FRONTENDS": "auto", "TENSORSERVE_DEVICE": "cpu"}, 7),
    ],
)
def test_each_source_of_the_setting_wins_over_the_gpu_default(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], count: int
) -> None:
    monkeypatch.setattr(host, "visible_gpus", lambda: 2)
    monkeypatch.setattr(host, "torch_has_cuda", lambda: True)
    monkeypatch.setattr(host, "available_cpus", lambda: 8)
    for name in ("TENSORSERVE_FRONTENDS", "TENSORSERVE_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _settings(argv).frontends_choice().count == count


def test_the_worker_template_is_prestarted_only_for_one_front_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tensorserve.runtime import shared_workers

    started: list[str] = []
    monkeypatch.setattr(shared_workers, "prestart", started.append)
    monkeypatch.setattr(host, "available_cpus", lambda: 4)
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: DriverGpus(("GPU-x",)))  # one GPU
    monkeypatch.setattr(gpus, "torch_has_cuda", lambda: True)  # that torch can use
    monkeypatch.setattr(host, "torch_has_cuda", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for name in ("TENSORSERVE_FRONTENDS", "TENSORSERVE_DEVICE", "TENSORSERVE_ISOLATION"):
        monkeypatch.delenv(name, raising=False)
    cli._prestart_template(Settings())  # a GPU: 3 front ends, models in the scheduler process
    cli._prestart_template(Settings(frontends=1))  # a GPU: auto isolation is a thread
    assert started == []
    cli._prestart_template(Settings(frontends=1, isolation="process"))
    cli._prestart_template(Settings(device="cpu"))
    assert started == ["INFO", "INFO"]
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: None)  # no driver
    cli._prestart_template(Settings(frontends=1))  # no GPU: workers, as before
    cli._prestart_template(Settings(frontends=1, isolation="thread"))
    assert started == ["INFO", "INFO", "INFO"]
    # A GPU the driver has but a CPU-only torch cannot use: as without one.
    monkeypatch.setattr(gpus, "_driver_gpus", lambda: DriverGpus(("GPU-x",)))
    monkeypatch.setattr(gpus, "torch_has_cuda", lambda: False)
    monkeypatch.setattr(host, "torch_has_cuda", lambda: False)
    cli._prestart_template(Settings())
    assert started == ["INFO", "INFO", "INFO", "INFO"]


def test_a_real_start_on_the_cpu_is_one_process_and_says_why(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    log = tmp_path / "server.log"
    # CUDA_VISIBLE_DEVICES="": no GPU, even on a GPU machine.
    server = ServerProcess(
        tmp_path,
        "--log-format",
        "json",
        "--log-level",
        "INFO",
        env={"CUDA_VISIBLE_DEVICES": ""},
        log=log,
    )
    try:
        assert front_ends(server) == []
    finally:
        server.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    (startup,) = [line for line in lines if "starting:" in line["message"]]
    assert startup["settings"]["frontends"] == "default → 1 (no GPU visible)"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_nvml_counts_the_gpus_torch_sees_and_leaves_cuda_uninitialised() -> None:
    import subprocess
    import sys

    code = (
        "import torch, tensorserve.gpus as g; n = g.visible_gpus(); "
        "print(n, torch.cuda.is_initialized(), torch.cuda.device_count())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    count, initialised, torch_count = done.stdout.split()
    assert initialised == "False"  # NVML made no CUDA context (read before torch asked)
    assert int(count) == int(torch_count) > 0
    one = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
    assert one.stdout.split()[0] == "1"

"""The default thread count respects a container's CPU limit: cgroup v2
``cpu.max`` and v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``, read from fake
cgroup trees (``tensorserve.host`` takes its paths as parameters)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tensorserve.host import available_cpus, cpu_quota


def tree(tmp_path: Path, files: dict[str, str], proc: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc_cgroup = tmp_path / "proc_self_cgroup"
    proc_cgroup.write_text(proc)
    return root, proc_cgroup


def test_v2_quota_caps_the_cpus(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, {"cpu.max": "200000 100000\n"})
    assert cpu_quota(root, proc) == 2.0
    assert available_cpus(root, proc, cores=64) == 2


def test_v2_without_a_limit_uses_every_core(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, {"cpu.max": "max 100000\n"})
    assert cpu_quota(root, proc) is None
    assert available_cpus(root, proc, cores=64) == 64


def test_a_fractional_quota_rounds_up_and_never_exceeds_the_cores(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, {"cpu.max": "150000 100000"})
    assert cpu_quota(root, proc) == 1.5
    assert available_cpus(root, proc, cores=64) == 2
    assert available_cpus(root, proc, cores=1) == 1
    root2, proc2 = tree(tmp_path / "small", {"cpu.max": "10000 100000"})
    assert available_cpus(root2, proc2, cores=8) == 1  # 0.1 CPU still runs one thread


def test_v2_limit_on_a_parent_of_the_process_cgroup_binds_it(tmp_path: Path) -> None:
    # No cgroup namespace: the process sits in kubepods/pod1/ctr, the limit is on pod1.
    root, proc = tree(
        tmp_path,
        {
            "cpu.max": "max 100000",
            "kubepods/pod1/cpu.max": "400000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
        },
        proc="0::/kubepods/pod1/ctr\n",
    )
    assert available_cpus(root, proc, cores=64) == 4


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_v1_quota_caps_the_cpus(tmp_path: Path, mount: str) -> None:
    root, proc = tree(
        tmp_path,
        {f"{mount}/cpu.cfs_quota_us": "300000\n", f"{mount}/cpu.cfs_period_us": "100000\n"},
        proc="4:cpu,cpuacct:/\n1:name=systemd:/\n",
    )
    assert cpu_quota(root, proc) == 3.0
    assert available_cpus(root, proc, cores=64) == 3


def test_v1_minus_one_means_no_quota(tmp_path: Path) -> None:
    root, proc = tree(
        tmp_path, {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, proc="4:cpu:/\n"
    )
    assert cpu_quota(root, proc) is None
    assert available_cpus(root, proc, cores=12) == 12


def test_no_cgroup_files_at_all(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "absent", tmp_path / "absent-proc") is None
    assert available_cpus(tmp_path / "absent", tmp_path / "absent-proc", cores=5) == 5


def test_garbage_is_ignored(tmp_path: Path) -> None:
    root, proc = tree(tmp_path, {"cpu.max": "lots 0"})
    assert cpu_quota(root, proc) is None


def test_default_intra_op_threads_leaves_one_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorserve.runtime import device

    monkeypatch.setattr(device, "available_cpus", lambda: 2)
    assert device.default_intra_op_threads() == 1
    monkeypatch.setattr(device, "available_cpus", lambda: 1)
    assert device.default_intra_op_threads() == 1
    monkeypatch.setattr(device, "available_cpus", lambda: 8)
    assert device.default_intra_op_threads() == 7


def test_importing_reads_no_cgroup_file() -> None:
    # Nothing happens at import: the module is importable with every path patched away.
    code = (
        "import builtins, pathlib\n"
        "opened = []\n"
        "real = pathlib.Path.read_text\n"
        "pathlib.Path.read_text = lambda self, *a, **k: opened.append(str(self)) or real(self, *a, **k)\n"
        "import tensorserve.host\n"
        "assert not opened, opened\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

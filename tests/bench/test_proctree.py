"""CPU by role from /proc: a fake /proc tree (a server, two front ends, a
worker with a child of its own, strangers) read back by ``sample_tree``,
``split_cpu`` over two samples (births, exits and reused pids) and
``wait_for_frontends`` counting. One test reads the real /proc for a child
this test starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorserve_bench.proctree import (
    FRONTEND_MARK,
    FrontendsMissing,
    ProcessSample,
    parse_stat,
    sample_tree,
    split_cpu,
    wait_for_frontends,
)

TICKS = 100.0
SERVER = 100


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, started: int = 5) -> str:
    """A /proc/<pid>/stat line: 52 fields, with the ones read at their places."""
    fields = ["S", str(ppid)] + ["0"] * 8  # fields 3..12
    fields += ["0", str(utime), str(stime), "7", "9"]  # 13..17 (cutime/cstime are not ours)
    fields += ["0"] * 4 + [str(started)] + ["0"] * 30  # 18..52
    return f"{pid} ({comm}) " + " ".join(fields) + "\n"


def write_process(root: Path, pid: int, ppid: int, cmdline: list[str], ticks: int) -> None:
    folder = root / str(pid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(stat_line(pid, Path(cmdline[0]).name, ppid, ticks, ticks // 2))
    (folder / "cmdline").write_bytes(b"\0".join(a.encode() for a in cmdline) + b"\0")


def fake_proc(root: Path, scale: int = 1) -> Path:
    python = sys.executable
    write_process(root, 1, 0, ["/sbin/init"], 1000)
    write_process(root, SERVER, 1, [python, "-m", "tensorserve", "serve"], 200 * scale)
    for pid in (101, 102):
        write_process(root, pid, SERVER, [python, "-m", FRONTEND_MARK, "--index", "0"], 40 * scale)
    write_process(root, 103, SERVER, [python, "-c", "from multiprocessing.spawn import x"], 20)
    write_process(root, 104, 103, ["/bin/helper"], 10 * scale)  # a grandchild
    write_process(root, 200, 1, [python, "-m", FRONTEND_MARK], 5000)  # another server's
    (root / "self").mkdir()  # not a pid
    (root / "300").mkdir()  # gone between listing and reading: no stat
    return root


def test_parse_stat_reads_past_a_command_name_with_spaces_and_parentheses() -> None:
    line = stat_line(42, "a) (b c)", ppid=7, utime=150, stime=50, started=1234)
    assert parse_stat(line, TICKS) == (7, 1234, 2.0)


def test_sample_tree_finds_the_descendants_and_their_commands(tmp_path: Path) -> None:
    samples = sample_tree(SERVER, root=fake_proc(tmp_path), ticks_per_s=TICKS)
    assert sorted(samples) == [SERVER, 101, 102, 103, 104]  # not init, not another tree
    assert samples[104].ppid == 103
    assert samples[SERVER].cpu_s == pytest.approx((200 + 100) / TICKS)
    assert [pid for pid, s in samples.items() if s.is_frontend] == [101, 102]
    assert samples[101].command.endswith(f"-m {FRONTEND_MARK} --index 0")


def test_sample_tree_of_a_gone_process_is_empty(tmp_path: Path) -> None:
    assert sample_tree(999, root=fake_proc(tmp_path), ticks_per_s=TICKS) == {}


def test_split_cpu_gives_each_role_what_it_spent_in_the_window(tmp_path: Path) -> None:
    before = sample_tree(SERVER, root=fake_proc(tmp_path / "a"), ticks_per_s=TICKS)
    after = sample_tree(SERVER, root=fake_proc(tmp_path / "b", scale=3), ticks_per_s=TICKS)
    split = split_cpu(before, after, SERVER)
    # Each count of ticks x (1 + 1/2) / 100 s, tripled: twice it in the window.
    assert split.scheduler_s == pytest.approx(2 * 300 / TICKS)
    assert split.frontend_s == pytest.approx(2 * 2 * 60 / TICKS)
    assert split.workers_s == pytest.approx(2 * 15 / TICKS)  # 103 spent nothing, 104 did
    assert (split.frontends, split.workers, split.exited) == (2, 2, 0)
    assert split.total_s == pytest.approx(split.scheduler_s + split.frontend_s + split.workers_s)


def sample(pid: int, cpu_s: float, *, started: int = 1, command: str = "python") -> ProcessSample:
    return ProcessSample(pid, SERVER, started, cpu_s, command)


def test_split_cpu_counts_births_from_zero_and_names_exits() -> None:
    frontend = f"python -m {FRONTEND_MARK}"
    before = {
        SERVER: sample(SERVER, 10.0),
        101: sample(101, 4.0, command=frontend),  # dies in the window
        102: sample(102, 4.0, started=1, command=frontend),  # its pid is reused
    }
    after = {
        SERVER: sample(SERVER, 11.0),
        102: sample(102, 0.25, started=9, command=frontend),  # a new front end: from zero
        105: sample(105, 0.5, command=frontend),  # a restarted front end
    }
    split = split_cpu(before, after, SERVER)
    assert split.scheduler_s == pytest.approx(1.0)
    assert split.frontend_s == pytest.approx(0.75)
    assert (split.frontends, split.workers, split.exited) == (2, 0, 2)


def test_as_row_divides_each_role_by_the_requests() -> None:
    split = split_cpu({SERVER: sample(SERVER, 1.0)}, {SERVER: sample(SERVER, 1.5)}, SERVER)
    row = split.as_row(requests=10_000)
    assert row["scheduler_cpu_us_per_request"] == pytest.approx(50.0)
    assert row["total_cpu_us_per_request"] == pytest.approx(50.0)
    assert row["frontend_cpu_s"] == 0.0 and row["frontend_processes"] == 0
    assert split.as_row(requests=0)["total_cpu_us_per_request"] is None


def test_wait_for_frontends_returns_at_the_count_and_says_what_it_saw_else(
    tmp_path: Path,
) -> None:
    root = fake_proc(tmp_path)
    wait_for_frontends(SERVER, 2, root=root, timeout_s=0)  # two are running: at once
    with pytest.raises(FrontendsMissing, match=f"2 front-end processes of 4 .*{FRONTEND_MARK}"):
        wait_for_frontends(SERVER, 4, root=root, timeout_s=0.2, poll_s=0.05)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_sample_tree_reads_this_process_and_a_child_from_the_real_proc() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.stdin.read()  # {FRONTEND_MARK}"],
        stdin=subprocess.PIPE,
    )
    try:
        samples = sample_tree(os.getpid())
        assert samples[os.getpid()].cpu_s > 0  # this test has run Python for a while
        assert samples[child.pid].ppid == os.getpid()
        assert samples[child.pid].is_frontend
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)

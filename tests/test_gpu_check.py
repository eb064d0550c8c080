"""benchmarks/gpu_check.py --device cpu: the GPU node check runs end to end
on a CPU (every check that needs no CUDA), so it is known to work before it
meets a GPU. One real run, its JSON read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check_support import Check, ModelInfo, override_config, pad, tolerance

TOP_LEVEL = {"device", "driver", "cuda", "torch", "commit", "date", "checks", "skipped", "load"}
LOAD_FIELDS = {"model", "batch_size", "concurrency", "items_per_s", "p50_ms", "p99_ms", "gpu_util",
               "server_cpu_us_per_request"}
CUDA_ONLY = {"syncs_in_forward", "copies_per_batch", "event_waits_block", "batch_time_from_events"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_on_cpu_passes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check_cpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "clients" / "python"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(CHECK), "--device", "cpu", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
                         check=False)
    assert out.is_file(), f"no JSON written (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    result = json.loads(out.read_text())

    assert TOP_LEVEL <= set(result), set(result) ^ TOP_LEVEL
    assert result["partial"] is False
    assert result["device"].startswith("cpu") and result["driver"] is None
    assert result["torch"] and result["commit"] and result["date"]
    checks = result["checks"]
    for check in checks:
        assert set(check) >= {"name", "model", "isolation", "passed", "detail"}, check
        assert check["passed"] in (True, False), check
    failed = [c for c in checks if not c["passed"]]
    assert not failed, f"failed checks: {failed}\n{run.stdout}"
    assert run.returncode == 0, run.stderr

    names = {(c["name"], c["isolation"]) for c in checks}
    for isolation in ("thread", "process"):
        assert {("correctness", isolation), ("output_parameters", isolation),
                ("bad_input", isolation), ("many_callers", isolation),
                ("text_rows", isolation)} <= names, names
    # Every check counted what it compared, and compared something.
    assert all(c["compared"] for c in checks if c["name"] != "load"), checks
    # Every bundled model and the bench's encoder is checked in both isolations: the
    # text models (strings in) each caller's rows against tokenizing on the CPU.
    text = {"tokenizer", "text_tagger", "text_embedder", "text_bert_encoder"}
    bundled = {p.parent.name for p in (ROOT / "model_repository").glob("*/config.toml")}
    for isolation in ("thread", "process"):
        checked = {c["model"] for c in checks if c["name"] == "correctness"
                   and c["isolation"] == isolation}
        assert (bundled - text) | {"bert_encoder"} <= checked, (isolation, bundled - checked)
        rows = {c["model"] for c in checks if c["name"] == "text_rows" and c["isolation"] == isolation}
        assert rows == text, rows
        callers = {c["model"]: c["compared"] for c in checks if c["name"] == "many_callers"
                   and c["isolation"] == isolation}
        assert callers == {"tagger": 64, "embedder": 64, "bert_encoder": 64}, callers
    # No export failed; the ones left out by rule say why.
    assert not [c for c in checks if c["name"] == "export"]
    assert {s["model"] for s in result["skipped"] if "request parameters" in s["reason"]} == {
        "embedder_pt", "embedder_pt2"}
    # An exported .pt / .pt2 of some bundled model is served too (made by this torch).
    assert any(c["model"].endswith(("_pt", "_pt2")) for c in checks if c["name"] == "correctness")
    # Without CUDA the CUDA-only checks are listed as skipped, never as passed.
    assert CUDA_ONLY == {s["name"] for s in result["skipped"] if s["reason"] == "skipped: needs CUDA"}
    assert not CUDA_ONLY & {c["name"] for c in checks}

    assert {p["model"] for p in result["load"]} == {"tagger", "embedder"}
    for point in result["load"]:
        assert LOAD_FIELDS <= set(point), point
        assert point["items_per_s"] > 0 and point["p99_ms"] >= point["p50_ms"] > 0, point
        assert point["gpu_util"] is None and point["server_cpu_us_per_request"] > 0, point
    assert "skipped: needs CUDA" in run.stdout  # the table shows them


@pytest.mark.timeout(120)
def test_a_run_stopped_by_its_time_limit_leaves_the_phases_it_finished(tmp_path: Path) -> None:
    """A GPU lease or a `timeout` that ends the run early: the JSON holds
    every phase done so far, marked partial, instead of nothing at all."""
    out = tmp_path / "gpu_check_cpu.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "clients" / "python"), os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen([sys.executable, str(CHECK), "--device", "cpu", "--no-load",
                           "--out", str(out)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as run:
        try:
            assert run.stderr is not None
            for line in run.stderr:  # the first phase's line comes after its JSON is written
                if line.startswith("[gpu_check] export:"):
                    break
            else:
                pytest.fail("gpu_check ended before its first phase")
        finally:
            run.kill()
    result = json.loads(out.read_text())
    assert result["partial"] is True and "export" in result["phases_s"]
    assert TOP_LEVEL <= set(result)
    assert not list(tmp_path.glob("*.tmp"))


def test_a_check_that_compared_nothing_fails() -> None:
    assert Check("x", "m", "thread", True, "fine", compared=3).passed
    nothing = Check("x", "m", "thread", True, "fine", compared=0)
    assert not nothing.passed and nothing.detail.startswith("0 comparisons")


def test_the_float32_tolerance_catches_a_bfloat16_or_tf32_drift() -> None:
    import torch

    tagger = ModelInfo("tagger", {}, ROOT, "tagger")
    encoder = ModelInfo("bert_encoder", {"parameters": {"cuda_dtype": "float16"}}, ROOT, "bert_encoder")
    assert encoder.compute_dtype("cuda:0") == "float16" and encoder.compute_dtype("cpu") == "float32"
    exact = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    bf16 = exact.to(torch.bfloat16).float()
    # TF32 keeps 10 mantissa bits of each operand: a dot product over 128 terms.
    a, b = torch.randn(64, 128), torch.randn(128, 64)
    tf32 = (a.view(torch.int32) & ~0x1FFF).view(torch.float32) @ (
        b.view(torch.int32) & ~0x1FFF).view(torch.float32)
    scale = float(exact.abs().max())
    assert float((bf16 - exact).abs().max()) > tolerance(tagger, "cuda:0", scale)
    assert float((tf32 - a @ b).abs().max()) > tolerance(tagger, "cuda:0", float((a @ b).abs().max()))
    # float16's bound is wider: rounding to float16 alone stays inside it.
    half = exact.half().float()
    assert float((half - exact).abs().max()) <= tolerance(encoder, "cuda:0", scale)


def test_override_config_sets_top_level_fields_and_drops_keys_in_tables() -> None:
    text = (
        '# a comment\nmax_batch_size = 32\ndevice = "auto"\n\n'
        "[dynamic_batching]\nmax_queue_delay_ms = 5.0\nmax_batch_tokens = 1024\n\n"
        '[[input]]\nname = "x"\n'
    )
    out = override_config(text, {"device": "cuda:0", "max_batch_size": 64, "isolation": "thread"},
                          drop=["max_batch_tokens"])
    assert out.splitlines()[:4] == ['isolation = "thread"', "# a comment", "max_batch_size = 64",
                                    'device = "cuda:0"']
    assert "max_batch_tokens" not in out
    assert "[dynamic_batching]\nmax_queue_delay_ms = 5.0" in out  # the tables stay where they were
    assert out.count("max_batch_size") == 1


def test_pad_right_pads_every_axis_with_the_pad_value() -> None:
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((3, 1), dtype=np.float32)
    out = pad([a, b], -1.0)
    assert out.shape == (2, 3, 3)
    assert (out[0, :2] == a).all() and (out[0, 2] == -1).all()
    assert (out[1, :, :1] == 1).all() and (out[1, :, 1:] == -1).all()

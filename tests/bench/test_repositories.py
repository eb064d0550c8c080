"""The benchmarks' repositories and results files: toy models that load,
cached copies made again only when their source changes, JSON that strict
readers accept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorserve_bench.repositories import (
    TUNED_KEYS,
    cached_copy,
    write_flat_model,
    write_xy_model,
    write_zeros_model,
)
from tensorserve_bench.results import save, write_json

from tensorserve.repository.config import load_config
from tests.conftest import REPOSITORY


def test_toy_models_have_valid_configs(tmp_path: Path) -> None:
    xy = load_config(write_xy_model(tmp_path, "xy", "", "max_batch_size = 4\n") / "config.toml")
    assert [i.name for i in xy.input] == ["x"] and not xy.warmup.enabled
    flat = load_config(write_flat_model(tmp_path, flat_ms=2.0) / "config.toml")
    assert flat.parameters == {"flat_ms": 2.0} and flat.max_batch_size == 64
    on_gpu = write_flat_model(tmp_path / "gpu", device="cuda")
    assert load_config(on_gpu / "config.toml").device == "cuda" and flat.device == "cpu"
    assert "torch.cuda._sleep" in (on_gpu / "1" / "model.py").read_text()
    zeros = load_config(write_zeros_model(tmp_path, max_batch_size=8) / "config.toml")
    assert [o.name for o in zeros.output] == ["logits"] and zeros.max_batch_size == 8


def test_a_cached_copy_is_made_again_only_when_its_source_changes(tmp_path: Path) -> None:
    source = tmp_path / "source" / "m"
    source.mkdir(parents=True)
    (source / "1").mkdir()
    (source / "1" / "model.py").write_text("# model\n")
    (source / "config.toml").write_text('max_batch_size = 8\nisolation = "process"\n')
    builds: list[Path] = []

    def build(src: Path, dest: Path) -> None:
        builds.append(src)
        dest.mkdir(parents=True)
        (dest / "config.toml").write_text((src / "config.toml").read_text())

    dest = tmp_path / "cache" / "m"
    assert cached_copy(source, dest, build, key="v1", without=TUNED_KEYS) == dest
    assert (dest / "config.toml").read_text() == "max_batch_size = 8\n"  # untuned
    cached_copy(source, dest, build, key="v1", without=TUNED_KEYS)
    assert len(builds) == 1  # nothing changed: the copy is reused
    cached_copy(source, dest, build, key="v2", without=TUNED_KEYS)
    (source / "config.toml").write_text("max_batch_size = 16\n")
    cached_copy(source, dest, build, key="v2", without=TUNED_KEYS)
    assert len(builds) == 3
    assert (dest / "config.toml").read_text() == "max_batch_size = 16\n"


def test_a_plain_cached_copy_of_the_bundled_tagger_leaves_the_defaults_to_decide(
    tmp_path: Path,
) -> None:
    dest = cached_copy(REPOSITORY / "tagger", tmp_path / "tagger", without=TUNED_KEYS)
    assert (dest / "1" / "model.safetensors").read_bytes() == (
        REPOSITORY / "tagger" / "1" / "model.safetensors"
    ).read_bytes()
    shipped = load_config(REPOSITORY / "tagger" / "config.toml")
    untuned = load_config(dest / "config.toml")
    # The tuned keys are gone from the copy (the tagger ships isolation = "auto"
    # now, so its max_batch_tokens is the one it sets that the copy leaves out).
    assert "max_batch_tokens" in (REPOSITORY / "tagger" / "config.toml").read_text()
    assert not any(
        line.split("=")[0].strip() in TUNED_KEYS
        for line in (dest / "config.toml").read_text().splitlines()
    )
    assert untuned.isolation == "auto" and untuned.max_batch_size == shipped.max_batch_size


def test_results_are_dated_and_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save(tmp_path / "deep" / "r.json", {"p99_ms": float("nan"), "rows": (1, 2)})
    saved = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert saved["p99_ms"] is None and saved["rows"] == [1, 2]
    assert len(saved["date"]) == 10 and "cores" in saved["machine"]
    assert f"saved {path}" in capsys.readouterr().out
    assert json.loads(write_json(tmp_path / "p.json", {"at": tmp_path}).read_text()) == {
        "at": str(tmp_path)
    }


def test_medians_by_groups_repeats_in_first_seen_order_and_skips_missing_values() -> None:
    from tensorserve_bench.summaries import medians_by

    rows = [
        {"case": "b", "c": 1, "x": 3.0, "y": None},
        {"case": "a", "c": 1, "x": 1.0},
        {"case": "b", "c": 1, "x": 5.0, "y": 2.0},
        {"case": "b", "c": 1, "x": 4.0, "y": 4.0},
    ]
    assert medians_by(rows, ("case", "c"), ("x", "y")) == [
        {"case": "b", "c": 1, "repeats": 3, "x": 4.0, "y": 3.0},
        {"case": "a", "c": 1, "repeats": 1, "x": 1.0, "y": None},
    ]

"""``tensorserve bench`` end to end: in-process on the bundled tagger, and over
HTTP against the real server process."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from tensorserve_bench.cli import parse_assignments
from tensorserve_bench.plots import matplotlib_available

from tensorserve.cli import main
from tests.conftest import REPOSITORY, ROOT

FILE_LENGTHS = [9, 40, 77, 128]


def check_point(point: dict[str, Any]) -> None:
    assert point["items"] > 0 and point["errors"] == 0
    assert point["items_per_s"] > 0 and point["batches"] > 0
    latency = point["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert point["avg_batch_size"] >= 1
    assert 0 < point["padding_efficiency"] <= 1
    # The model's own time per batch: real, and within a request's latency.
    assert 0 < point["avg_batch_ms"] < latency["max"]
    histogram = point["batch_size_histogram"]
    assert histogram and sum(histogram.values()) == point["batches"]


@pytest.fixture(scope="module")
def in_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """One ~1 s in-process run of the tagger at concurrency 4, lengths from a file."""
    folder = tmp_path_factory.mktemp("bench")
    lengths = folder / "lengths.txt"
    lengths.write_text("\n".join(map(str, FILE_LENGTHS)) + "\n")
    output = folder / "tagger.json"
    code = main([
        "bench", "tagger", "--in-process", "--model-repository", str(REPOSITORY),
        "--concurrency", "4", "--duration", "1", "--warmup", "0.2", "--pool", "64",
        "--lengths", str(lengths), "--no-progress", "--output", str(output),
    ])  # fmt: skip
    return code, output


def test_in_process_run_writes_a_sane_result(in_process_run: tuple[int, Path]) -> None:
    code, output = in_process_run
    assert code == 0
    result = json.loads(output.read_text())
    assert result["schema"] == 1 and result["machine"]["cpu_count"] >= 1
    assert result["targets"][0]["kind"] == "in-process"
    (point,) = result["points"]
    assert point["mode"] == "closed" and point["concurrency"] == 4 and point["variant"] == "default"
    check_point(point)
    assert point["padding_efficiency_exact"]


def test_lengths_file_is_honoured(in_process_run: tuple[int, Path]) -> None:
    _, output = in_process_run
    lengths = json.loads(output.read_text())["lengths"]
    assert (lengths["min"], lengths["max"]) == (min(FILE_LENGTHS), max(FILE_LENGTHS))
    assert "lengths.txt" in lengths["distribution"]


@pytest.mark.skipif(
    not matplotlib_available(), reason="matplotlib (the bench extra) is not installed"
)
def test_plots_are_written_beside_the_json(in_process_run: tuple[int, Path]) -> None:
    _, output = in_process_run
    for suffix in ("throughput", "latency", "padding", "batch_sizes"):
        png = output.with_name(f"tagger_{suffix}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_http_run_against_the_real_server(
    server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "http.json"
    code = main([
        "bench", "tagger", "--url", server_url, "--concurrency", "2", "--duration", "1",
        "--warmup", "0.2", "--pool", "32", "--no-progress", "--no-plots", "--output", str(output),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    described = result["targets"][0]
    assert (described["kind"], described["url"], described["model"]) == (
        "http",
        server_url,
        "tagger",
    )
    assert described["config"]["max_batch_size"] == 32  # model_repository/tagger/config.toml
    check_point(result["points"][0])
    assert 0 < result["points"][0]["client_cpu_s"] < 10
    table = capsys.readouterr().out
    assert re.search(r"^default\s+c=2\s+\d", table, re.MULTILINE)


def check_counters_add_up(point: dict[str, Any]) -> None:
    """Every item the client got back went through the model in the window,
    and nothing else did (both phases drain before the counters are read)."""
    assert point["items"] > 0 and point["errors"] == 0, point["error_samples"]
    assert round(point["avg_batch_size"] * point["batches"]) == point["items"]
    assert sum(point["batch_size_histogram"].values()) == point["batches"]


def test_kserve_json_run_against_the_real_server(server_url: str, tmp_path: Path) -> None:
    output = tmp_path / "json.json"
    code = main([
        "bench", "tagger", "--url", server_url, "--protocol", "json", "--concurrency", "2",
        "--duration", "0.5", "--warmup", "0.1", "--pool", "16", "--no-progress", "--no-plots",
        "--output", str(output),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    assert result["targets"][0]["protocol"] == "json"
    check_counters_add_up(result["points"][0])


def test_kserve_binary_run_with_a_server_it_starts(echo_repository: Path, tmp_path: Path) -> None:
    output = tmp_path / "binary.json"
    code = main([
        "bench", "echo", "--serve", "--model-repository", str(echo_repository),
        "--protocol", "binary", "--items-per-request", "2", "--lengths", "16",
        "--concurrency", "3", "--duration", "0.5", "--warmup", "0.1", "--pool", "16",
        "--no-progress", "--no-plots", "--output", str(output),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    (described,) = result["targets"]
    assert (described["kind"], described["protocol"]) == ("http (--serve)", "binary")
    (point,) = result["points"]
    check_counters_add_up(point)
    assert point["items"] == 2 * point["requests"]  # two rows of one shape per request


def test_unreachable_server_is_an_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["bench", "tagger", "--url", "http://127.0.0.1:9", "--duration", "0.1", "--no-progress"]
    )
    assert code == 1
    assert "tensorserve bench: error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "policy=fifo"], "--in-process or --serve"),
        (["--mode", "open"], "--rate"),
        (["--lengths", "0:9"], "low <= high"),
        (["--in-process", "--protocol", "json"], "not with --in-process"),
    ],
)
def test_usage_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tagger", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_assignments_are_typed() -> None:
    assert parse_assignments("max_batch_size=32,max-queue-delay-ms=2.5,policy=fifo") == {
        "max_batch_size": 32,
        "max_queue_delay_ms": 2.5,
        "policy": "fifo",
    }


def test_commands_in_the_docs_parse() -> None:
    """Every ``tensorserve bench`` command in docs/bench.md is accepted by the parser."""
    import argparse
    import shlex

    from tensorserve_bench.cli import add_parser

    parser = argparse.ArgumentParser(prog="tensorserve", exit_on_error=False)
    add_parser(parser.add_subparsers(dest="command"))
    text = (ROOT / "docs" / "bench.md").read_text().replace("\\\n", " ")
    commands = [
        line.strip() for line in text.splitlines() if line.strip().startswith("tensorserve bench ")
    ]
    assert len(commands) >= 5
    for command in commands:
        parser.parse_args(shlex.split(command, comments=True)[1:])


def test_serve_starts_a_server_per_variant_with_its_flags(
    echo_repository: Path, tmp_path: Path
) -> None:
    output = tmp_path / "serve.json"
    code = main([
        "bench", "echo", "--serve", "--model-repository", str(echo_repository),
        "--variant", "pairs:max_batch_size=2", "--concurrency", "4", "--duration", "0.5",
        "--warmup", "0", "--pool", "16", "--no-progress", "--no-plots", "--output", str(output),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(output.read_text())
    (described,) = result["targets"]
    assert described["kind"] == "http (--serve)" and described["config"]["max_batch_size"] == 2
    assert "--max-batch-size" in described["server_command"]
    (point,) = result["points"]
    assert point["items"] > 0 and point["errors"] == 0
    assert max(int(bound) for bound in point["batch_size_histogram"]) <= 2
    # The server it started is measured too: its process tree's CPU over the window.
    assert point["server_cpu_s"] > 0

"""The command line: ``serve``'s flags come from ``Settings``, and asking for
help costs no torch."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tensorserve_bench.server import override_flags

from tensorserve.cli import add_serve_parser, main, settings_from_args
from tensorserve.repository.config import DynamicBatching, ModelConfig
from tensorserve.settings import BOUNDS, MAX_TIMEOUT_MS, MODEL_OVERRIDES, Settings
from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The flags the docs and the tests use: generated, they must keep these names.
DOCUMENTED_FLAGS = {
    "--model-repository", "--host", "--port", "--log-level", "--access-log",
    "--max-request-bytes", "--max-items-per-request", "--intra-op-threads",
    "--switch-interval-ms", "--max-batch-size", "--max-queue-delay-ms", "--device",
    "--dispatch", "--policy", "--instance-count", "--max-batch-tokens", "--isolation",
}  # fmt: skip


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorserve")
    return add_serve_parser(parser.add_subparsers(dest="command"))


def test_every_setting_has_a_flag_with_its_description_default_and_environment_variable() -> None:
    parser = serve_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == set(Settings.model_fields)
    for name, field in Settings.model_fields.items():
        action = actions[name]
        assert action.option_strings[0] == "--" + name.replace("_", "-")
        assert action.default is None  # "not given": the environment decides
        assert field.description and field.description in action.help
        assert f"env TENSORSERVE_{name.upper()})" in action.help
        if name in MODEL_OVERRIDES:
            assert "default: the model's own" in action.help
        elif field.default is not None and not isinstance(field.default, bool):
            assert f"default: {field.default};" in action.help
    flags = {a.option_strings[0] for a in actions.values()}
    assert DOCUMENTED_FLAGS <= flags


def test_the_overrides_have_their_own_group() -> None:
    group = next(
        g for g in serve_parser()._action_groups if g.title and "overrides" in g.title
    )
    assert {a.dest for a in group._group_actions} == set(MODEL_OVERRIDES)


def test_flags_parse_to_the_settings_types_and_choices() -> None:
    args = serve_parser().parse_args([
        "--port", "9001", "--switch-interval-ms", "0.5", "--access-log",
        "--model-repository", "/models", "--isolation", "process", "--max-batch-tokens", "512",
        "--max-queue-delay-ms", "2.5", "--device", "cpu",
    ])  # fmt: skip
    assert isinstance(args.port, int) and isinstance(args.switch_interval_ms, float)
    assert isinstance(args.model_repository, Path) and isinstance(args.max_queue_delay_ms, float)
    settings = settings_from_args(args)
    assert settings.port == 9001 and settings.switch_interval_ms == 0.5
    assert settings.access_log is True
    assert settings.model_repository == Path("/models")
    assert settings.model_overrides() == {
        "isolation": "process", "max_batch_tokens": 512, "max_queue_delay_ms": 2.5
    }  # fmt: skip
    assert settings.device == "cpu"  # the server's default, not an override
    actions = {a.dest: a for a in serve_parser()._actions}
    assert actions["policy"].choices == ["fifo", "length_aware"]  # Literal | None: choices
    assert actions["device"].choices == ["auto", "cpu", "cuda"]
    assert actions["log_level"].choices == ["DEBUG", "INFO", "WARNING", "ERROR"]
    for bad in (["--policy", "lifo"], ["--port", "eighty"], ["--log-level", "LOUD"]):
        with pytest.raises(SystemExit):
            serve_parser().parse_args(bad)


def test_flags_beat_the_environment_which_beats_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings_from_args(serve_parser().parse_args([])).port == 8000
    monkeypatch.setenv("TENSORSERVE_PORT", "8123")
    monkeypatch.setenv("TENSORSERVE_ACCESS_LOG", "true")
    monkeypatch.setenv("TENSORSERVE_POLICY", "fifo")
    from_env = settings_from_args(serve_parser().parse_args([]))
    assert (from_env.port, from_env.access_log, from_env.policy) == (8123, True, "fifo")
    from_flags = settings_from_args(
        serve_parser().parse_args(["--port", "9", "--no-access-log", "--policy", "length_aware"])
    )
    assert (from_flags.port, from_flags.access_log, from_flags.policy) == (9, False, "length_aware")


def test_an_out_of_bounds_setting_is_a_usage_error_naming_flag_and_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "99999"])
    assert exit_info.value.code == 2
    assert "--port / TENSORSERVE_PORT" in capsys.readouterr().err


NO_HEAVY_IMPORTS = (
    "\nimport sys\nprint(sorted(m for m in ('torch', 'numpy', 'aiohttp') if m in sys.modules))"
)


@pytest.mark.parametrize(
    "code",
    [
        "import tensorserve",
        "import tensorserve.cli",
        "from tensorserve import InvalidInput, ModelFailure",
        "from tensorserve.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['bench', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass",
    ],
)
def test_help_and_the_error_types_do_not_import_torch(code: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", code + NO_HEAVY_IMPORTS],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["bench", "--help"]])
def test_the_real_help_command_does_not_import_torch(argv: list[str]) -> None:
    """``python -X importtime -m tensorserve ... --help``: the module list of
    the real command, entry point included."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tensorserve", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage: tensorserve" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "tensorserve.cli" in imported
    assert not {"torch", "numpy", "aiohttp"} & imported


# ------------------------------------------------------------------ one bounds table
def field_bounds(field: Any) -> dict[str, float]:
    """The numeric bounds pydantic enforces on a field (ge, gt, le, lt)."""
    return {
        name: getattr(rule, name)
        for rule in field.metadata
        for name in ("ge", "gt", "le", "lt")
        if getattr(rule, name, None) is not None
    }


def config_field(name: str) -> Any:
    for schema in (ModelConfig, DynamicBatching):
        if name in schema.model_fields:
            return schema.model_fields[name]
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_a_setting_and_its_config_toml_field_have_the_bounds_of_one_table(name: str) -> None:
    assert field_bounds(Settings.model_fields[name]) == BOUNDS[name]
    assert field_bounds(config_field(name)) == BOUNDS[name]


def test_every_numeric_model_override_is_in_the_bounds_table() -> None:
    numeric = [n for n in MODEL_OVERRIDES if field_bounds(config_field(n)) and n != "max_batch_tokens"]
    assert numeric and set(numeric) <= set(BOUNDS)


SERVE = [sys.executable, "-m", "tensorserve", "serve"]


@pytest.mark.parametrize(
    "flag, value, env",
    [
        ("--instance-count", "99", {}),
        ("--instance-count", "0", {}),
        ("--max-queue-delay-ms", "60001", {}),
        ("--default-timeout-ms", str(MAX_TIMEOUT_MS * 2), {}),
        ("--device", "tpu", {}),
        (None, None, {"TENSORSERVE_INSTANCE_COUNT": "99"}),
        (None, None, {"TENSORSERVE_MAX_QUEUE_DELAY_MS": "60001"}),
        (None, None, {"TENSORSERVE_DEFAULT_TIMEOUT_MS": str(MAX_TIMEOUT_MS * 2)}),
    ],
)
def test_a_bound_of_config_toml_is_a_usage_error_for_its_flag_and_variable(
    flag: str | None, value: str | None, env: dict[str, str], tmp_path: Path
) -> None:
    # The real command: one line on stderr, exit status 2, before any model is
    # loaded (an empty folder as the repository: it never gets that far).
    argv = [*SERVE, "--model-repository", str(tmp_path)] + ([flag, value] if flag and value else [])
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSERVE_")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={**environ, **env}, check=False)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorserve serve: error: "), out.stderr
    name = (flag or "--" + next(iter(env)).removeprefix("TENSORSERVE_").lower().replace("_", "-"))
    assert name in lines[0]


def test_the_bench_starts_a_server_with_flags_serve_accepts() -> None:
    # Booleans become switches (argparse refuses "--access-log true").
    overrides = {"access_log": True, "log_probes": False, "max_batch_size": 8, "device": None}
    flags = override_flags(overrides)
    assert flags == ["--access-log", "--no-log-probes", "--max-batch-size", "8"]
    args = serve_parser().parse_args(flags)
    settings = settings_from_args(args)
    assert (settings.access_log, settings.log_probes, settings.max_batch_size) == (True, False, 8)


# ------------------------------------------------------------------ commands of other packages
def add_hello_parser(sub: Any) -> argparse.ArgumentParser:
    """A command another distribution could bring (the entry point's value below)."""
    parser = sub.add_parser("hello", help="say hello")
    parser.add_argument("name")
    parser.set_defaults(run=lambda args: print(f"hello {args.name}") or 0)
    return parser


def with_entry_points(monkeypatch: pytest.MonkeyPatch, *values: tuple[str, str]) -> None:
    """``tensorserve.commands`` holds exactly these (name, value) entry points."""
    from importlib import metadata

    import tensorserve.cli

    found = [metadata.EntryPoint(name, value, "tensorserve.commands") for name, value in values]
    monkeypatch.setattr(tensorserve.cli.metadata, "entry_points",
                        lambda group: found if group == "tensorserve.commands" else [])


def test_a_command_of_another_package_is_found_through_its_entry_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with_entry_points(monkeypatch, ("hello", "tests.test_cli:add_hello_parser"))
    assert main(["hello", "you"]) == 0
    assert capsys.readouterr().out == "hello you\n"


def test_without_tensorserve_bench_the_bench_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with_entry_points(monkeypatch)
    assert main(["bench", "tagger", "--serve", "--help"]) == 2
    assert capsys.readouterr().err == (
        "tensorserve bench needs the tensorserve-bench package; from the repository's root: "
        "pip install -e bench\n"
    )
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "bench" in capsys.readouterr().out  # still listed, saying it is not installed


def test_a_broken_bench_install_does_not_stop_serve_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with_entry_points(monkeypatch, ("bench", "tensorserve_bench_missing.cli:add_parser"))
    assert main(["bench", "tagger"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tensorserve bench could not be loaded (No module named "
                            "'tensorserve_bench_missing'); from the repository's root: "
                            "pip install --force-reinstall -e bench")
    assert isinstance(serve_parser().parse_args(["--port", "8080"]), argparse.Namespace)


def test_the_installed_bench_is_the_bench_command() -> None:
    out = subprocess.run([sys.executable, "-m", "tensorserve", "bench", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "usage: tensorserve bench" in out.stdout and "--concurrency" in out.stdout


def test_version_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == "tensorserve 0.1.0\n"
    import tensorserve

    assert tensorserve.__version__ == "0.1.0"


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["top", "--help"],
                                  ["bench", "--help"]])
def test_help_is_written_for_users(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """No reStructuredText markup and no notes about the code's imports."""
    with pytest.raises(SystemExit):
        main(argv)
    text = capsys.readouterr().out
    assert text.startswith(f"usage: tensorserve {argv[0] if len(argv) > 1 else ''}".rstrip())
    assert "``" not in text
    assert "imported" not in text and "module level" not in text


# --------------------------------------------------------------- hints
PYPROJECTS = {".": ROOT / "pyproject.toml", "bench": ROOT / "bench" / "pyproject.toml"}
# Packages a hint may name from an index: what our pyprojects depend on, and
# onnxruntime's CUDA build (which cannot be a dependency beside onnxruntime).
EXTRA_PACKAGES = {"onnxruntime-gpu"}


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    """(every package a pyproject of ours names, {folder: its extras})."""
    names: set[str] = set(EXTRA_PACKAGES)
    extras: dict[str, set[str]] = {}
    for folder, path in PYPROJECTS.items():
        project = tomllib.loads(path.read_text())["project"]
        optional = project.get("optional-dependencies", {})
        extras[folder] = set(optional)
        for requirement in [*project["dependencies"], *(r for rs in optional.values() for r in rs)]:
            names.add(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower())
    return names, extras


def _hints(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every install hint the command line may print."""
    import tensorserve.cli
    from tensorserve.repository.onnx_model import INSTALL_HINT
    from tensorserve.tracing import INSTALL

    with_entry_points(monkeypatch)  # no bench installed
    missing = tensorserve.cli.add_installed_commands(argparse.ArgumentParser().add_subparsers())
    return {"bench missing": missing["bench"], "otel": INSTALL, "onnx": INSTALL_HINT,
            "grpc": tensorserve.cli.GRPC_MISSING}


def test_every_install_hint_works_from_a_fresh_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hint installs a package some index has, or a folder of the repository
    (``-e bench``, ``-e '.[otel]'``) with the extra it names: tensorserve and
    tensorserve-bench are on no index."""
    known, extras = _requirements()
    hints = _hints(monkeypatch)
    assert set(hints) == {"bench missing", "otel", "onnx", "grpc"}
    checked = 0
    for what, hint in hints.items():
        for command in re.findall(r"pip install ([^,;()]+)", hint):
            words = shlex.split(command.strip())
            editable = False
            for word in words:
                if word.startswith("-"):
                    editable = editable or word == "-e"
                    continue
                if editable:
                    folder, _, extra = word.partition("[")
                    assert folder in PYPROJECTS, f"{what}: {hint!r} installs {folder}"
                    assert extra.rstrip("]") in extras[folder] | {""}, f"{what}: {hint!r}"
                    editable = False
                else:
                    name = re.split(r"[\[<>=]", word, maxsplit=1)[0].lower()
                    assert name in known and not name.startswith("tensorserve"), (
                        f"{what}: {hint!r} names {name}, which no index has for us")
                checked += 1
    assert checked == 5  # -e bench; -e .[otel]; onnxruntime; grpcio, protobuf

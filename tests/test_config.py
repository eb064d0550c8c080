"""config.toml validation names the file and the field; overrides layer
defaults < environment < CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tensorserve.cli import main as cli_main  # noqa: F401  (imports must work)
from tensorserve.cli import settings_from_args
from tensorserve.errors import ConfigError
from tensorserve.repository.config import load_config
from tensorserve.repository.loader import discover, read_config
from tests.helpers import ECHO, POISON_MODEL, toy_config, write_toy_model


def config_error(tmp_path: Path, text: str) -> str:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.toml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(folder / "config.toml")
    return str(info.value)


def echo(**changes: Any) -> str:
    """The echo model's config.toml with some fields changed (None: left out)."""
    return toy_config(**{**ECHO, **changes})


X, Y, BATCHING = ECHO["inputs"]["x"], ECHO["outputs"]["y"], ECHO["dynamic_batching"]


@pytest.mark.parametrize(
    "text, message",
    [
        (echo(max_batch_size=None, max_batch_sise=8), "m/config.toml: max_batch_sise: Extra inputs are not permitted"),
        (echo(max_batch_size=-2), "m/config.toml: max_batch_size: Input should be greater than or equal to 0"),
        (echo(device="tpu"), "m/config.toml: device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (echo(inputs={"x": {**X, "shape": [0, 4]}}), "m/config.toml: input[0].shape: every dimension must be positive or -1, got [0, 4]"),
        (echo(outputs={"y": {**Y, "unpad_like": "z"}}), "m/config.toml: output 'y': unpad_like names unknown input 'z'"),
        (echo(dynamic_batching={**BATCHING, "policy": "random"}), "m/config.toml: dynamic_batching.policy: Input should be 'fifo' or 'length_aware'"),
        (echo().replace("max_batch_size = 8", "max_batch_size = [8", 1), "m/config.toml: invalid TOML"),
        # The bounds of tensorserve.settings.BOUNDS, which the flags and variables share (tests/test_cli.py).
        (echo(instance_count=99), "m/config.toml: instance_count: Input should be less than or equal to 16"),
        (echo(default_timeout_ms=7_200_000.0), "m/config.toml: default_timeout_ms: Input should be less than or equal to 3600000"),
        (echo(dynamic_batching={**BATCHING, "max_queue_delay_ms": 60_001}), "m/config.toml: dynamic_batching.max_queue_delay_ms: Input should be less than or equal to 60000"),
    ],
    ids=["typo", "negative", "device", "zero-dim", "unpad_like", "policy", "toml",
         "instance_count", "default_timeout_ms", "max_queue_delay_ms"],
)
def test_config_errors_name_the_file_and_the_field(tmp_path: Path, text: str, message: str) -> None:
    assert config_error(tmp_path, text).startswith(message)


def test_an_output_with_more_variable_axes_than_its_source_is_rejected(tmp_path: Path) -> None:
    text = echo(outputs={"y": {**Y, "shape": [-1, -1]}})
    assert "output 'y' has 2 variable axes but input 'x' has only 1" in config_error(tmp_path, text)


def test_environment_overrides_config_and_flags_override_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    source = discover(tmp_path)["echo"]
    monkeypatch.setenv("TENSORSERVE_MAX_BATCH_SIZE", "4")
    monkeypatch.setenv("TENSORSERVE_POLICY", "fifo")
    from_env = settings_from_args(argparse.Namespace(max_batch_size=None, port=None))
    assert from_env.model_overrides() == {"max_batch_size": 4, "policy": "fifo"}
    assert read_config(source, from_env.model_overrides()).max_batch_size == 4
    from_flag = settings_from_args(argparse.Namespace(max_batch_size=16, port=9000))
    assert (from_flag.max_batch_size, from_flag.port) == (16, 9000)
    config = read_config(source, from_flag.model_overrides())
    assert config.max_batch_size == 16 and config.dynamic_batching.policy == "fifo"
    assert read_config(source).max_batch_size == 8  # the file itself is untouched


def test_isolation_comes_from_the_config_the_environment_or_a_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from tensorserve.cli import main

    write_toy_model(tmp_path, "echo", POISON_MODEL, isolation="process", **ECHO)
    source = discover(tmp_path)["echo"]
    assert read_config(source).isolation == "process"
    monkeypatch.setenv("TENSORSERVE_ISOLATION", "thread")
    from_env = settings_from_args(argparse.Namespace(isolation=None))
    assert read_config(source, from_env.model_overrides()).isolation == "thread"
    from_flag = settings_from_args(argparse.Namespace(isolation="process"))
    assert read_config(source, from_flag.model_overrides()).isolation == "process"
    with pytest.raises(SystemExit):  # argparse refuses anything else
        main(["serve", "--isolation", "fork"])

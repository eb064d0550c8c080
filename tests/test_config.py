"""config.toml validation names the file and the field; overrides layer
defaults < environment < CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorserve.cli import main as cli_main  # noqa: F401  (imports must work)
from tensorserve.cli import settings_from_args
from tensorserve.errors import ConfigError
from tensorserve.repository.config import load_config
from tensorserve.repository.loader import discover, read_config
from tests.helpers import ECHO_CONFIG, POISON_MODEL, write_model


def config_error(tmp_path: Path, text: str) -> str:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.toml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(folder / "config.toml")
    return str(info.value)


BASE = ECHO_CONFIG.replace("\n    ", "\n")


@pytest.mark.parametrize(
    "change, message",
    [
        (("max_batch_size = 8", "max_batch_sise = 8"), "m/config.toml: max_batch_sise: Extra inputs are not permitted"),
        (("max_batch_size = 8", "max_batch_size = -2"), "m/config.toml: max_batch_size: Input should be greater than or equal to 0"),
        (("max_batch_size = 8", 'max_batch_size = 8\ndevice = "tpu"'), "m/config.toml: device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (("shape = [-1, 4]", "shape = [0, 4]"), "m/config.toml: input[0].shape: every dimension must be positive or -1, got [0, 4]"),
        (('name = "y"', 'name = "y"\nunpad_like = "z"'), "m/config.toml: output 'y': unpad_like names unknown input 'z'"),
        (("max_queue_delay_ms = 2.0", 'max_queue_delay_ms = 2.0\npolicy = "random"'), "m/config.toml: dynamic_batching.policy: Input should be 'fifo' or 'length_aware'"),
        (("max_batch_size = 8", "max_batch_size = [8"), "m/config.toml: invalid TOML"),
    ],
)
def test_config_errors_name_the_file_and_the_field(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    assert config_error(tmp_path, BASE.replace(*change, 1)).startswith(message)


def test_an_output_with_more_variable_axes_than_its_source_is_rejected(tmp_path: Path) -> None:
    text = BASE.replace("shape = [-1, 4]\n[[output]]", "shape = [-1, 4]\n[[output]]").replace(
        'name = "y"\ndtype = "float32"\nshape = [-1, 4]', 'name = "y"\ndtype = "float32"\nshape = [-1, -1]'
    )
    assert "output 'y' has 2 variable axes but input 'x' has only 1" in config_error(tmp_path, text)


def test_environment_overrides_config_and_flags_override_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    write_model(tmp_path, "echo", ECHO_CONFIG, POISON_MODEL)
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

    write_model(tmp_path, "echo", 'isolation = "process"\n' + ECHO_CONFIG, POISON_MODEL)
    source = discover(tmp_path)["echo"]
    assert read_config(source).isolation == "process"
    monkeypatch.setenv("TENSORSERVE_ISOLATION", "thread")
    from_env = settings_from_args(argparse.Namespace(isolation=None))
    assert read_config(source, from_env.model_overrides()).isolation == "thread"
    from_flag = settings_from_args(argparse.Namespace(isolation="process"))
    assert read_config(source, from_flag.model_overrides()).isolation == "process"
    with pytest.raises(SystemExit):  # argparse refuses anything else
        main(["serve", "--isolation", "fork"])

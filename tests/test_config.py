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


# ---------------------------------------------------------------------- min_value / max_value
def ids_config(**bounds: Any) -> str:
    """A token model's config.toml whose input ``ids`` declares ``bounds``."""
    dtype = bounds.pop("dtype", "int64")
    return toy_config(
        inputs={"ids": {"dtype": dtype, "shape": [-1], **bounds}},
        outputs={"y": {"dtype": "float32", "shape": [-1]}},
    )


@pytest.mark.parametrize(
    "bounds",
    [{"min_value": 0, "max_value": 4095}, {"max_value": 4095}, {"min_value": -3},
     {"min_value": 7, "max_value": 7}, {"dtype": "float32", "min_value": -1.5, "max_value": 2},
     {"dtype": "bfloat16", "max_value": 1.0}, {"dtype": "uint8", "min_value": 0, "max_value": 255}],
    ids=["both", "max", "min", "equal", "float", "bfloat16", "uint8-range"],
)
def test_an_input_may_declare_the_values_it_accepts(tmp_path: Path, bounds: dict[str, Any]) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.toml").write_text(ids_config(**bounds))
    spec = load_config(folder / "config.toml").input[0]
    assert (spec.min_value, spec.max_value) == (bounds.get("min_value"), bounds.get("max_value"))


@pytest.mark.parametrize(
    "bounds, reason",
    [
        ({"min_value": 5, "max_value": 3}, "min_value 5 is above max_value 3"),
        ({"dtype": "bool", "max_value": 1}, "min_value and max_value are for integer and float inputs, not bool"),
        ({"max_value": 4095.5}, "max_value must be a whole number for dtype int64, got 4095.5"),
        ({"dtype": "uint8", "max_value": 256}, "max_value 256 is outside the range of uint8 (0 to 255)"),
        ({"dtype": "int32", "min_value": -(1 << 40)}, "min_value -1099511627776 is outside the range of int32"),
        ({"dtype": "float16", "max_value": 1e6}, "max_value 1000000.0 is outside the range of float16"),
        ({"dtype": "float32", "max_value": float("inf")}, "max_value must be a finite number, got inf"),
    ],
    ids=["min-above-max", "bool", "fraction", "uint8", "int32", "float16", "infinite"],
)
def test_bounds_that_cannot_hold_are_refused_at_load_saying_why(
    tmp_path: Path, bounds: dict[str, Any], reason: str
) -> None:
    message = config_error(tmp_path, ids_config(**bounds))
    assert message.startswith(f"m/config.toml: input[0]: input 'ids': {reason}")
    assert "\n" not in message


@pytest.mark.parametrize("value", ['"4095"', "true"], ids=["string", "bool"])
def test_a_bound_is_a_number_not_a_string_or_a_boolean(tmp_path: Path, value: str) -> None:
    text = ids_config().replace('shape = [-1]', f"shape = [-1]\nmax_value = {value}", 1)
    assert config_error(tmp_path, text).startswith("m/config.toml: input[0].max_value")


def test_the_bundled_token_models_bound_their_ids_by_their_vocabulary() -> None:
    """Every bundled input that indexes an embedding declares 0 .. vocab_size - 1
    (tagger_onnx: the tagger's, exported), so an id past the table is its
    caller's 400, never an index error in a batch (a device assert on a GPU)."""
    from tests.conftest import REPOSITORY, ROOT

    vocab = {}
    sources = {**discover(REPOSITORY), **discover(ROOT / "examples" / "model_repository")}
    for name, source in sorted(sources.items(), key=lambda kv: kv[0] == "tagger_onnx"):
        config = load_config(source.path / "config.toml")
        ids = {s.name: s for s in config.input}.get("input_ids")
        if ids is None:
            continue
        size = config.parameters.get("vocab_size") or vocab["tagger"]
        vocab[name] = size
        assert (ids.min_value, ids.max_value) == (0, size - 1), name
    assert {"tagger", "embedder", "attention_tagger", "gru_tagger", "tagger_onnx"} <= set(vocab)

"""Where a model.py's weights come from (tensorserve/repository/loader.py):
model.safetensors, or, when config.toml says ``weights = "init"``, the
module's own initial values. A module with parameters or buffers and
neither fails to load with its reason: forgotten weights never serve random
answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tensorserve.errors import ConfigError
from tensorserve.repository.loader import discover, load_model, read_config
from tests.conftest import ROOT
from tests.helpers import ECHO, POISON_MODEL, write_toy_model

# y = x * scale, scale a parameter whose initial value is 3.
SCALED_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(3.0), requires_grad=False)

        def forward(self, x):
            return x * self.scale
"""
# A buffer is a weight too: running statistics, a lookup table.
BUFFERED_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name in ("mean", "std", "table", "bias"):
                self.register_buffer(name, torch.ones(4))

        def forward(self, x):
            return x
"""


def _load(repo: Path, name: str) -> torch.nn.Module:
    source = discover(repo)[name]
    module = load_model(source, None, read_config(source)).module
    assert isinstance(module, torch.nn.Module)
    return module


def test_a_module_with_parameters_and_no_weights_file_is_refused(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "scaled", SCALED_MODEL, **ECHO)
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, "scaled")
    assert str(error.value) == (
        "scaled/1: the module has 1 parameters or buffers (scale) but no model.safetensors "
        "to load them from; add the file, or set weights = 'init' in config.toml to serve "
        "the values Model(**parameters) gives them"
    )


def test_buffers_need_weights_too_and_the_reason_names_the_first_three(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "buffered", BUFFERED_MODEL, **ECHO)
    with pytest.raises(ConfigError, match=r"^buffered/1: the module has 4 parameters or buffers "
                       r"\(mean, std, table, \.\.\.\) but no model.safetensors"):
        _load(tmp_path, "buffered")


def test_weights_init_serves_the_modules_own_initial_values(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "scaled", SCALED_MODEL, weights="init", **ECHO)
    module = _load(tmp_path, "scaled")
    assert module(torch.ones(2)).tolist() == [3.0, 3.0]


def test_a_weights_file_is_loaded_over_the_initial_values(tmp_path: Path) -> None:
    folder = write_toy_model(tmp_path, "scaled", SCALED_MODEL, **ECHO)
    save_file({"scale": torch.tensor(5.0)}, str(folder / "1" / "model.safetensors"))
    assert _load(tmp_path, "scaled")(torch.ones(2)).tolist() == [5.0, 5.0]


def test_weights_init_beside_a_weights_file_is_refused(tmp_path: Path) -> None:
    folder = write_toy_model(tmp_path, "scaled", SCALED_MODEL, weights="init", **ECHO)
    save_file({"scale": torch.tensor(5.0)}, str(folder / "1" / "model.safetensors"))
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, "scaled")
    assert str(error.value) == (
        "scaled/1/model.safetensors: config.toml says weights = 'init' (the module's own "
        "initial values), so remove this file or that setting"
    )


def test_a_module_without_parameters_needs_no_weights(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    assert _load(tmp_path, "echo")(torch.ones(2)).tolist() == [2.0, 2.0]


def test_weights_init_is_for_a_model_py(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "m", "", platform="onnxruntime_onnx", weights="init", **ECHO)
    with pytest.raises(ConfigError) as error:
        read_config(discover(tmp_path)["m"])
    assert str(error.value) == (
        "m/config.toml: weights = 'init' is for a model.py, not platform = 'onnxruntime_onnx'"
    )


def test_no_bundled_model_relies_on_its_initial_values() -> None:
    """Every model.py of the repository's model folders with state has its
    weights file, or says weights = "init"."""
    for repository in (ROOT / "model_repository", ROOT / "examples" / "model_repository"):
        for name, source in discover(repository).items():
            config = read_config(source)
            if config.platform == "pytorch_tensorserve":
                assert isinstance(_load(repository, name), torch.nn.Module), name

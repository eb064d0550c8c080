"""Discovery and loading of repository models (Triton layout).

    <repository>/<model>/config.toml
    <repository>/<model>/<version>/model.py          class Model(torch.nn.Module)
    <repository>/<model>/<version>/model.safetensors its weights (parameters, buffers)

or, by the config's ``platform`` (``repository/platforms.py``), a model file
in the version folder: ``model.onnx`` (``onnx_model.py``), ``model.pt`` or
``model.pt2`` (``torchscript_model.py``), a Hugging Face checkpoint
(``transformers_model.py``). Each loads as a callable that takes
the padded features as keyword arguments, as a model.py's forward does.

The highest numeric version is served. Weights come from safetensors only;
nothing is ever unpickled. A module with parameters or buffers and no weights
file fails to load, unless its config says ``weights = "init"``: forgotten
weights would otherwise serve random answers. Every failure raises ``ConfigError`` with a
sentence naming the file and what is wrong. torch is imported by what loads
a model, not by this module: discovery serves a front-end process too.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig, load_config
from tensorserve.repository.platforms import PLATFORMS

if TYPE_CHECKING:
    import torch

MODULE_FILE = "model.py"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path  # the model's folder
    versions: tuple[int, ...]  # ascending

    @property
    def latest(self) -> int | None:
        return self.versions[-1] if self.versions else None


def discover(repository: Path) -> dict[str, ModelSource]:
    """Every folder with a config.toml is a model; numeric subfolders are versions."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {str(repository)!r} is not a directory")
    found = {}
    for folder in sorted(p for p in repository.iterdir() if p.is_dir()):
        if not (folder / "config.toml").is_file():
            continue
        versions = sorted(int(v.name) for v in folder.iterdir() if v.is_dir() and v.name.isdigit())
        found[folder.name] = ModelSource(folder.name, folder, tuple(versions))
    return found


def _import_model_class(path: Path, module_name: str) -> type[torch.nn.Module]:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses/pickle-free introspection work
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ConfigError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
    import torch

    cls = getattr(module, "Model", None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ConfigError(f"{path}: must define class Model(torch.nn.Module)")
    return cls


def load_weights(module: torch.nn.Module, path: Path) -> None:
    """Strict safetensors loading: missing, unexpected and mis-shaped keys by name."""
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path))
    except Exception as exc:
        raise ConfigError(f"{path}: not a readable safetensors file: {exc}") from exc
    expected = module.state_dict()
    problems = []
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    for key in sorted(set(expected) & set(weights)):
        if expected[key].shape != weights[key].shape:
            problems.append(
                f"{key}: shape {list(weights[key].shape)} in file, "
                f"{list(expected[key].shape)} in model"
            )
    if problems:
        raise ConfigError(f"{path}: weights do not match the model: {'; '.join(problems)}")
    module.load_state_dict(weights, strict=True)


@dataclass
class LoadedModel:
    name: str
    version: int
    config: ModelConfig
    module: Callable[..., Any]  # an nn.Module, or a model file's session (onnx_model.py)


def resolve_version(source: ModelSource, version: int | None) -> int:
    """The version to serve: the one asked for, else the highest."""
    version = source.latest if version is None else version
    if version is None or version not in source.versions:
        raise ConfigError(f"{source.name}: no version folder (e.g. {source.name}/1/model.py)")
    return version


def load_model(
    source: ModelSource,
    version: int | None,
    config: ModelConfig,
    intra_op_threads: int | None = None,
) -> LoadedModel:
    """Load one version (on the CPU): import model.py, construct it and load
    its weights, or open the platform's model file. ``intra_op_threads`` sizes
    an ONNX Runtime session's pool (torch's is set on each instance thread)."""
    if config.platform == "ensemble":  # the registry serves it (tensorserve/ensemble/)
        raise ConfigError(
            f"{source.name}: platform = 'ensemble' runs other models of its repository; "
            f"serve the repository (tensorserve serve), not the ensemble alone"
        )
    version = resolve_version(source, version)
    folder = source.path / str(version)
    files = PLATFORMS[config.platform].files
    path = next((folder / name for name in files if (folder / name).is_file()), None)
    if path is None:
        raise ConfigError(
            f"{source.name}/{version}/{' or '.join(files)}: file not found "
            f"(platform = {config.platform!r})"
        )
    label = f"{source.name}/{version}/{path.name}"
    if config.platform == "onnxruntime_onnx":
        from tensorserve.repository.onnx_model import load_onnx  # onnxruntime: an extra

        model: Callable[..., Any] = load_onnx(path, config, intra_op_threads, label)
    elif config.platform == "huggingface_transformers":
        from tensorserve.repository.transformers_model import load_transformers  # an extra

        model = load_transformers(folder, config, f"{source.name}/{version}")
    elif config.platform == "pytorch_libtorch":
        from tensorserve.repository.torchscript_model import load_torchscript

        model = load_torchscript(path, config, label)
    else:
        model = _load_module(source, version, config)
    return LoadedModel(source.name, version, config, model)


def _load_module(source: ModelSource, version: int, config: ModelConfig) -> torch.nn.Module:
    folder = source.path / str(version)
    module_file = folder / MODULE_FILE
    cls = _import_model_class(module_file, f"tensorserve_models.{source.name}.v{version}")
    try:
        module = cls(**config.parameters)
    except Exception as exc:
        raise ConfigError(
            f"{source.name}/{version}/{MODULE_FILE}: Model(**parameters) failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    weights = folder / WEIGHTS_FILE
    if config.weights == "init":
        if weights.is_file():
            raise ConfigError(
                f"{source.name}/{version}/{WEIGHTS_FILE}: config.toml says weights = 'init' "
                f"(the module's own initial values), so remove this file or that setting"
            )
    elif weights.is_file():
        load_weights(module, weights)
    elif tensors := list(module.state_dict()):
        # Random weights would serve wrong answers with nothing in the logs.
        raise ConfigError(
            f"{source.name}/{version}: the module has {len(tensors)} parameters or buffers "
            f"({', '.join(tensors[:3])}{', ...' if len(tensors) > 3 else ''}) but no "
            f"{WEIGHTS_FILE} to load them from; add the file, or set weights = 'init' in "
            f"config.toml to serve the values Model(**parameters) gives them"
        )
    module.eval()
    return module


def read_config(
    source: ModelSource, overrides: dict[str, Any] | None = None, default_device: str = "auto"
) -> ModelConfig:
    """A model's config.toml, with the server's default device (``--device``)
    and then its overrides applied."""
    config = load_config(source.path / "config.toml").with_default_device(default_device)
    if overrides:
        try:
            config = config.with_overrides(**overrides)
        except Exception as exc:
            raise ConfigError(f"{source.name}: server overrides are invalid: {exc}") from exc
    return config

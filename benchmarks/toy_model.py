"""The toy model the reliability benchmarks serve (soak.py, soak_overload.py,
worker_crash.py): rows of 4 floats in (``x``) and the same shape out (``y``),
no warm-up. Each benchmark brings its own forward and batching settings."""

from __future__ import annotations

from pathlib import Path

INPUTS_AND_OUTPUTS = """
[warmup]
enabled = false
[[input]]
name = "x"
dtype = "float32"
shape = [-1, 4]
[[output]]
name = "y"
dtype = "float32"
shape = [-1, 4]
"""


def write_toy_model(repository: str | Path, name: str, model_py: str, settings: str) -> Path:
    """``repository/name`` with ``settings`` (config.toml's top-level keys and
    tables) and the x -> y contract, and ``model_py`` as version 1."""
    folder = Path(repository, name)
    (folder / "1").mkdir(parents=True)
    (folder / "config.toml").write_text(settings + INPUTS_AND_OUTPUTS)
    (folder / "1" / "model.py").write_text(model_py)
    return folder

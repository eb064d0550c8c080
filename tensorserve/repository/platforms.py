"""What a model version folder holds, by the config's ``platform`` (Triton's
names), and the ONNX Runtime session options a config may set.

    pytorch_tensorserve   <version>/model.py (+ model.safetensors): class Model
    onnxruntime_onnx      <version>/model.onnx, run by an ONNX Runtime session
    pytorch_libtorch      <version>/model.pt (TorchScript, torch.jit.load) or
                          <version>/model.pt2 (a torch.export program)
    huggingface_transformers
                          <version>/config.json, model.safetensors and the
                          tokenizer's files, as save_pretrained writes them
                          ([transformers]: transformers_config.py)
    ensemble              an empty <version>/: [[ensemble_scheduling.step]] runs
                          other models (tensorserve/ensemble/)

One table: the loader finds a version's file here, the config checks what a
platform allows here, and the worker template asks here whether a model may
be loaded before it forks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Platform = Literal[
    "pytorch_tensorserve",
    "onnxruntime_onnx",
    "pytorch_libtorch",
    "huggingface_transformers",
    "ensemble",
]
DEFAULT_PLATFORM: Platform = "pytorch_tensorserve"


@dataclass(frozen=True)
class PlatformFiles:
    files: tuple[str, ...]  # the first one present in the version folder is loaded
    # May the worker template load it and then fork? torch holds its intra-op
    # pool at one thread there; an ONNX Runtime session starts its own thread
    # pool, which a forked child would inherit without its threads.
    loads_before_fork: bool
    # What model.py can do that a file cannot: torch.compile it, and take
    # per-row request parameters as keyword arguments.
    python: bool


PLATFORMS: dict[str, PlatformFiles] = {
    "pytorch_tensorserve": PlatformFiles(("model.py",), loads_before_fork=True, python=True),
    "onnxruntime_onnx": PlatformFiles(("model.onnx",), loads_before_fork=False, python=False),
    "pytorch_libtorch": PlatformFiles(
        ("model.pt", "model.pt2"), loads_before_fork=True, python=False
    ),
    # A torch module once loaded: the template may load it and fork, as for model.py.
    "huggingface_transformers": PlatformFiles(
        ("config.json", "modules.json"), loads_before_fork=True, python=False
    ),
    # Nothing to load: its steps' models run (the registry builds an Ensemble).
    "ensemble": PlatformFiles((), loads_before_fork=False, python=False),
}


def platform_problem(
    platform: str,
    *,
    onnxruntime: bool,
    transformers: bool,
    text_input: bool,
    compile: str,
    request_parameters: bool,
    bytes_tensors: list[str],
    ensemble_scheduling: bool,
    weights_init: bool = False,
) -> str | None:
    """Why a config asks for what its platform cannot do, as one sentence
    (None: nothing). A model file takes its inputs only, and is already
    compiled its own way (a Hugging Face checkpoint takes a TEXT input, which
    the server tokenizes before the model sees it); an ensemble runs other models, which declare
    their own request parameters (every step is given the request's)."""
    if onnxruntime and platform != "onnxruntime_onnx":
        return "[onnxruntime] is for platform = 'onnxruntime_onnx'"
    if transformers != (platform == "huggingface_transformers"):
        return "platform = 'huggingface_transformers' and [transformers] go together"
    if ensemble_scheduling != (platform == "ensemble"):
        return "platform = 'ensemble' and [[ensemble_scheduling.step]] go together"
    if PLATFORMS[platform].python:
        return None
    if compile not in ("off", "auto"):  # auto: eager where graphs cannot be used
        return f"compile needs a model.py, not platform = {platform!r}"
    if weights_init:
        return f"weights = 'init' is for a model.py, not platform = {platform!r}"
    if request_parameters:
        return (
            f"request_parameter needs a model.py (forward's keyword arguments), not "
            f"platform = {platform!r}"
        )
    if text_input:  # the server tokenizes TEXT before the item is queued
        bytes_tensors = [name for name in bytes_tensors if name != "TEXT"]
    if bytes_tensors and platform != "ensemble":  # bytes reach a forward as numpy arrays
        return (
            f"dtype bytes ({', '.join(map(repr, bytes_tensors))}) needs a model.py, not "
            f"platform = {platform!r}"
        )
    return None


class OnnxRuntimeOptions(BaseModel):
    """``[onnxruntime]``: the session options of a ``onnxruntime_onnx`` model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    intra_op_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Threads of the session's intra-op pool. Unset: the server's "
        "intra_op_threads (every CPU the process may use but one, as for torch).",
    )
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="ONNX Runtime's graph optimisations applied when the session loads."
    )
    spin_wait: bool = Field(
        False,
        description="Let the intra-op threads spin between operators (ONNX Runtime's own "
        "default). Off: a spinning thread takes the core the event loop needs.",
    )

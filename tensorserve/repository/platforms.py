"""What a model version folder holds, by the config's ``platform`` (Triton's
names), and the ONNX Runtime session options a config may set.

    pytorch_tensorserve   <version>/model.py (+ model.safetensors): class Model
    onnxruntime_onnx      <version>/model.onnx, run by an ONNX Runtime session
    pytorch_libtorch      <version>/model.pt (TorchScript, torch.jit.load) or
                          <version>/model.pt2 (a torch.export program)

One table: the loader finds a version's file here, the config checks what a
platform allows here, and the worker template asks here whether a model may
be loaded before it forks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Platform = Literal["pytorch_tensorserve", "onnxruntime_onnx", "pytorch_libtorch"]
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
}


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

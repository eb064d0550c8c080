"""An ONNX file served as a batch function (``platform = "onnxruntime_onnx"``).

``OnnxModel`` is called exactly as a model.py's forward is: the padded
features as keyword arguments (torch tensors, batch first), and it returns
output name -> tensor. So everything around it is the same for every
platform: padding, co-batching, un-padding, warm-up, the poison and
out-of-memory splits, worker processes.

At load the graph's own signature is checked against config.toml (names,
ranks, fixed and variable axes, dtypes), so a mismatch fails the model with
one sentence instead of failing every batch. onnxruntime is an extra
(``pip install onnxruntime``, or ``onnxruntime-gpu``), imported only
here, when such a model loads.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tensorserve.errors import BatchOutOfMemory, ConfigError
from tensorserve.repository.config import VARIABLE, ModelConfig, TensorSpec
from tensorserve.repository.platforms import OnnxRuntimeOptions

log = logging.getLogger(__name__)

# What the onnx extra installs, spelled so that it works without a checkout too.
INSTALL_HINT = "pip install onnxruntime (or onnxruntime-gpu on a CUDA machine)"
# ONNX Runtime's element types, as config.toml names them (bfloat16 has no numpy type).
ORT_DTYPES = {
    "tensor(float)": "float32", "tensor(double)": "float64", "tensor(float16)": "float16",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16",
    "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool",
}  # fmt: skip
LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
CUDA = "CUDAExecutionProvider"


def import_onnxruntime(label: str) -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(
            f"{label}: platform 'onnxruntime_onnx' needs onnxruntime: {INSTALL_HINT}"
        ) from None
    return onnxruntime


class OnnxModel:
    """One ONNX Runtime session; ``to(device)`` picks its execution provider."""

    def __init__(
        self, path: Path, config: ModelConfig, intra_op_threads: int | None, label: str
    ) -> None:
        self.path, self.label = path, label
        self.options = config.onnxruntime or OnnxRuntimeOptions()
        self.threads = self.options.intra_op_threads or intra_op_threads or 1
        self.device_asked = config.device
        # A packed model's batch inputs are graph inputs too.
        self.inputs = [spec.name for spec in config.input] + [b.name for b in config.batch_input]
        self.outputs = [spec.name for spec in config.output]
        self.providers: list[Any] = ["CPUExecutionProvider"]
        self.cuda_device: torch.device | None = None  # set once a session runs on CUDA
        self.session = self._session()
        check_signature(self.session, config, label)

    def _session(self) -> Any:
        ort = import_onnxruntime(self.label)
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1  # one batch at a time per instance: no parallel branches
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        level = LEVELS[self.options.graph_optimization_level]
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        spin = "1" if self.options.spin_wait else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        try:
            return ort.InferenceSession(str(self.path), options, providers=self.providers)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises many types
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{self.label}: ONNX Runtime cannot load it: {reason}") from None

    def to(self, device: torch.device) -> OnnxModel:
        """On CUDA, a session on the CUDA execution provider (onnxruntime-gpu);
        ``device = "auto"`` without it stays on the CPU, saying so."""
        if device.type != "cuda":
            return self
        ort = import_onnxruntime(self.label)
        if CUDA not in ort.get_available_providers():
            if self.device_asked != "auto":
                raise ConfigError(
                    f"{self.label}: device = {self.device_asked!r} needs ONNX Runtime's CUDA "
                    f"execution provider: pip install onnxruntime-gpu (in place of onnxruntime)"
                )
            log.warning(
                "%s: onnxruntime has no CUDA execution provider (install "
                "onnxruntime-gpu); the session runs on the CPU",
                self.label,
            )
            return self
        self.providers = [(CUDA, {"device_id": device.index or 0}), "CPUExecutionProvider"]
        self.session = self._session()
        # The provider being available does not mean the session got it: ONNX
        # Runtime falls back to the CPU, with a warning only, when the CUDA
        # provider cannot start (a cuDNN or CUDA version it was not built for).
        problem = provider_problem(self.session.get_providers(), self.device_asked)
        if problem is not None:
            if self.device_asked != "auto":
                raise ConfigError(f"{self.label}: {problem}")
            log.warning("%s: %s; the session runs on the CPU", self.label, problem)
            self.providers = ["CPUExecutionProvider"]
            self.session = self._session()
            return self
        self.cuda_device = device
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> OnnxModel:
        """A session of its own (instance groups copy a model per device)."""
        twin = copy.copy(self)
        twin.session = twin._session()
        return twin

    def __call__(self, **features: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            if self.cuda_device is not None:
                arrays = self._run_on_cuda(features, self.cuda_device)
            else:
                feed = {name: features[name].detach().cpu().numpy() for name in self.inputs}
                arrays = self.session.run(self.outputs, feed)
        except Exception as exc:
            text = str(exc)
            if "Failed to allocate memory" in text or "out of memory" in text:
                raise BatchOutOfMemory(f"{type(exc).__name__}: {text}") from None
            raise
        return {name: torch.from_numpy(array) for name, array in zip(self.outputs, arrays)}

    def _run_on_cuda(self, features: dict[str, torch.Tensor], device: torch.device) -> list[Any]:
        """The inputs stay where the executor put them (on the GPU): ONNX
        Runtime reads torch's buffers through IO binding, instead of a copy
        back to pageable host memory and another to its own GPU buffers. It
        runs on its own stream, so the instance's stream (which wrote them)
        is waited for first; the outputs come back to the host once."""
        binding = self.session.io_binding()
        held = []  # keeps each bound buffer alive until the run is over
        for name in self.inputs:
            tensor = features[name].detach().to(device).contiguous()
            held.append(tensor)
            binding.bind_input(
                name, device_type="cuda", device_id=device.index or 0,
                element_type=tensor.new_empty(0, device="cpu").numpy().dtype,
                shape=tuple(tensor.shape), buffer_ptr=tensor.data_ptr(),
            )  # fmt: skip
        for name in self.outputs:
            binding.bind_output(name, device_type="cuda", device_id=device.index or 0)
        torch.cuda.current_stream(device).synchronize()
        self.session.run_with_iobinding(binding)
        return list(binding.copy_outputs_to_cpu())


def provider_problem(active: Sequence[str], device_asked: str) -> str | None:
    """Why a session meant for CUDA is not on it (None: it is), from the
    session's own providers (``session.get_providers()``), which are what it
    runs on, not from what the installed package offers."""
    if CUDA in active:
        return None
    return (
        f"device = {device_asked!r}: ONNX Runtime could not start its CUDA execution "
        f"provider for this session (it runs on {', '.join(active)}); install the "
        f"onnxruntime-gpu build that matches this image's CUDA and cuDNN"
    )


def check_signature(session: Any, config: ModelConfig, label: str) -> None:
    """Every graph input declared, every declared tensor in the graph with
    its dtype, rank and axes; ``ConfigError`` names the first mismatch. A
    graph may have outputs the config does not declare (they are not run)."""
    graph_inputs = {arg.name: arg for arg in session.get_inputs()}
    graph_outputs = {arg.name: arg for arg in session.get_outputs()}
    batch_inputs = {b.name: b for b in config.batch_input}
    declared = {s.name for s in config.input} | set(batch_inputs)
    undeclared = [name for name in graph_inputs if name not in declared]
    if undeclared:
        raise ConfigError(
            f"{label}: the graph's input(s) {', '.join(undeclared)} are not declared in config.toml"
        )
    # A packed input, and an output split like one, has no batch axis: its rank is not checked.
    ragged = {spec.name for spec in config.input if spec.allow_ragged_batch}
    for spec in config.input:
        what = f"{label}: input {spec.name!r}"
        _check_tensor(what, spec, graph_inputs, config.batching, spec.name in ragged)
    for out in config.output:
        packed = bool(out.variable_axes) and config.unpad_source(out) in ragged
        _check_tensor(f"{label}: output {out.name!r}", out, graph_outputs, config.batching, packed)
    for name, batch_input in batch_inputs.items():
        arg = graph_inputs.get(name)
        dtype = None if arg is None else ORT_DTYPES.get(arg.type, arg.type)
        if dtype != batch_input.data_type:
            where = "is not in the graph" if arg is None else f"is {dtype} in the graph"
            raise ConfigError(
                f"{label}: batch_input {name!r} {where}; config.toml says {batch_input.data_type}"
            )


def _check_tensor(
    what: str, spec: TensorSpec, graph: dict[str, Any], batching: bool, packed: bool = False
) -> None:
    arg = graph.get(spec.name)
    if arg is None:
        raise ConfigError(f"{what} is not in the graph, whose names are: {', '.join(graph)}")
    dtype = ORT_DTYPES.get(arg.type, arg.type)
    if dtype != spec.dtype:
        raise ConfigError(f"{what} is {dtype} in the graph, {spec.dtype} in config.toml")
    shape: Sequence[Any] | None = arg.shape
    if shape is None or packed:
        return  # the graph does not say its rank; or packed: no batch axis to check
    if len(shape) != 1 + len(spec.shape):
        raise ConfigError(
            f"{what} has rank {len(shape)} in the graph (batch axis included), "
            f"{1 + len(spec.shape)} in config.toml (shape {spec.shape} per item)"
        )
    if isinstance(shape[0], int) and (batching or shape[0] != 1):
        raise ConfigError(
            f"{what}: the batch axis is fixed at {shape[0]} in the graph; "
            f"export it as a dynamic axis"
        )
    for axis, (exported, declared) in enumerate(zip(shape[1:], spec.shape), start=1):
        if not isinstance(exported, int):
            continue  # a named (dynamic) axis takes any length
        if declared == VARIABLE:
            raise ConfigError(
                f"{what}: axis {axis} is fixed at {exported} in the graph but "
                f"variable (-1) in config.toml; export it as a dynamic axis"
            )
        if exported != declared:
            raise ConfigError(
                f"{what}: axis {axis} is {exported} in the graph, {declared} in config.toml"
            )


def load_onnx(
    path: Path, config: ModelConfig, intra_op_threads: int | None, label: str
) -> OnnxModel:
    return OnnxModel(path, config, intra_op_threads, label)

"""The schema of ``config.toml``, declared once with types, defaults and bounds.

Validation errors are turned into one sentence that names the file and the
field (``tagger/config.toml: input[0].dtype: unknown dtype 'int46'``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tensorserve.errors import ConfigError
from tensorserve.repository.batching_config import DEFAULTS_ONLY, DynamicBatching
from tensorserve.repository.ensemble_config import EnsembleScheduling
from tensorserve.repository.faults_config import Faults
from tensorserve.repository.output_rules import output_problem
from tensorserve.repository.parameters import RequestParameterSpec
from tensorserve.repository.platforms import (
    DEFAULT_PLATFORM,
    OnnxRuntimeOptions,
    Platform,
    platform_problem,
)
from tensorserve.repository.ragged_config import (
    BatchInputSpec,
    BatchOutputSpec,
    ragged_problem,
    scatter_sources,
)
from tensorserve.repository.tensor_specs import (
    VARIABLE,
    InputSpec,
    OutputSpec,
    TensorSpec,
    _Strict,
)
from tensorserve.repository.transformers_config import (
    TRANSFORMERS_PLATFORM,
    TransformersOptions,
    apply_derived,
)
from tensorserve.settings import BOUNDS, check_device

# The tensors' schema lives below this module (tensor_specs); importers of
# the model's schema find it here too.
__all__ = [
    "DEFAULT_MAX_LENGTH",
    "TORCH_COMPILE_MODES",
    "VARIABLE",
    "DynamicBatching",
    "InputSpec",
    "InstanceGroup",
    "ModelConfig",
    "OutputSpec",
    "TensorSpec",
    "Warmup",
    "load_config",
    "parse_config",
]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Bound on any variable axis when the config sets no max_length: keeps a
# single client from asking the server to allocate an absurd padded batch.
DEFAULT_MAX_LENGTH = 1 << 16

# The compile modes that torch.compile the model; "reduce-overhead" and "auto"
# are the server's own bucketed CUDA graphs (runtime/graphs.py), "off" neither.
TORCH_COMPILE_MODES = frozenset({"default", "max-autotune"})


class Warmup(_Strict):
    enabled: bool = Field(True, description="Run padded batches at load; ready only after.")
    batch_sizes: list[int] | None = Field(
        None, description="Batch sizes to warm up (default: 1 and max_batch_size)."
    )
    lengths: list[int] = Field([16, 128], description="Lengths given to every variable axis.")

    @field_validator("batch_sizes", "lengths")
    @classmethod
    def _positive(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(v < 1 for v in value):
            raise ValueError(f"every entry must be >= 1, got {value}")
        return value


class InstanceGroup(_Strict):
    """Triton's ``instance_group``: ``count`` model instances on each device
    of the group. Instances on one device share one copy of the model (each
    with its own thread, two on CUDA); every device gets its own copy."""

    count: int = Field(
        1, **BOUNDS["instance_count"], description="Instances on each device of this group."
    )
    kind: Literal["KIND_AUTO", "KIND_GPU", "KIND_CPU"] = Field(
        "KIND_AUTO",
        description="KIND_GPU: on GPUs; KIND_CPU: on the CPU; KIND_AUTO: every visible GPU, "
        "or the CPU when there is none.",
    )
    gpus: list[int] | None = Field(
        None, description="GPU indices (KIND_GPU, KIND_AUTO); unset: every visible GPU."
    )

    @model_validator(mode="after")
    def _gpus(self) -> InstanceGroup:
        if self.gpus is not None:
            if self.kind == "KIND_CPU":
                raise ValueError("gpus is for KIND_GPU or KIND_AUTO, not KIND_CPU")
            if (
                not self.gpus
                or any(g < 0 for g in self.gpus)
                or len(set(self.gpus)) < len(self.gpus)
            ):
                raise ValueError(f"gpus must be distinct indices >= 0, got {self.gpus}")
        return self


class ModelConfig(_Strict):
    platform: Platform = Field(
        DEFAULT_PLATFORM,
        description="What a version folder holds (Triton's names): pytorch_tensorserve: "
        "model.py (+ model.safetensors); onnxruntime_onnx: model.onnx; pytorch_libtorch: "
        "model.pt or model.pt2; huggingface_transformers: a save_pretrained folder "
        "([transformers]); ensemble: nothing, the steps run other models.",
    )
    ensemble_scheduling: EnsembleScheduling | None = Field(
        None, description="platform = 'ensemble': its steps (docs/model-repository.md)."
    )
    onnxruntime: OnnxRuntimeOptions | None = Field(
        None, description="Session options of an onnxruntime_onnx model."
    )
    transformers: TransformersOptions | None = Field(
        None,
        description="What a huggingface_transformers checkpoint does (its task); its inputs "
        "and outputs are derived from the checkpoint.",
    )
    max_batch_size: int = Field(
        32,
        **BOUNDS["max_batch_size"],
        description="Most items in one batch. 0: requests carry no batch dimension; "
        ">= 1: a leading batch dimension, as in Triton.",
    )
    default_timeout_ms: float | None = Field(
        None,
        **BOUNDS["default_timeout_ms"],
        strict=True,  # a number: not true (1 ms), not a string
        description="Deadline of a request that asks for none (queue and run); a request may "
        "ask for less, or more up to the server's max_timeout_ms. Unset: the server's "
        "default_timeout_ms.",
    )
    device: str = Field(
        "auto",
        description="auto | cpu | cuda | cuda:N. auto without instance_group: instance_count "
        "instances on every visible GPU, else on the CPU (Triton's KIND_AUTO); cuda: the same "
        "on every GPU, failing without CUDA; cpu, cuda:N: that one device.",
    )
    instance_count: int = Field(
        1,
        **BOUNDS["instance_count"],
        description="Model copies executing in parallel (device auto: on each visible GPU).",
    )
    isolation: Literal["auto", "thread", "process"] = Field(
        "auto",
        description="thread: each instance in a thread of the server. process: in a worker "
        "process on its instance's device, whose forward never waits for the event loop's GIL "
        "(a socket copy of each batch; repository models only). auto: process on the CPU "
        "with 2 or more CPUs, else thread (docs/threading.md).",
    )
    instance_group: list[InstanceGroup] = Field(
        default_factory=list,
        description="Where the instances run, as Triton's instance groups (several devices, "
        "so one server uses every GPU of a node); replaces device and instance_count.",
    )
    dynamic_batching: DynamicBatching = Field(default_factory=DynamicBatching)
    parameters: dict[str, Any] = Field(default_factory=dict, description="Model(**parameters).")
    weights: Literal["file", "init"] = Field(
        "file",
        description="file: a model.py whose module has parameters or buffers loads them from "
        "model.safetensors, and without that file fails to load. init: the module serves the "
        "values Model(**parameters) gives them (tests and toys); a weights file is then an error.",
    )
    input: list[InputSpec] = Field(min_length=1)
    output: list[OutputSpec] = Field(min_length=1)
    request_parameter: list[RequestParameterSpec] = Field(
        default_factory=list,
        description="Values a request may give in its parameters, passed to forward one per "
        "row (docs/model-repository.md); a request's other parameters are ignored.",
    )
    batch_input: list[BatchInputSpec] = Field(
        default_factory=list,
        description="Tensors describing a packed batch (Triton's batch_input), passed to "
        "forward as keyword arguments named target_name (docs/model-repository.md).",
    )
    batch_output: list[BatchOutputSpec] = Field(
        default_factory=list,
        description="Outputs split per caller like a ragged input (= unpad_like on it).",
    )
    warmup: Warmup = Field(default_factory=Warmup)
    faults: Faults = Field(default_factory=Faults)
    compile: Literal["auto", "off", "default", "reduce-overhead", "max-autotune"] = Field(
        "auto",
        description="reduce-overhead: on CUDA, CUDA graphs per (batch size, length) bucket. "
        "auto: those graphs where a timing at load finds the forward launch-bound, else eager "
        "(a CPU: off). default, max-autotune: torch.compile. off: eager (docs/gpu.md).",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device(value)

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.instance_group and (self.device != "auto" or self.instance_count != 1):
            raise ValueError(
                "instance_group places the instances itself: leave device and instance_count unset"
            )
        problem = platform_problem(
            self.platform,
            onnxruntime=self.onnxruntime is not None,
            transformers=self.transformers is not None,
            text_input=self.tokenizes_text,
            compile=self.compile,
            request_parameters=bool(self.request_parameter),
            bytes_tensors=[s.name for s in (*self.input, *self.output) if s.dt.is_bytes],
            ensemble_scheduling=self.ensemble_scheduling is not None,
            weights_init=self.weights == "init",
        )
        if problem is not None:
            raise ValueError(problem)
        kinds = (
            ("input", self.input),
            ("output", self.output),
            ("request_parameter", self.request_parameter),
        )
        for kind, specs in kinds:
            names = [s.name for s in specs]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"duplicate {kind} names: {', '.join(dupes)}")
        inputs = {s.name: s for s in self.input}
        for parameter in self.request_parameter:
            if parameter.name in inputs:  # both are keyword arguments of forward
                raise ValueError(f"request_parameter {parameter.name!r} has the name of an input")
        if (problem := ragged_problem(self)) is not None:
            raise ValueError(problem)
        # An ensemble's outputs take their shapes from its steps (checked at load);
        # a text model's per-token outputs follow the tokens the server made.
        for out in self.output if self.unpads_like_inputs else []:
            if (problem := output_problem(out, self.unpad_source(out), inputs)) is not None:
                raise ValueError(problem)
        return self

    def unpad_source(self, out: OutputSpec) -> str | None:
        """The input whose true lengths un-pad ``out`` (a ragged one, or an
        ensemble's, whose steps give its shape: none)."""
        if out.ragged or not self.unpads_like_inputs:
            return None
        if out.unpad_like is not None:
            return out.unpad_like
        if (scattered := scatter_sources(self.batch_output).get(out.name)) is not None:
            return scattered
        return next((s.name for s in self.input if s.variable_axes), None)

    @property
    def tokenizes_text(self) -> bool:
        """A checkpoint whose TEXT the server tokenizes before it is queued."""
        return self.transformers is not None and self.transformers.inputs == "text"

    @property
    def unpads_like_inputs(self) -> bool:
        """Its variable outputs follow its inputs (not an ensemble's steps, nor tokens)."""
        return self.platform != "ensemble" and not self.tokenizes_text

    @property
    def packed(self) -> bool:
        """Whether any input is packed (``allow_ragged_batch``) rather than padded."""
        return any(spec.allow_ragged_batch for spec in self.input)

    @property
    def batching(self) -> bool:
        """Whether requests carry a leading batch dimension: Triton's rule,
        ``max_batch_size`` >= 1 (only 0 means none). With 1 a request still
        has one, of at most one row per batch the model runs."""
        return self.max_batch_size >= 1

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        """A copy with server-wide overrides (env/CLI) applied; ``None`` means keep."""
        data = self.model_dump()
        for key, value in overrides.items():
            if value is None:
                continue
            if key in ("device", "instance_count"):
                data["instance_group"] = []  # the server-wide placement wins
            if key in DEFAULTS_ONLY and data["dynamic_batching"].get(key) is not None:
                continue  # a server-wide default: the model's own setting wins
            if key in DynamicBatching.model_fields:
                data["dynamic_batching"][key] = value
            else:
                data[key] = value
        return ModelConfig.model_validate(data)

    def with_default_device(self, device: str) -> ModelConfig:
        """A copy with the server's ``device`` (auto, cpu or cuda) in place of
        what the model leaves to ``auto``: its device, its groups' kind. Unlike
        an override, a model pinned to the CPU, or to GPUs, stays there."""
        if device == "auto":
            return self
        kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"
        groups = [
            group.model_copy(update={"kind": kind, "gpus": group.gpus if kind == "KIND_GPU" else None})
            if group.kind == "KIND_AUTO" else group
            for group in self.instance_group
        ]  # fmt: skip
        update: dict[str, Any] = {"instance_group": groups}
        if self.device == "auto" and not groups:
            update["device"] = device
        return self.model_copy(update=update)


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def parse_config(data: dict[str, Any], source: str) -> ModelConfig:
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            # Model-level checks have no location: their message names the field.
            ": ".join(
                filter(None, (_field_path(err["loc"]), err["msg"].removeprefix("Value error, ")))
            )
            for err in exc.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None


def load_config(path: Path) -> ModelConfig:
    """Read and validate one model's ``config.toml``."""
    source = f"{path.parent.name}/{path.name}"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    if data.get("platform") == TRANSFORMERS_PLATFORM:
        # Inputs and outputs from the checkpoint; the checks that need them run after.
        data = apply_derived(data, path.parent, source)
    return parse_config(data, source)

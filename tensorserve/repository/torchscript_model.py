"""A TorchScript or torch.export file served as a batch function
(``platform = "pytorch_libtorch"``).

    model.pt    TorchScript (torch.jit.save of a scripted or traced module),
                read by torch.jit.load: it holds code and tensors, never a
                pickle of arbitrary Python objects (torch.load is never used)
    model.pt2   a torch.export program (torch.export.save), read by
                torch.export.load

``FileModel`` is called as a model.py's forward is (padded features as
keyword arguments) and returns output name -> tensor: a tuple maps to the
declared outputs by position, a dict by name. What the file exposes is
checked at load against config.toml: TorchScript gives forward's argument
names and types and the arity of its return; a torch.export program also
gives every tensor's dtype and rank, and which axes are dynamic.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tensorserve.errors import ConfigError, ModelFailure
from tensorserve.repository.config import VARIABLE, InputSpec, ModelConfig, TensorSpec

# torch.export.load keeps its deserializer in a module global: two loads at
# once (the registry loads models on parallel threads) fail with
# "_CURRENT_DESERIALIZER is already set". One load at a time.
_EXPORT_LOAD = threading.Lock()


class FileModel(torch.nn.Module):
    """The loaded program, called with keyword arguments (TorchScript) or
    positionally in the program's own order (torch.export)."""

    def __init__(
        self,
        program: torch.nn.Module,
        arguments: Sequence[str] | None,
        outputs: Sequence[str],
        *,
        path: Path,
        label: str,
        exported: torch.export.ExportedProgram | None = None,
    ) -> None:
        super().__init__()
        self.program = program
        self.arguments = list(arguments) if arguments is not None else None
        self.outputs = list(outputs)
        self.path, self.label = path, label
        self.exported = exported  # the torch.export program, rewritten per device

    def to(self, *args: Any, **kwargs: Any) -> FileModel:  # type: ignore[override]
        """The program on ``device`` (see the module docstring); any other
        ``to`` (a dtype) is nn.Module's."""
        device = args[0] if args else kwargs.get("device")
        if not isinstance(device, (str, torch.device)) or len(args) + len(kwargs) != 1:
            return super().to(*args, **kwargs)
        device = torch.device(device)
        if device.type == "cpu":
            return self  # loaded there
        if self.exported is not None:
            from torch.export.passes import move_to_device_pass

            self.program = move_to_device_pass(self.exported, device).module()
            return self
        program = torch.jit.load(str(self.path), map_location=device)
        fixed = sorted(pinned_devices(program) - {str(device), device.type})
        if fixed:
            raise ConfigError(
                f"{self.label}: the TorchScript program hard-codes device {', '.join(fixed)} in "
                f"its code (torch.jit.trace records the device it traced on), so it cannot run "
                f"on {device}: save it with torch.jit.script, or export it with torch.export "
                f"(model.pt2)"
            )
        self.program = program
        return self

    def forward(self, **features: torch.Tensor) -> Mapping[str, torch.Tensor]:
        if self.arguments is None:
            result = self.program(**features)
        else:
            result = self.program(*(features[name] for name in self.arguments))
        if isinstance(result, Mapping):
            return result
        if isinstance(result, torch.Tensor):
            result = (result,)
        if not isinstance(result, (tuple, list)) or len(result) != len(self.outputs):
            raise ModelFailure(
                f"the program returned {type(result).__name__} of "
                f"{len(result) if isinstance(result, (tuple, list)) else 1}; "
                f"config.toml declares {len(self.outputs)} output(s)"
            )
        return dict(zip(self.outputs, result))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def load_torchscript(path: Path, config: ModelConfig, label: str) -> FileModel:
    if path.suffix == ".pt2":
        return _load_exported(path, config, label)
    try:
        program = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch raises many types
        raise ConfigError(
            f"{label}: not a TorchScript file torch.jit.load can read: {_reason(exc)}"
        ) from None
    schema = program.forward.schema
    arguments = schema.arguments[1:]  # after self
    names = [argument.name for argument in arguments]
    # A packed model's batch inputs are forward's arguments too.
    declared = [spec.name for spec in config.input] + [b.name for b in config.batch_input]
    signature = f"forward({', '.join(names)})"
    unknown = [name for name in declared if name not in names]
    if unknown:
        raise ConfigError(
            f"{label}: input(s) {', '.join(unknown)} of config.toml are not "
            f"arguments of {signature}"
        )
    required = [a.name for a in arguments if not a.has_default_value() and a.name not in declared]
    if required:
        raise ConfigError(
            f"{label}: {signature} needs {', '.join(required)}, which "
            f"config.toml does not declare as inputs"
        )
    for argument in arguments:
        if argument.name in declared and str(argument.type) not in ("Tensor", "Optional[Tensor]"):
            raise ConfigError(
                f"{label}: {signature} takes {argument.name} as {argument.type}, not a Tensor"
            )
    _check_returns(schema.returns, config, label, signature)
    return FileModel(program, None, [spec.name for spec in config.output], path=path, label=label)


def pinned_devices(program: torch.jit.ScriptModule) -> set[str]:
    """The devices a TorchScript program names as constants in its code
    (a traced ``torch.arange(n)`` becomes ``device=torch.device("cpu")``)."""
    found = set()
    for node in program.inlined_graph.nodes():
        if node.kind() == "prim::Constant" and node.output().type().kind() == "DeviceObjType":
            found.add(str(node.output().toIValue()))
    return found


def _check_returns(returns: Sequence[Any], config: ModelConfig, label: str, signature: str) -> None:
    returned = returns[0].type if len(returns) == 1 else None
    count = len(config.output)
    if isinstance(returned, torch.TensorType):
        arity = 1
    elif isinstance(returned, torch.TupleType):
        arity = len(returned.elements())
    elif isinstance(returned, torch.DictType):
        return  # outputs by name: known only when it runs
    else:
        raise ConfigError(
            f"{label}: {signature} returns {returned}; expected a Tensor, a "
            f"tuple of Tensors or a Dict[str, Tensor]"
        )
    if arity != count:
        raise ConfigError(
            f"{label}: {signature} returns {arity} tensor(s); config.toml "
            f"declares {count} output(s) (a tuple maps to them by position)"
        )


_READ_ONLY_BUFFER = "The given buffer is not writable"


def _load_exported(path: Path, config: ModelConfig, label: str) -> FileModel:
    try:
        with _EXPORT_LOAD, warnings.catch_warnings():
            # torch 2.11 reads the archive's weights with torch.frombuffer over a read-only
            # buffer and warns that it is not writable; the program never writes them. Where
            # warnings are errors (python -W error, pytest), that warning refused a good model.
            warnings.filterwarnings("ignore", _READ_ONLY_BUFFER, UserWarning)
            program = torch.export.load(str(path))
    except Exception as exc:  # noqa: BLE001 - torch raises many types
        raise ConfigError(
            f"{label}: not a torch.export program torch.export.load can read: {_reason(exc)}"
        ) from None
    signature = program.graph_signature
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    arguments = list(signature.user_inputs)
    declared: dict[str, InputSpec | None] = {spec.name: spec for spec in config.input}
    declared |= {b.name: None for b in config.batch_input}  # built by the server: no spec
    if sorted(arguments) != sorted(declared):
        raise ConfigError(
            f"{label}: the program takes ({', '.join(map(str, arguments))}); "
            f"config.toml declares inputs ({', '.join(declared)})"
        )
    for name in arguments:
        given = declared[str(name)]
        if given is not None:
            value = placeholders[str(name)].meta.get("val")
            _check_fake(f"{label}: input {name!r}", given, value, given.allow_ragged_batch)
    output_node = next(node for node in program.graph.nodes if node.op == "output")
    returned = list(output_node.args[0])
    if len(returned) != len(config.output):
        raise ConfigError(
            f"{label}: the program returns {len(returned)} tensor(s); config.toml "
            f"declares {len(config.output)} output(s) (mapped by position)"
        )
    ragged = {spec.name for spec in config.input if spec.allow_ragged_batch}
    for out, node in zip(config.output, returned):
        packed = bool(out.variable_axes) and config.unpad_source(out) in ragged
        value = getattr(node, "meta", {}).get("val")
        _check_fake(f"{label}: output {out.name!r}", out, value, packed)
    return FileModel(
        program.module(),
        [str(name) for name in arguments],
        [spec.name for spec in config.output],
        path=path,
        label=label,
        exported=program,
    )


def _check_fake(what: str, spec: TensorSpec, value: Any, packed: bool = False) -> None:
    """dtype, rank and fixed axes from the program's example value (dynamic
    axes are symbols, not ints). ``packed``: an input with no batch axis."""
    if not isinstance(value, torch.Tensor):
        return
    if value.dtype != spec.dt.torch:
        raise ConfigError(
            f"{what} is {str(value.dtype).removeprefix('torch.')} in the "
            f"program, {spec.dtype} in config.toml"
        )
    if packed:  # concatenated items, no batch axis: only the rank to check
        if value.dim() != len(spec.shape):
            raise ConfigError(
                f"{what} has rank {value.dim()} in the program, {len(spec.shape)} in "
                f"config.toml (packed: allow_ragged_batch, no batch axis)"
            )
        return
    if value.dim() != 1 + len(spec.shape):
        raise ConfigError(
            f"{what} has rank {value.dim()} in the program (batch axis "
            f"included), {1 + len(spec.shape)} in config.toml"
        )
    for axis, (exported, declared) in enumerate(zip(value.shape, [0, *spec.shape])):
        if not isinstance(exported, int):
            continue
        if axis == 0 or declared == VARIABLE:
            raise ConfigError(
                f"{what}: axis {axis} is fixed at {exported} in the program; "
                f"export it as dynamic (torch.export.Dim)"
            )
        if exported != declared:
            raise ConfigError(
                f"{what}: axis {axis} is {exported} in the program, {declared} in config.toml"
            )

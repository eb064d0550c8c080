"""An ensemble's steps as a graph of tensors, checked when it loads: pure
code, no I/O, tested on made-up configs (tests/test_ensemble.py).

Every tensor of an ensemble has one producer: the request (an ensemble
input) or one step (an ``output_map`` value). A step may run once every
tensor it takes exists, so independent steps run side by side and a chain
runs in order. ``plan_ensemble`` refuses, with one sentence, an ensemble
that could not run: a step model missing (or itself an ensemble), a map
naming a tensor nobody produces or a step model's tensor that does not
exist, a dtype or shape that differs between a producer and a consumer, a
tensor produced twice, or a cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tensorserve.errors import ConfigError
from tensorserve.repository.config import ModelConfig, TensorSpec

REQUEST = 0  # the producer index of an ensemble input: the request itself


@dataclass(frozen=True)
class Candidate:
    """What the repository holds under a step's model name."""

    config: ModelConfig
    versions: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    index: int  # 1-based, in the order config.toml lists the steps
    model: str
    version: int | None  # None: whichever version the model serves
    inputs: Mapping[str, str]  # the step model's input -> the ensemble tensor it takes
    outputs: Mapping[str, str]  # the step model's output -> the ensemble tensor it makes
    label: str  # its name in metrics, stats and spans: the model, or model#index

    @property
    def where(self) -> str:
        return f"step {self.index} ({self.model!r})"


@dataclass(frozen=True)
class EnsemblePlan:
    name: str
    steps: tuple[Step, ...]
    producers: Mapping[str, int]  # tensor -> the index of the step making it (REQUEST: an input)

    def runnable(self, available: Iterable[str], started: Iterable[int]) -> list[Step]:
        """The steps not yet started whose every tensor exists."""
        have, done = set(available), set(started)
        return [s for s in self.steps if s.index not in done and set(s.inputs.values()) <= have]


def _spec_text(spec: TensorSpec) -> str:
    return f"{spec.dtype} of shape {list(spec.shape)}"


def _fits(produced: TensorSpec, taken: TensorSpec) -> bool:
    """Same dtype and rank; each axis equal, or variable on either side."""
    if produced.dtype != taken.dtype or len(produced.shape) != len(taken.shape):
        return False
    return all(a == b or -1 in (a, b) for a, b in zip(produced.shape, taken.shape))


def _labels(models: list[str]) -> list[str]:
    return [m if models.count(m) == 1 else f"{m}#{i}" for i, m in enumerate(models, 1)]


def plan_ensemble(
    name: str, config: ModelConfig, candidates: Mapping[str, Candidate]
) -> EnsemblePlan:
    """The ensemble's plan, or ``ConfigError`` naming the ensemble and why.
    ``candidates``: the repository's configs of the step models (a name
    absent from it is a model the repository does not have)."""
    assert config.ensemble_scheduling is not None  # platform = "ensemble" (config.py)
    written = config.ensemble_scheduling.step
    labels = _labels([s.model_name for s in written])
    steps = tuple(
        Step(
            i,
            s.model_name,
            None if s.model_version == -1 else s.model_version,
            dict(s.input_map),
            dict(s.output_map),
            label,
        )
        for (i, s), label in zip(enumerate(written, 1), labels)
    )
    try:
        producers = _check(name, config, steps, candidates)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return EnsemblePlan(name, steps, producers)


def _check(
    name: str, config: ModelConfig, steps: tuple[Step, ...], candidates: Mapping[str, Candidate]
) -> dict[str, int]:
    made: dict[str, tuple[int, TensorSpec]] = {s.name: (REQUEST, s) for s in config.input}
    for step in steps:
        _check_model(name, step, candidates)
        step_config = candidates[step.model].config
        outputs = {s.name: s for s in step_config.output}
        for output, tensor in step.outputs.items():
            if output not in outputs:
                raise ValueError(
                    f"{step.where}: output_map names {output!r}, which is not an output of "
                    f"{step.model!r} (its outputs: {', '.join(outputs)})"
                )
            if tensor in made:
                first = made[tensor][0]
                by = "an input of the ensemble" if first == REQUEST else f"step {first}"
                raise ValueError(
                    f"{step.where}: output_map makes tensor {tensor!r}, which {by} already makes"
                )
            made[tensor] = (step.index, outputs[output])
    for step in steps:
        inputs = {s.name: s for s in candidates[step.model].config.input}
        for taken, tensor in step.inputs.items():
            if taken not in inputs:
                raise ValueError(
                    f"{step.where}: input_map names {taken!r}, which is not an input of "
                    f"{step.model!r} (its inputs: {', '.join(inputs)})"
                )
            if tensor not in made:
                raise ValueError(
                    f"{step.where}: input_map takes tensor {tensor!r}, which no step produces "
                    f"and which is not an input of the ensemble"
                )
            _check_fit(made, tensor, inputs[taken], f"{step.where} input {taken!r}")
        unfed = [s for s in inputs if s not in step.inputs]
        if unfed:
            raise ValueError(
                f"{step.where}: input {unfed[0]!r} of {step.model!r} is not in its input_map"
            )
    for out in config.output:
        if out.name not in made or made[out.name][0] == REQUEST:
            raise ValueError(f"output {out.name!r} of the ensemble is produced by no step")
        _check_fit(made, out.name, out, f"output {out.name!r} of the ensemble")
    _check_acyclic(steps, {tensor: index for tensor, (index, _) in made.items()})
    return {tensor: index for tensor, (index, _) in made.items()}


def _check_model(name: str, step: Step, candidates: Mapping[str, Candidate]) -> None:
    if step.model == name:
        raise ValueError(f"{step.where}: an ensemble cannot run itself")
    candidate = candidates.get(step.model)
    if candidate is None:
        raise ValueError(f"{step.where}: there is no model {step.model!r} in the repository")
    if candidate.config.platform == "ensemble":
        raise ValueError(
            f"{step.where}: {step.model!r} is an ensemble; a step runs a model (nested "
            f"ensembles are not supported)"
        )
    if step.version is not None and step.version not in candidate.versions:
        have = ", ".join(map(str, candidate.versions)) or "none"
        raise ValueError(
            f"{step.where}: model {step.model!r} has no version {step.version} (it has {have})"
        )


def _check_fit(
    made: Mapping[str, tuple[int, TensorSpec]], tensor: str, taken: TensorSpec, consumer: str
) -> None:
    index, produced = made[tensor]
    if _fits(produced, taken):
        return
    source = "an input of the ensemble" if index == REQUEST else f"made by step {index}"
    raise ValueError(
        f"{consumer} takes {_spec_text(taken)}, but tensor {tensor!r} ({source}) is "
        f"{_spec_text(produced)}"
    )


def _check_acyclic(steps: tuple[Step, ...], producers: Mapping[str, int]) -> None:
    """Every step can run once the ones before it have: else name a cycle."""
    available = {t for t, index in producers.items() if index == REQUEST}
    started: set[int] = set()
    by_index = {s.index: s for s in steps}
    while True:
        ready = [s for s in steps if s.index not in started and set(s.inputs.values()) <= available]
        if not ready:
            break
        for step in ready:
            started.add(step.index)
            available.update(step.outputs.values())
    stuck = [s for s in steps if s.index not in started]
    if not stuck:
        return
    # Each stuck step waits on a tensor of another stuck step: walk back until one repeats.
    path: list[Step] = [stuck[0]]
    while True:
        waiting = next(t for t in path[-1].inputs.values() if t not in available)
        before = by_index[producers[waiting]]
        if before in path:
            cycle = path[path.index(before) :] + [before]
            cycle.reverse()  # in the order the tensors would flow
            raise ValueError("the steps form a cycle: " + " -> ".join(s.where for s in cycle))
        path.append(before)

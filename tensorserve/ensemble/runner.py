"""``Ensemble``: a served model whose requests run other models' steps.

The data plane calls it as it calls a ``ServedModel`` (``infer_many``); for
each request it validates the items against the ensemble's inputs, then
runs every step whose tensors exist, several at once when the graph allows
(``graph.py``), each through its own model's public ``infer_many``. So a
step's items join that model's queue with every other caller's, are batched
and padded there, and come back un-padded; the intermediate tensors never
leave the server.

A request's deadline is one for all its steps (each is given what is left),
its priority and parameters go to every step (each model reads its own),
and a caller that leaves cancels the running steps, whose queued items are
withdrawn by their batchers. A step that fails fails this request only,
with its error's class and the step named: other callers' items in the same
batches are the batcher's to keep (it pins a failure on the items causing
it). Nothing here owns a thread or a model: the steps' models belong to the
registry, and a step model that is unloaded or reloaded is looked up anew
by the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from tensorserve.ensemble.graph import EnsemblePlan, Step
from tensorserve.ensemble.stats import EnsembleStats
from tensorserve.ensemble.tracer import StepTracer
from tensorserve.errors import DeadlineExceeded, TensorServeError
from tensorserve.repository.config import ModelConfig
from tensorserve.settings import DEFAULT_BYTES_LIMITS, BytesLimits
from tensorserve.wire.validate import validate_item

Item = Mapping[str, Any]
Row = dict[str, Any]  # one item's tensors by ensemble tensor name


class StepModel(Protocol):
    """What a step needs of its model: ``ServedModel``'s public async API."""

    version: int

    async def infer_many(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[dict[str, np.ndarray]]: ...

    def health(self) -> str | None: ...


# (model, version or None) -> the model serving it now; raises ModelNotFound
# or ModelNotReady (the registry's ready_model, with the version checked).
StepLookup = Callable[[str, "int | None"], StepModel]


def in_step(exc: TensorServeError, where: str) -> TensorServeError:
    """``exc`` again, its message prefixed with ``where``: a copy, as one
    error may answer every caller of a failed batch."""
    named = copy.copy(exc)
    named.message = f"{where}: {exc.message}"
    named.args = (named.message,)
    return named


class Ensemble:
    def __init__(
        self,
        name: str,
        config: ModelConfig,
        plan: EnsemblePlan,
        lookup: StepLookup,
        *,
        version: int = 1,
        tracer: StepTracer | None = None,
    ) -> None:
        self.name, self.version, self.config = name, version, config
        self.plan = plan
        self.lookup = lookup
        self.tracer = tracer  # None: tracing is off
        self.stats = EnsembleStats([(s.label, s.model) for s in plan.steps])

    # -- what the registry and the data plane ask of any served model ----------

    @property
    def devices(self) -> list[str]:
        return []  # it runs nothing itself: its steps' models report theirs

    def health(self) -> str | None:
        """Why a request could not run now: the first step whose model is
        missing, not ready, or cannot run a batch (None: every one can)."""
        for step in self.plan.steps:
            try:
                why = self.lookup(step.model, step.version).health()
            except TensorServeError as exc:
                why = exc.message
            if why is not None:
                return f"{step.where}: {why}"
        return None

    def stuck_instances(self) -> list[tuple[int, float]]:
        return []  # no instances: a stuck step is its model's (serving/liveness.py)

    def refuse_if_late(self) -> None:
        """Nothing: each step model's own latency target refuses its items."""

    def start(self) -> Ensemble:
        return self

    def close(self) -> None:
        """Nothing to stop: the steps' models are the registry's."""

    # -- inference --------------------------------------------------------------

    async def infer_many(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[dict[str, np.ndarray]]:
        """Each item's ensemble outputs, in order; ``InvalidInput`` for a bad
        item before any step runs; a step's error, naming the step."""
        inputs = self.config.input
        rows: list[Row] = [
            validate_item(item, inputs, i, bytes_limits) for i, item in enumerate(items)
        ]
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        call = _Call(priority, parameters, bytes_limits, deadline)
        try:
            await self._run_graph(rows, call)
        except asyncio.CancelledError:
            raise  # the caller left: neither a success nor a failure of the ensemble
        except BaseException:
            self.stats.request_done(len(rows), time.monotonic() - started, True, 0)
            raise
        now_ms = int(time.time() * 1000)
        self.stats.request_done(len(rows), time.monotonic() - started, False, now_ms)
        names = [out.name for out in self.config.output]
        return [{name: row[name] for name in names} for row in rows]

    async def _run_graph(self, rows: list[Row], call: _Call) -> None:
        available = {s.name for s in self.config.input}
        launched: set[int] = set()
        running: dict[asyncio.Task[list[dict[str, Any]]], Step] = {}
        try:
            while True:
                for step in self.plan.runnable(available, launched):
                    launched.add(step.index)
                    running[asyncio.ensure_future(self._run_step(step, rows, call))] = step
                if not running:
                    return
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    results = task.result()  # a step's error ends the request here
                    for row, result in zip(rows, results):
                        for output, tensor in step.outputs.items():
                            row[tensor] = result[output]
                    available.update(step.outputs.values())
        finally:
            # Failed or cancelled (the caller left): the other steps stop, and
            # their batchers withdraw whatever of this request is still queued.
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _run_step(self, step: Step, rows: list[Row], call: _Call) -> list[dict[str, Any]]:
        where = f"ensemble {self.name!r} {step.where}"
        started = time.perf_counter()
        outcome: bool | None = False  # succeeded; None: cancelled (the caller left), not counted
        span = self.tracer.step(step.label, step.model) if self.tracer else contextlib.nullcontext()
        try:
            with span:
                timeout = call.remaining(where)
                model = self.lookup(step.model, step.version)
                items = [{name: row[t] for name, t in step.inputs.items()} for row in rows]
                results = await model.infer_many(
                    items,
                    timeout=timeout,
                    priority=call.priority,
                    parameters=call.parameters,
                    bytes_limits=call.bytes_limits,
                )
            outcome = True
            return results
        except asyncio.CancelledError:
            outcome = None
            raise
        except TensorServeError as exc:
            raise in_step(exc, where) from exc
        finally:
            if outcome is not None:
                seconds = time.perf_counter() - started
                self.stats.step_done(step.label, len(rows), seconds, failed=not outcome)


class _Call:
    """What every step of one request is given."""

    __slots__ = ("bytes_limits", "deadline", "parameters", "priority")

    def __init__(
        self,
        priority: int | None,
        parameters: Mapping[str, Any] | None,
        bytes_limits: BytesLimits,
        deadline: float | None,
    ) -> None:
        self.priority, self.parameters = priority, parameters
        self.bytes_limits = bytes_limits
        self.deadline = deadline  # time.monotonic(); None: none

    def remaining(self, where: str) -> float | None:
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{where}: the request's deadline passed before the step")
        return left

"""``ServedModel``: one model behind its dynamic batcher, usable in-process.

This is the public Python API; the HTTP server is just one of its callers.

    from tensorserve import ServedModel

    # a repository model
    with ServedModel.from_repository("model_repository", "tagger") as tagger:
        out = tagger.infer_sync({"input_ids": ids, "attention_mask": mask})

    # any batch function, given its inputs' pad values
    def double(x):                       # x: padded [batch, T] tensor
        return x * 2
    model = ServedModel.from_function(
        double,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
        max_batch_size=16, max_queue_delay_ms=2,
    )
    async with model:
        rows = await model.infer_many([{"x": a}, {"x": b}])   # un-padded, in order

Items are validated (dtype, rank, fixed axes, length bounds) before they are
queued, so a bad item raises ``InvalidInput`` for its caller alone. So are a
request's ``parameters``, against the model's ``[[request_parameter]]``
declarations: every item of the request carries the values to ``forward``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tensorserve.batching.admission import BatcherOptions
from tensorserve.batching.batcher import Batcher
from tensorserve.batching.packing import make_collator
from tensorserve.batching.policy import make_policy
from tensorserve.batching.stats import BatchStats
from tensorserve.repository.config import (
    TORCH_COMPILE_MODES,
    VARIABLE,
    DynamicBatching,
    ModelConfig,
    parse_config,
)
from tensorserve.repository.device_defaults import for_device
from tensorserve.repository.loader import ModelSource, discover, read_config
from tensorserve.runtime.cuda_diagnosis import warn_auto_on_cpu
from tensorserve.runtime.device import default_intra_op_threads, resolve_device
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.isolated import ProcessExecutor
from tensorserve.runtime.kinds import ExecutorRequest, build_executor
from tensorserve.runtime.placement import PlacedExecutor, resolve_isolation, resolve_placement
from tensorserve.serving.warmup import instance_devices, warmed_instances
from tensorserve.settings import DEFAULT_BYTES_LIMITS, BytesLimits
from tensorserve.wire.validate import priority_level, validate_item, validate_parameters

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self: Python 3.11

log = logging.getLogger(__name__)


def _watchdog_seconds(config: ModelConfig) -> float | str | None:
    """The watchdog's limit for the batcher. "auto" is off for a model that
    torch.compile compiles: it compiles at a new shape's first batch, which
    may take minutes and is not a hang (give a number to watch it anyway).
    A CUDA graph's capture (compile "auto", "reduce-overhead") takes well
    under the watchdog's least automatic limit, so it stays on."""
    watchdog_ms = config.faults.watchdog_ms
    if watchdog_ms == "auto":
        return None if config.compile in TORCH_COMPILE_MODES else "auto"
    return float(watchdog_ms) / 1000 or None


Item = Mapping[str, Any]
Result = dict[str, np.ndarray]


class ServedModel:
    def __init__(
        self,
        name: str,
        config: ModelConfig,
        fn: Callable[..., Any] | None,
        *,
        executor: ThreadExecutor | ProcessExecutor | PlacedExecutor | None = None,
        version: int = 1,
        on_fatal: Callable[[BaseException], None] | None = None,
        intra_op_threads: int | None = None,
    ) -> None:
        """Serve ``fn`` (a batch function or ``nn.Module``) on instance threads, or
        give a ready ``executor`` (a ``ProcessExecutor`` for isolated models)."""
        self.name = name
        self.version = version
        # instance_group: one device -> that device and count; several -> placements.
        config, placements = resolve_placement(config)
        if config.isolation == "auto":  # a function handed over here runs in a thread
            config = config.model_copy(update={"isolation": "thread"})
        self.device = resolve_device(placements[0].device)
        # What the config leaves to the server (a budget of "auto", lengths
        # unrounded) suits this device: the batcher and collator see the result.
        self.config = config = for_device(config, self.device.type)
        if placements[0].device == "auto" and self.device.type == "cpu":
            warn_auto_on_cpu()
        self.stats = BatchStats()
        self.fn: Callable[..., Any] | None = fn if executor is not None else None
        if executor is None:  # a batch function handed over: the thread kind runs it
            if fn is None:
                raise TypeError("ServedModel needs a batch function or an executor")
            threads = intra_op_threads or default_intra_op_threads()
            built = build_executor(
                config.isolation, ExecutorRequest(name, config, placements, threads, fn=fn)
            )
            executor, self.fn = built.executor, built.fn
        self.executor = executor
        batching = config.dynamic_batching
        options = BatcherOptions(
            max_batch_size=max(1, config.max_batch_size),  # 0: one item per batch
            max_queue_delay_ms=batching.max_queue_delay_ms,
            dispatch=batching.dispatch,
            policy=make_policy(batching.policy, batching.max_batch_tokens, config.packed),
            max_queue_size=batching.max_queue_size,
            max_batch_elements=batching.max_batch_elements,
            priority_levels=batching.priority_levels,
            target_p99_ms=batching.target_p99_ms,
            split_failed_batches=config.faults.split_failed_batches,
            watchdog_s=_watchdog_seconds(config),
        )
        self.batcher = Batcher(
            executor,
            make_collator(config, pin_memory=executor.pin_memory),
            options,
            name=name,
            stats=self.stats,
            on_fatal=on_fatal,
        )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        inputs: Sequence[Mapping[str, Any]],
        outputs: Sequence[Mapping[str, Any]],
        name: str = "function",
        **config: Any,
    ) -> ServedModel:
        """Batch any callable ``fn(**padded_features)``; ``config`` takes the
        config.toml fields (``max_batch_size``, ``device``, ``dynamic_batching``...)
        and, for convenience, the ``dynamic_batching`` ones at top level."""
        batching = {k: config.pop(k) for k in list(config) if k in DynamicBatching.model_fields}
        data = {"input": list(inputs), "output": list(outputs), "device": "cpu", **config}
        data["dynamic_batching"] = {**data.get("dynamic_batching", {}), **batching}
        return cls(name, parse_config(data, f"{name} (from_function)"), fn)

    @classmethod
    def from_repository(
        cls, repository: str | Path, name: str, version: int | None = None, **overrides: Any
    ) -> ServedModel:
        sources = discover(Path(repository))
        if name not in sources:
            raise KeyError(f"no model {name!r} in {repository}; found {', '.join(sources)}")
        return cls.from_source(sources[name], version, read_config(sources[name], overrides))

    @classmethod
    def from_source(
        cls,
        source: ModelSource,
        version: int | None,
        config: ModelConfig,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        intra_op_threads: int | None = None,
    ) -> ServedModel:
        """Load one version of a repository model: here (``isolation = "thread"``)
        or in worker processes that load it themselves (``"process"``)."""
        threads = intra_op_threads or default_intra_op_threads()
        config, placements = resolve_placement(config)
        config = resolve_isolation(config, placements)
        built = build_executor(
            config.isolation,
            ExecutorRequest(
                source.name, config, placements, threads, source=source, version=version
            ),
        )
        try:
            return cls(
                source.name,
                config,
                built.fn,
                executor=built.executor,
                version=built.version,
                on_fatal=on_fatal,
            )
        except BaseException:
            built.executor.close()  # no worker outlives a model that failed to build
            raise

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> Self:
        """Serve: its scheduler runs on ``loop`` (the server's), or on a
        private loop of its own."""
        self.batcher.start(loop)
        return self

    def close(self) -> None:
        self.batcher.close()  # queued items run first
        self.executor.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self.start(asyncio.get_running_loop())

    async def __aexit__(self, *exc: object) -> None:
        # Not on the loop's thread: the scheduler runs on this loop, and its
        # queued batches must be able to finish while close() waits.
        await asyncio.to_thread(self.close)

    def health(self) -> str | None:
        """Why the model cannot run a batch now (None: it can): every worker
        down, or every instance stuck in a batch (docs/reliability.md)."""
        return self.batcher.scheduler.watchdog.health() or self.executor.health()

    @property
    def devices(self) -> list[str]:
        """Where the instances run, resolved ("cpu", "cuda", "cuda:1"): what
        ``auto`` became, for metadata and metrics."""
        if isinstance(self.executor, PlacedExecutor):
            return list(dict.fromkeys(str(d) for d in self.executor.devices()))
        if isinstance(self.executor, ProcessExecutor) and len(set(self.executor.device_of)) > 1:
            return list(dict.fromkeys(self.executor.device_of))  # placed: cuda:N or cpu
        return [str(self.device)]

    def stuck_instances(self) -> list[tuple[int, float]]:
        """(instance, seconds) for each instance stuck in a forward that the
        watchdog could not stop: only a restart of the process frees it."""
        return self.batcher.scheduler.watchdog.stuck()

    # ------------------------------------------------------------------ inference
    def validate(
        self,
        items: Sequence[Item],
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[dict[str, np.ndarray]]:
        """Each item checked by the one validator (``wire.validate``); a bytes
        input bounded by ``bytes_limits`` (the server's settings, which the
        data plane passes)."""
        inputs = self.config.input
        return [validate_item(item, inputs, i, bytes_limits) for i, item in enumerate(items)]

    def priority_level(self, priority: Any) -> int:
        """A request's ``priority`` as the batcher's level
        (``wire.validate.priority_level``, the one priority rule)."""
        return priority_level(priority, self.config.dynamic_batching, self.name)

    def request_parameters(self, parameters: Mapping[str, Any] | None) -> dict[str, Any]:
        """A request's values of the parameters the model declares, defaults
        filled in ({} for a model that declares none: its forward gets no
        new arguments). ``InvalidInput`` names a parameter that is missing
        or of the wrong type; undeclared keys are ignored."""
        specs = self.config.request_parameter
        return validate_parameters(parameters, specs, self.name) if specs else {}

    def refuse_if_late(self, count: bool = True) -> None:
        """Before a request is read: ``WouldMissTarget`` (503) if the model's
        latency target would be missed even by one item at the highest
        priority. Nothing without a target. Refused before its body is read
        and decoded, a request costs the front end least. Not while the
        model stops or cannot run a batch: its admission answers those
        (model_not_ready), and being late is not their reason. ``count``:
        False for a question that refuses nobody (``frontends/table.py``)."""
        scheduler = self.batcher.scheduler
        if scheduler.target is not None and scheduler.watchdog.can_admit:
            scheduler.queue.refuse_if_late(None, 1, count)

    def submit_many(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> list[Future]:
        level, values = self.priority_level(priority), self.request_parameters(parameters)
        return self.batcher.submit_many(
            self.validate(items), timeout=timeout, priority=level, parameters=values
        )

    async def infer_many(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[Result]:
        """Each item's outputs, in order. A model that returns output
        parameters gives ``RowResult``s: dicts with a ``parameters`` map."""
        level, values = self.priority_level(priority), self.request_parameters(parameters)
        return await self.batcher.infer_many(
            self.validate(items, bytes_limits),
            timeout=timeout,
            priority=level,
            parameters=values,
        )

    async def infer(
        self,
        item: Item,
        *,
        timeout: float | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> Result:
        return (await self.infer_many([item], timeout=timeout, parameters=parameters))[0]

    def infer_many_sync(
        self,
        items: Sequence[Item],
        *,
        timeout: float | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> list[Result]:
        futures = self.submit_many(items, timeout=timeout, parameters=parameters)
        try:
            return [f.result(timeout) for f in futures]
        finally:
            for f in futures:
                f.cancel()

    def infer_sync(
        self,
        item: Item,
        *,
        timeout: float | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> Result:
        return self.infer_many_sync([item], timeout=timeout, parameters=parameters)[0]

    # ------------------------------------------------------------------ warm-up
    def warmup_items(self, config: ModelConfig | None = None) -> list[list[dict[str, np.ndarray]]]:
        """Batches over a small grid of sizes and lengths, so the first real
        request pays no allocator growth or lazy initialisation."""
        config = config or self.config  # a text model's: the tokenized one
        grid = config.warmup
        sizes = grid.batch_sizes or sorted({1, max(1, config.max_batch_size)})
        # A warm-up request must fit the queue, as any request must.
        sizes = sorted({min(size, config.dynamic_batching.max_queue_size) for size in sizes})
        batches = []
        for length in grid.lengths:
            for size in sizes:
                item = {}
                for spec in config.input:
                    limit = spec.max_length or length
                    shape = [min(length, limit) if d == VARIABLE else d for d in spec.shape]
                    item[spec.name] = np.full(shape, spec.warmup_value, dtype=spec.dt.numpy)
                batches.append([item] * size)
        return batches

    def warmup(self) -> None:
        """The grid on each instance that needs its own warm-up, in turn
        (``warmup.warmed_instances``: every one on a GPU), before traffic
        (the server's registry takes the GPUs' turns around it: ``warmup.turns_on``)."""
        for instance in warmed_instances(instance_devices(self.executor)):
            with self.batcher.pinned(instance):
                for batch in self.warmup_items():
                    self.warm(batch)
        self.stats.reset()  # stats describe real traffic only
        self.batcher.warmed_up()  # a model's first runs are slow: learn from real traffic

    def warm(self, batch: list[dict[str, np.ndarray]]) -> None:
        """Run one warm-up batch to its end."""
        # A required parameter has no default to warm up with: zero, False or "".
        zero = {"bool": False, "int": 0, "float": 0.0, "string": ""}
        parameters = {
            spec.name: zero[spec.type] for spec in self.config.request_parameter if spec.required
        }
        self.infer_many_sync(batch, timeout=600, parameters=parameters)

"""The registry: every model of the repository, with its state and reason.

A model that fails to load (bad config, import error, weight mismatch,
failed warm-up) does not stop the others: it is kept as FAILED with the
reason, reported on its ready/metadata endpoints and logged.

Loading (import, weights, warm-up) runs in a worker thread so the server
answers liveness while models load. An ensemble (``platform = "ensemble"``)
loads after the other models: it is checked against its step models'
configs and served by an ``Ensemble`` that looks its steps up here. Reload swaps the new version in and
then closes the old one, whose queued and in-flight requests finish first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorserve.batching.tracer import BatchTracer
from tensorserve.ensemble import Candidate, Ensemble, plan_ensemble
from tensorserve.ensemble.tracer import StepTracer
from tensorserve.errors import ConfigError, ModelNotFound, ModelNotReady
from tensorserve.pools import on_control_pool
from tensorserve.repository.config import ModelConfig, load_config
from tensorserve.repository.loader import ModelSource, discover, read_config, resolve_version
from tensorserve.runtime import shared_workers
from tensorserve.serving.entries import ModelState, lookup, ready
from tensorserve.serving.model import ServedModel
from tensorserve.serving.text import TextServedModel
from tensorserve.serving.warmup import instance_devices, turns_on

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    name: str
    state: ModelState
    reason: str = ""
    # What serves its requests: a model behind its batcher, or an ensemble of them.
    served: ServedModel | Ensemble | None = None
    config: ModelConfig | None = None
    version: int | None = None
    load_seconds: float | None = None  # the last successful load's duration (metrics)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"name": self.name, "state": self.state.value}
        if self.version is not None:
            described["version"] = str(self.version)
        if self.reason:
            described["reason"] = self.reason
        return described


class ModelRegistry:
    def __init__(
        self,
        repository: Path,
        overrides: dict[str, Any] | None = None,
        *,
        intra_op_threads: int | None = None,
        default_device: str = "auto",
        batch_tracer: Callable[[str, int], BatchTracer] | None = None,
        step_tracer: Callable[[str, int], StepTracer] | None = None,
    ) -> None:
        self.repository = repository
        self.overrides = overrides or {}
        self.default_device = default_device  # --device: what a model's "auto" becomes
        self.intra_op_threads = intra_op_threads
        # (model, version) -> its batches' tracer, when tracing is on (tensorserve/tracing/).
        self.batch_tracer = batch_tracer
        self.step_tracer = step_tracer  # (ensemble, version) -> its steps' tracer
        self.entries: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ lookups
    def get(self, name: str, version: str | None = None) -> ModelEntry:
        return lookup(self.entries, name, version)

    def ready_model(self, name: str, version: str | None = None) -> ServedModel | Ensemble:
        """The model to send a request to: ``ModelNotFound`` if there is no
        such model (or version), ``ModelNotReady`` (with its state and reason)
        if it cannot take requests now. A lookup, not a yes/no question: for
        that, see ``not_ready`` and ``ServedModel.health``."""
        served: ServedModel | Ensemble = ready(lookup(self.entries, name, version))
        return served

    def step_model(self, name: str, version: int | None) -> ServedModel:
        """An ensemble step's model (``ensemble.runner.StepLookup``): served
        now, and at ``version`` when the step names one."""
        served = self.ready_model(name)
        if not isinstance(served, ServedModel):  # refused at load; a reload may change it
            raise ModelNotReady(f"model {name!r} is an ensemble, not a model a step can run")
        if version is not None and served.version != version:
            raise ModelNotReady(
                f"model {name!r} serves version {served.version}, not version {version}"
            )
        return served

    @property
    def all_ready(self) -> bool:
        return not self.not_ready()

    def not_ready(self) -> dict[str, str]:
        """Why each model that should serve cannot run a batch now (empty: the
        server is ready). A model unloaded through the API is not expected to
        serve; one that failed to load, is loading, or whose workers are all
        down or stuck is."""
        problems = {}
        for entry in self.entries.values():
            if entry.state in (ModelState.UNAVAILABLE, ModelState.UNLOADING):
                continue
            why = self.health(entry)
            if why is not None:
                problems[entry.name] = why
        return problems

    @staticmethod
    def health(entry: ModelEntry) -> str | None:
        """Why this model cannot run a batch now (None: it can)."""
        if entry.state is not ModelState.READY or entry.served is None:
            return f"{entry.state.value}: {entry.reason}" if entry.reason else entry.state.value
        return entry.served.health()

    def index(self) -> list[dict[str, Any]]:
        self._rescan()
        return [e.describe() for e in sorted(self.entries.values(), key=lambda e: e.name)]

    def _rescan(self) -> dict[str, ModelSource]:
        """Models added to the repository on disk show up as UNAVAILABLE."""
        sources = discover(self.repository)
        for name in sources:
            self.entries.setdefault(name, ModelEntry(name, ModelState.UNAVAILABLE))
        return sources

    # ------------------------------------------------------------------ load / unload
    async def load_all(self) -> None:
        try:
            names = list(self._rescan())
        except ConfigError as exc:
            log.error("%s", exc)
            raise
        for name in names:
            self.entries[name].state = ModelState.LOADING
        ensembles = [name for name in names if _is_ensemble(self.repository / name)]
        try:
            await asyncio.gather(*(self.load(name) for name in names if name not in ensembles))
        finally:
            # A template spawned ahead (tensorserve.cli) stays only if a model took it.
            await on_control_pool(shared_workers.end_prestart)
        await asyncio.gather(*(self.load(name) for name in ensembles))  # on loaded steps

    async def load(self, name: str) -> ModelEntry:
        """Load (or reload) a model; on failure it is FAILED with the reason."""
        if name not in self.entries:
            self._rescan()  # a folder added since: its entry (and its lock) now
        async with self._lock(name):
            sources = self._rescan()
            if name not in sources:
                raise ModelNotFound(f"no model {name!r} in the repository")
            entry = self.entries[name]
            old = entry.served
            if old is None:
                entry.state = ModelState.LOADING
            started = time.monotonic()
            try:
                served = await on_control_pool(
                    self._build, sources[name], asyncio.get_running_loop()
                )
            except Exception as exc:  # noqa: BLE001 - reported; the others still load
                reason = (
                    str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
                )
                log.error(
                    "model %s failed to load after %.2f s: %s",
                    name,
                    time.monotonic() - started,
                    reason,
                )
                if old is None:
                    entry.state, entry.reason = ModelState.FAILED, reason
                    entry.served = None
                return entry  # a failed reload keeps serving the old version
            entry.served, entry.config, entry.version = served, served.config, served.version
            entry.state, entry.reason = ModelState.READY, ""
            entry.load_seconds = time.monotonic() - started
            log.info(
                "model %s version %s ready on %s (loaded in %.2f s)",
                name,
                served.version,
                ", ".join(served.devices) or "its steps' models",
                entry.load_seconds,
            )
            if old is not None:
                await on_control_pool(old.close)
            return entry

    def _build(
        self, source: ModelSource, loop: asyncio.AbstractEventLoop
    ) -> ServedModel | Ensemble:
        """Load and start a model (on a thread); its scheduler runs on
        ``loop``, the server's, so a request reaches its batch with no
        thread hand-off."""
        config = read_config(source, self.overrides, self.default_device)
        if config.platform == "ensemble":
            return self._build_ensemble(source, config)
        kind = TextServedModel if config.tokenizes_text else ServedModel
        served = kind.from_source(
            source,
            None,
            config,
            on_fatal=functools.partial(self._mark_failed, source.name),
            intra_op_threads=self.intra_op_threads,
        )
        if self.batch_tracer is not None:
            served.batcher.scheduler.tracer = self.batch_tracer(source.name, served.version)
        # On a GPU one model starts and warms up at a time: its forward's timing
        # for compile = "auto" (a worker's as it starts) and its captures run alone.
        with turns_on(instance_devices(served.executor), source.name):
            served.start(loop)
            if config.warmup.enabled:
                try:
                    served.warmup()
                except Exception as exc:
                    served.close()
                    raise ConfigError(f"{source.name}: warm-up failed: {exc}") from exc
        return served

    def _build_ensemble(self, source: ModelSource, config: ModelConfig) -> Ensemble:
        """Checked against its step models' configs as the repository holds
        them (loaded or not: an ensemble does not depend on load order)."""
        version = resolve_version(source, None)  # its empty version folder, as in Triton
        assert config.ensemble_scheduling is not None
        sources = discover(self.repository)
        candidates = {}
        for step in config.ensemble_scheduling.step:
            step_source = sources.get(step.model_name)
            if step_source is None:
                continue  # plan_ensemble names it
            try:
                step_config = read_config(step_source, self.overrides, self.default_device)
            except ConfigError as exc:
                raise ConfigError(
                    f"{source.name}: step model {step.model_name!r} has an invalid config: {exc}"
                ) from None
            candidates[step.model_name] = Candidate(step_config, step_source.versions)
        plan = plan_ensemble(source.name, config, candidates)
        tracer = self.step_tracer(source.name, version) if self.step_tracer else None
        return Ensemble(source.name, config, plan, self.step_model, version=version, tracer=tracer)

    def _mark_failed(self, name: str, exc: BaseException) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.state, entry.reason = ModelState.FAILED, f"batcher failed: {exc!r}"

    async def unload(self, name: str) -> None:
        self.get(name)  # an unknown name: ModelNotFound, before any lock is made for it
        async with self._lock(name):
            entry = self.get(name)
            served, entry.served = entry.served, None
            entry.state, entry.reason = ModelState.UNLOADING, ""
            started = time.monotonic()
            if served is not None:
                await on_control_pool(served.close)  # queued requests finish first
            entry.state = ModelState.UNAVAILABLE
            log.info("model %s unloaded in %.2f s", name, time.monotonic() - started)

    async def remove(self, name: str) -> None:
        """A model whose folder left the repository (poll mode): unloaded, then
        no longer listed."""
        if name not in self.entries:
            return
        await self.unload(name)
        async with self._lock(name):
            self.entries.pop(name, None)

    async def close(self) -> None:
        await asyncio.gather(
            *(on_control_pool(e.served.close) for e in self.entries.values() if e.served)
        )

    def _lock(self, name: str) -> asyncio.Lock:
        """The lock of a model this registry knows (a folder of the
        repository, seen by a scan); ``ModelNotFound`` for any other name,
        with nothing made for it: names asked for by callers must not grow
        this without bound."""
        lock = self._locks.get(name)
        if lock is None:
            if name not in self.entries:
                raise ModelNotFound(f"no model {name!r} in the repository")
            lock = self._locks[name] = asyncio.Lock()
        return lock


def _is_ensemble(folder: Path) -> bool:
    """Whether a model's config asks for an ensemble (an unreadable one: no,
    its own load reports why)."""
    try:
        return load_config(folder / "config.toml").platform == "ensemble"
    except ConfigError:
        return False

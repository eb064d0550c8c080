"""Putting a server's data plane together: its registry, liveness, metrics
and tracer (``build_plane``), and serving its models for as long as it runs
(``models_served``: load, poll, close). The HTTP app does both in one
process; with ``--frontends N`` the scheduler process does (it serves no
HTTP itself), and each front-end process builds a plane that asks it
(``frontends/``)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tensorserve.dataplane.lag import LoopLag
from tensorserve.dataplane.plane import DataPlane
from tensorserve.metrics import Metrics
from tensorserve.serving.liveness import Liveness
from tensorserve.serving.poller import RepositoryPoller
from tensorserve.serving.registry import ModelRegistry
from tensorserve.settings import Settings
from tensorserve.tracing import configure as configure_tracing


def build_plane(settings: Settings, role: str = "server") -> tuple[DataPlane, LoopLag]:
    """A plane whose models live in this process; ``role`` labels this
    process's CPU and loop lag ("server", or "scheduler" under front ends)."""
    tracer = configure_tracing(settings)  # None unless an OTLP endpoint is set
    registry = ModelRegistry(
        settings.model_repository,
        settings.model_overrides(),
        intra_op_threads=settings.intra_op_threads,
        default_device=settings.device,
        batch_tracer=tracer.batch_tracer if tracer is not None else None,
        step_tracer=tracer.ensemble_tracer if tracer is not None else None,
    )
    liveness = Liveness(registry, settings.liveness_stall_s)
    # The loop's (gRPC's calls run on it too); exported, dataplane/lag.py.
    loop_lag = LoopLag(LoopLag.SCHEDULER_INTERVAL_S if role == "scheduler" else LoopLag.INTERVAL_S)
    metrics = Metrics(registry, liveness, loop_lag=lambda: loop_lag.seconds, role=role)
    return DataPlane(settings, registry, metrics, liveness, tracer), loop_lag


@asynccontextmanager
async def models_served(
    plane: DataPlane, loop_lag: LoopLag, wait_for_models: bool = False
) -> AsyncIterator[None]:
    """Load every model (in the background unless ``wait_for_models``),
    poll the repository in poll mode, measure the loop's lag; on exit stop
    those and close the models (queued items withdrawn, workers stopped)."""
    settings, registry, tracer = plane.settings, plane.registry, plane.tracer
    poller = None
    if settings.model_control_mode == "poll":
        poller = RepositoryPoller(registry, settings.repository_poll_secs)
        poller.take_baseline()  # before loading: a file changed meanwhile is a change
    loading = asyncio.create_task(registry.load_all())
    # The models' objects live until unloaded: out of the collector's full
    # passes too (http/server.py freezes what was imported before).
    loading.add_done_callback(lambda _: gc.freeze())
    polling = asyncio.create_task(poller.run(loading)) if poller is not None else None
    if wait_for_models:
        await loading
    loop_lag.start()  # here: a start-up that raised above has no clean-up to stop it
    try:
        yield
    finally:
        tasks = [task for task in (polling, loading) if task is not None]
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop_lag.stop()
        await registry.close()
        if tracer is not None:  # the last batches' spans are exported before exit
            await asyncio.to_thread(tracer.shutdown)

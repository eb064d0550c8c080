"""What both front ends answer about the server and its models: health,
metadata, Triton's config and statistics, and the repository extension
(list, load or reload, unload). Plain dicts, as the HTTP front end sends
them as JSON; the gRPC front end copies them into its messages."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensorserve import __version__
from tensorserve.batching.policy import budget_report
from tensorserve.dataplane.lifecycle import SHUTTING_DOWN
from tensorserve.dataplane.plane import DataPlane
from tensorserve.ensemble import Ensemble
from tensorserve.errors import InvalidInput, ModelControlDisabled, ModelNotReady
from tensorserve.serving.entries import ModelState
from tensorserve.settings import Settings
from tensorserve.wire import triton
from tensorserve.wire.metadata import model_metadata

if TYPE_CHECKING:
    from tensorserve.serving.model import ServedModel

# What Triton clients may rely on (KServe v2 server metadata "extensions").
EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "statistics",
    "tensorserve_padding",
]


def server_metadata() -> dict[str, Any]:
    return {"name": "tensorserve", "version": __version__, "extensions": EXTENSIONS}


def server_live(plane: DataPlane) -> dict[str, Any]:
    """``{"live": True}``, or why not: only for what waiting cannot fix, a
    an instance thread stuck for good or a lost CUDA context (serving/liveness.py);
    the orchestrator then restarts the process."""
    liveness = plane.liveness
    assert liveness is not None  # answered where the models are
    lost = liveness.context_lost()
    if lost is not None:
        return {"live": False, "reason": lost}
    wedged = liveness.wedged()
    if not wedged:
        return {"live": True}
    return {"live": False, "reason": wedged[0].reason, "wedged": [w.describe() for w in wedged]}


def server_ready(plane: DataPlane) -> dict[str, Any]:
    """``{"ready": True}`` while every model meant to serve can run a batch
    now and the server is not shutting down; else why not."""
    if plane.draining:  # shutting down: load balancers, stop sending
        return {"ready": False, "reason": SHUTTING_DOWN}
    problems = plane.registry.not_ready()
    if not problems:
        return {"ready": True}
    return {"ready": False, "not_ready": problems}


def model_ready(plane: DataPlane, name: str, version: str | None) -> dict[str, Any]:
    entry = plane.registry.get(name, version)  # unknown: ModelNotFound
    why = SHUTTING_DOWN if plane.draining else plane.registry.health(entry)
    body = {"name": entry.name, "ready": why is None, "state": entry.state.value}
    if why is not None:
        body["reason"] = entry.reason or why
    return body


def metadata(plane: DataPlane, name: str, version: str | None) -> dict[str, Any]:
    entry = plane.registry.get(name, version)
    devices = entry.served.devices if entry.served is not None else None
    return model_metadata(
        entry.name, entry.version, entry.state.value, entry.reason, entry.config, devices
    )


def config(plane: DataPlane, name: str, version: str | None) -> dict[str, Any]:
    """Triton's model configuration (``wire/triton.py``)."""
    entry = plane.registry.get(name, version)
    if entry.config is None:
        raise ModelNotReady(f"model {entry.name!r} has no valid config: {entry.reason}")
    return triton.model_config(entry.name, entry.config)


def _stat(served: ServedModel | Ensemble) -> dict[str, Any]:
    if isinstance(served, Ensemble):  # its requests and steps; its steps' models batch
        stats = served.stats
        return triton.model_stat(
            served.name, str(served.version), stats.triton_counts(), {"ensemble": stats.report()}
        )
    snapshot = served.stats.snapshot(served.batcher.queue_depth)
    snapshot["budget"] = budget_report(served.batcher.options.policy)
    if (target := served.batcher.latency_target) is not None:
        snapshot["latency_target"] = target.report()
    return triton.model_stat(
        served.name, str(served.version), served.stats.triton_counts(), {"batching": snapshot}
    )


def model_stats(plane: DataPlane, name: str, version: str | None) -> dict[str, Any]:
    """One served model's Triton statistics (with tensorserve's ``batching``,
    or an ensemble's ``ensemble``)."""
    entry = plane.registry.get(name, version)
    return _stat(plane.registry.ready_model(entry.name))


def all_model_stats(plane: DataPlane) -> list[dict[str, Any]]:
    """Every served model's, by name."""
    entries = sorted(plane.registry.entries.values(), key=lambda e: e.name)
    return [_stat(e.served) for e in entries if e.state is ModelState.READY and e.served]


def repository_index(plane: DataPlane, ready: bool) -> list[dict[str, Any]]:
    return triton.repository_index(plane.registry.index(), ready)


async def load(plane: DataPlane, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """Load, or reload a served model; ``InvalidInput`` saying why it failed."""
    require_model_control(plane.settings, "load", name)
    overrides = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if overrides:
        raise InvalidInput(
            f"load parameters {', '.join(overrides)} are not supported: tensorserve loads "
            f"models from the repository only"
        )
    registry = plane.registry
    before = registry.entries.get(name)
    previous = before.served if before is not None else None
    entry = await registry.load(name)  # unknown name: ModelNotFound
    if entry.state is ModelState.FAILED:
        raise InvalidInput(f"failed to load model {name!r}: {entry.reason}")
    if previous is not None and entry.served is previous:
        # The registry keeps serving the old version when a reload fails.
        raise InvalidInput(
            f"failed to reload model {name!r}; still serving version {entry.version} "
            f"(the server log has the reason)"
        )
    return entry.describe()


async def unload(plane: DataPlane, name: str) -> dict[str, Any]:
    """Returns once the model's queued requests have finished."""
    require_model_control(plane.settings, "unload", name)
    await plane.registry.unload(name)
    return plane.registry.get(name).describe()


def require_model_control(settings: Settings, action: str, model: str) -> None:
    """Raise ``ModelControlDisabled`` unless the repository API may ``action``
    (load, unload) models: only with ``model_control_mode`` explicit (Triton's
    rule); otherwise the model is left as it was. Both front ends ask here."""
    mode = settings.model_control_mode
    if mode == "explicit":
        return
    if mode == "poll":
        why = (
            f"the server is in poll mode: it loads, reloads and unloads models from the "
            f"repository's files every {settings.repository_poll_secs:g} s"
        )
    else:
        why = "model control is disabled (--model-control-mode none)"
    raise ModelControlDisabled(
        f"cannot {action} model {model!r}: {why}; it is left as it was. Start the server "
        f"with --model-control-mode explicit (TENSORSERVE_MODEL_CONTROL_MODE=explicit) to "
        f"{action} models through the API"
    )


def metrics_text(plane: DataPlane) -> bytes:
    """The Prometheus exposition of the whole server."""
    return plane.local_metrics.exposition()


def model_index(plane: DataPlane) -> list[dict[str, Any]]:
    return plane.registry.index()


# Every answer a front end gives about the server and its models, by name:
# computed here where the models are, asked of the scheduler process from a
# front-end process (``--frontends N``; ``frontends/hub.py``).
ANSWERS: dict[str, Callable[..., Any]] = {
    "server_live": server_live,
    "server_ready": server_ready,
    "model_ready": model_ready,
    "metadata": metadata,
    "config": config,
    "model_stats": model_stats,
    "all_model_stats": all_model_stats,
    "model_index": model_index,
    "repository_index": repository_index,
    "load": load,
    "unload": unload,
    "metrics": metrics_text,
}


async def answer(plane: DataPlane, what: str, *args: Any) -> Any:
    """``ANSWERS[what](plane, *args)``, here or, in a front-end process, from
    the scheduler process; a front end that is shutting down says so itself
    (the scheduler process serves on for the other front ends)."""
    if plane.remote is None:
        value = ANSWERS[what](plane, *args)
        return await value if inspect.isawaitable(value) else value
    if what == "server_ready" and plane.draining:
        return {"ready": False, "reason": SHUTTING_DOWN}
    value = await plane.remote(what, args)
    if what == "model_ready" and plane.draining:
        value = {**value, "ready": False, "reason": SHUTTING_DOWN}
    return value

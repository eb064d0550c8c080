"""Triton's HTTP extensions that tritonclient and perf_analyzer call, as pure
functions from tensorserve's state to Triton's JSON schemas: model
configuration, statistics, and the repository index.

Each keeps tensorserve's own fields and adds Triton's beside them, so one
endpoint serves both the native client and Triton tooling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tensorserve.repository.config import ModelConfig

PLATFORM = "pytorch_tensorserve"

# Triton knows READY, LOADING, UNLOADING and UNAVAILABLE; a model that failed
# to load is UNAVAILABLE there, with the failure as its reason.
_STATES = {"READY": "READY", "LOADING": "LOADING", "UNLOADING": "UNLOADING"}


def model_config(name: str, config: ModelConfig) -> dict[str, Any]:
    """The config as tensorserve declares it, plus Triton's ``model_config``
    fields (``data_type``, ``dims``, ``max_queue_delay_microseconds``...)."""
    data: dict[str, Any] = {"name": name, "platform": PLATFORM, "backend": "tensorserve"}
    data.update(config.model_dump(mode="json"))
    for key, specs in (("input", config.input), ("output", config.output)):
        for tensor, spec in zip(data[key], specs):
            tensor["data_type"] = f"TYPE_{spec.dt.v2}"
            tensor["dims"] = list(spec.shape)
    data["dynamic_batching"]["max_queue_delay_microseconds"] = round(
        config.dynamic_batching.max_queue_delay_ms * 1000
    )
    if not config.instance_group:  # else the groups, as configured, are already in data
        kind = {"cpu": "KIND_CPU", "auto": "KIND_AUTO"}.get(config.device, "KIND_GPU")
        data["instance_group"] = [{"count": config.instance_count, "kind": kind}]
    return data


def _duration(count: int, ns: float) -> dict[str, int]:
    return {"count": int(count), "ns": round(ns)}


def model_stat(name: str, version: str, batching: Mapping[str, Any]) -> dict[str, Any]:
    """Triton's ``$model_stat`` derived from the ``batching`` snapshot (which
    is kept too). Counts are items (Triton's "inferences"), not requests;
    durations tensorserve does not measure are 0, and ``batch_stats`` is
    empty because the batcher keeps a bucketed histogram, not exact sizes
    (see ``batching.batch_size_histogram``)."""
    batches = int(batching["total_batches"])
    items = round(batching["avg_batch_size"] * batches)  # items that reached the model
    failed = int(batching["failed_items"])
    zero = _duration(0, 0)
    return {
        "name": name,
        "version": version,
        "last_inference": 0,
        "inference_count": items - failed,
        "execution_count": batches,
        "inference_stats": {
            "success": _duration(items - failed, 0),
            "fail": _duration(failed, 0),
            "queue": _duration(items, batching["avg_queue_ms"] * items * 1e6),
            "compute_input": zero,
            "compute_infer": _duration(batches, batching["avg_batch_duration_ms"] * batches * 1e6),
            "compute_output": zero,
            "cache_hit": zero,
            "cache_miss": zero,
        },
        "batch_stats": [],
        "memory_usage": [],
        "batching": dict(batching),
    }


def repository_index(
    models: Iterable[Mapping[str, Any]], ready_only: bool = False
) -> list[dict[str, Any]]:
    """Triton's repository index from ``ModelRegistry.index()`` entries:
    ``{name, version?, state, reason?}`` with Triton's state names."""
    index = []
    for model in models:
        state = _STATES.get(model["state"], "UNAVAILABLE")
        if ready_only and state != "READY":
            continue
        entry: dict[str, Any] = {"name": model["name"]}
        if "version" in model:
            entry["version"] = model["version"]
        entry["state"] = state
        reason = model.get("reason") or (
            "" if state != "UNAVAILABLE" else ("unloaded" if "version" in model else "not loaded")
        )
        if reason:
            entry["reason"] = reason
        index.append(entry)
    return index

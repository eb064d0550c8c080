"""Triton's HTTP extensions that tritonclient and perf_analyzer call, as pure
functions from tensorserve's state to Triton's JSON schemas: model
configuration, statistics, and the repository index.

Each keeps tensorserve's own fields and adds Triton's beside them, so one
endpoint serves both the native client and Triton tooling.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorserve.repository.config import ModelConfig

PLATFORM = "pytorch_tensorserve"
# What an ensemble's config does not use: it runs no model of its own.
ENSEMBLE_UNUSED = (
    "dynamic_batching", "instance_group", "device", "instance_count", "isolation",
    "onnxruntime", "compile", "warmup", "faults", "parameters",
)  # fmt: skip

# Triton knows READY, LOADING, UNLOADING and UNAVAILABLE; a model that failed
# to load is UNAVAILABLE there, with the failure as its reason.
_STATES = {"READY": "READY", "LOADING": "LOADING", "UNLOADING": "UNLOADING"}


def model_config(name: str, config: ModelConfig) -> dict[str, Any]:
    """The config as tensorserve declares it, plus Triton's ``model_config``
    fields (``data_type``, ``dims``, ``max_queue_delay_microseconds``...)."""
    # An ensemble has no backend of its own, as in Triton.
    backend = "" if config.platform == "ensemble" else "tensorserve"
    data: dict[str, Any] = {"name": name, "platform": PLATFORM, "backend": backend}
    data.update(config.model_dump(mode="json"))
    for key, specs in (("input", config.input), ("output", config.output)):
        for tensor, spec in zip(data[key], specs):
            # Triton's model config calls BYTES TYPE_STRING (its one other name).
            tensor["data_type"] = "TYPE_STRING" if spec.dt.is_bytes else f"TYPE_{spec.dt.v2}"
            tensor["dims"] = list(spec.shape)
    if config.platform == "ensemble":  # its steps' models batch and place themselves
        for key in ENSEMBLE_UNUSED:
            data.pop(key)
        return data
    data["dynamic_batching"]["max_queue_delay_microseconds"] = round(
        config.dynamic_batching.max_queue_delay_ms * 1000
    )
    if not config.instance_group:  # else the groups, as configured, are already in data
        kind = {"cpu": "KIND_CPU", "auto": "KIND_AUTO"}.get(config.device, "KIND_GPU")
        data["instance_group"] = [{"count": config.instance_count, "kind": kind}]
    return data


@dataclass(frozen=True)
class TritonCounts:
    """The counters of Triton's statistics extension, in its units: requests
    (successful ones, for queue and compute), their cumulative nanoseconds,
    items (``inferences``), batches (``executions``), and per batch size the
    batches and their durations."""

    success: int
    success_ns: int  # from submit to the answer, summed over successful requests
    fail: int
    fail_ns: int
    queue_ns: int
    compute_input_ns: int  # padding (collate.pad, which fills the host buffers)
    compute_infer_ns: int  # the model's run (launch to collect: device copies included)
    compute_output_ns: int  # un-padding the outputs into each item's rows
    inferences: int  # items of successful requests
    executions: int  # batches run
    # batch size -> (batches, input ns, infer ns, output ns), each batch counted once
    batch_sizes: dict[int, tuple[int, int, int, int]]
    last_inference_ms: int  # when the last batch finished, ms since the epoch (0: none yet)


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


def model_stat(
    name: str, version: str, counts: TritonCounts, own: Mapping[str, Any]
) -> dict[str, Any]:
    """Triton's ``$model_stat`` in Triton's units (``batching/stats.py``):
    ``inference_stats`` counts requests, each charged the whole time of the
    batches it ran in; ``inference_count`` items; ``execution_count`` and
    ``batch_stats`` batches. perf_analyzer requires the three compute counts to
    agree: they, and the queue's, are the successful requests, as in Triton.
    tensorserve's own fields are kept beside them (``own``: a model's
    ``batching`` snapshot, an ensemble's ``ensemble`` steps)."""
    ok = counts.success
    zero = _duration(0, 0)
    return {
        "name": name,
        "version": version,
        "last_inference": counts.last_inference_ms,
        "inference_count": counts.inferences,
        "execution_count": counts.executions,
        "inference_stats": {
            "success": _duration(ok, counts.success_ns),
            "fail": _duration(counts.fail, counts.fail_ns),
            "queue": _duration(ok, counts.queue_ns),
            "compute_input": _duration(ok, counts.compute_input_ns),
            "compute_infer": _duration(ok, counts.compute_infer_ns),
            "compute_output": _duration(ok, counts.compute_output_ns),
            "cache_hit": zero,
            "cache_miss": zero,
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(batches, input_ns),
                "compute_infer": _duration(batches, infer_ns),
                "compute_output": _duration(batches, output_ns),
            }
            for size, (batches, input_ns, infer_ns, output_ns) in counts.batch_sizes.items()
        ],
        "memory_usage": [],
        **own,
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

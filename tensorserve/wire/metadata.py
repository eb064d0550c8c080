"""Model metadata in the KServe v2 schema (shared by both protocols)."""

from __future__ import annotations

from typing import Any

from tensorserve.repository.config import ModelConfig, TensorSpec


def _tensor(spec: TensorSpec, batching: bool) -> dict[str, Any]:
    # A batching model's batch dimension is reported as -1, as Triton does.
    shape = ([-1] if batching else []) + list(spec.shape)
    return {"name": spec.name, "datatype": spec.dt.v2, "shape": shape, "dtype": spec.dtype}


def model_metadata(
    name: str,
    version: int | None,
    state: str,
    reason: str,
    config: ModelConfig | None,
    devices: list[str] | None = None,
) -> dict[str, Any]:
    """KServe v2's fields, and tensorserve's own beside them (state, reason,
    max_batch_size, pad values; ``device``: where a served model resolved to
    run, one name, or a list over several devices)."""
    metadata: dict[str, Any] = {
        "name": name,
        "versions": [str(version)] if version is not None else [],
        "platform": config.platform if config is not None else "pytorch_tensorserve",
        "state": state,
    }
    if reason:
        metadata["reason"] = reason
    if devices:
        metadata["device"] = devices[0] if len(devices) == 1 else devices
    if config is not None:
        metadata["max_batch_size"] = config.max_batch_size
        metadata["inputs"] = [
            {**_tensor(s, config.batching), "pad_value": s.pad_value} for s in config.input
        ]
        metadata["outputs"] = [
            {**_tensor(s, config.batching), "unpad_like": config.unpad_source(s)}
            for s in config.output
        ]
    return metadata

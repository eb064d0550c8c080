"""The data plane's plain answers (``dataplane/models.py``) as the KServe v2
/ Triton gRPC messages. Fields the messages have no place for (tensorserve's
``batching`` statistics, ``pad_value``) are left out: the HTTP answers
carry them."""

from __future__ import annotations

from typing import Any

from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.grpc.generated import model_config_pb2 as mc


def model_metadata(data: dict[str, Any]) -> pb.ModelMetadataResponse:
    def tensors(key: str) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=t["name"], datatype=t["datatype"], shape=t["shape"]
            )
            for t in data.get(key, [])
        ]

    return pb.ModelMetadataResponse(
        name=data["name"],
        versions=data["versions"],
        platform=data["platform"],
        inputs=tensors("inputs"),
        outputs=tensors("outputs"),
    )


def model_config(data: dict[str, Any]) -> pb.ModelConfigResponse:
    """Triton's ``ModelConfig`` from ``wire/triton.py model_config``."""

    def tensor(kind: Any, t: dict[str, Any]) -> Any:
        return kind(name=t["name"], data_type=mc.DataType.Value(t["data_type"]), dims=t["dims"])

    batching = data.get("dynamic_batching") or {}
    config = mc.ModelConfig(
        name=data["name"],
        platform=data["platform"],
        backend=data["backend"],
        max_batch_size=data["max_batch_size"],
        input=[tensor(mc.ModelInput, t) for t in data["input"]],
        output=[tensor(mc.ModelOutput, t) for t in data["output"]],
        batch_input=[_batch_input(b) for b in data.get("batch_input", [])],
        batch_output=[
            mc.BatchOutput(
                kind=mc.BatchOutput.Kind.Value(b["kind"]),
                target_name=b["target_name"],
                source_input=b["source_input"],
            )
            for b in data.get("batch_output", [])
        ],
        instance_group=[
            mc.ModelInstanceGroup(
                count=g.get("count", 1),
                kind=mc.ModelInstanceGroup.Kind.Value(g.get("kind", "KIND_AUTO")),
            )
            for g in data.get("instance_group", [])
        ],
    )
    for given, t in zip(config.input, data["input"]):
        given.allow_ragged_batch = bool(t.get("allow_ragged_batch", False))
    scheduling = data.get("ensemble_scheduling")
    if scheduling is not None:  # one of Triton's scheduling choices: not dynamic_batching
        for step in scheduling["step"]:
            config.ensemble_scheduling.step.add(
                model_name=step["model_name"],
                model_version=step["model_version"],
                input_map=step["input_map"],
                output_map=step["output_map"],
            )
    elif data["max_batch_size"]:
        config.dynamic_batching.max_queue_delay_microseconds = batching.get(
            "max_queue_delay_microseconds", 0
        )
    return pb.ModelConfigResponse(config=config)


def _batch_input(b: dict[str, Any]) -> Any:
    """A packed model's ``[[batch_input]]`` in Triton's terms (one target name, a
    list there; the dtype as a ``DataType``)."""
    return mc.BatchInput(
        kind=mc.BatchInput.Kind.Value(b["kind"]),
        target_name=[b["target_name"]],
        data_type=mc.DataType.Value(_TRITON_TYPES[b["data_type"]]),
        source_input=b["source_input"],
    )


_TRITON_TYPES = {"int32": "TYPE_INT32", "int64": "TYPE_INT64", "float32": "TYPE_FP32"}


def _duration(d: dict[str, int]) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d["count"], ns=d["ns"])


def model_statistics(stats: list[dict[str, Any]]) -> pb.ModelStatisticsResponse:
    reply = pb.ModelStatisticsResponse()
    for stat in stats:
        inference = stat.get("inference_stats", {})
        entry = reply.model_stats.add(
            name=stat["name"],
            version=stat["version"],
            last_inference=stat.get("last_inference", 0),
            inference_count=stat.get("inference_count", 0),
            execution_count=stat.get("execution_count", 0),
        )
        for key, value in inference.items():
            if hasattr(entry.inference_stats, key):
                getattr(entry.inference_stats, key).CopyFrom(_duration(value))
        for batch in stat.get("batch_stats", []):
            entry.batch_stats.add(
                batch_size=batch["batch_size"],
                compute_input=_duration(batch["compute_input"]),
                compute_infer=_duration(batch["compute_infer"]),
                compute_output=_duration(batch["compute_output"]),
            )
    return reply


def repository_index(entries: list[dict[str, Any]]) -> pb.RepositoryIndexResponse:
    return pb.RepositoryIndexResponse(
        models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=e["name"],
                version=str(e.get("version", "")),
                state=e["state"],
                reason=e.get("reason", ""),
            )
            for e in entries
        ]
    )

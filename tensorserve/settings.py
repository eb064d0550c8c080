"""Server settings: defaults < environment (``TENSORSERVE_*``) < CLI flags.

The per-model overrides (``max_batch_size``, ``max_queue_delay_ms``,
``device``, ``dispatch``, ``policy``, ``instance_count``, ``max_batch_tokens``,
``isolation``) apply to every model of the repository on top of its
config.toml, as MLServer's settings do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# No timeout may be longer than this: a deadline of days is a client's bug (a
# unit mix-up), not a deadline. The one bound: the server's timeouts, a model's
# default_timeout_ms (config.toml) and every protocol's timeout parameter
# (wire/request.py timeout_seconds) are checked against it.
MAX_TIMEOUT_S = 3600
MAX_TIMEOUT_MS = MAX_TIMEOUT_S * 1000

MODEL_OVERRIDES = (
    "max_batch_size",
    "max_queue_delay_ms",
    "device",
    "dispatch",
    "policy",
    "instance_count",
    "max_batch_tokens",
    "isolation",
)


def check_batch_tokens(value: Any) -> int | str:
    """The one check of ``max_batch_tokens``, for the settings and for
    config.toml: "auto", 0 (no budget) or a whole number (not a boolean:
    True would be a budget of 1, no batching at all)."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if value != "auto" and not (whole and value >= 0):
        raise ValueError(f"must be 'auto', 0 (no budget) or a whole number >= 1, got {value!r}")
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TENSORSERVE_", protected_namespaces=())

    host: str = Field("0.0.0.0", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    model_repository: Path = Field(Path("model_repository"), description="Model repository folder.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    access_log: bool = Field(False, description="Log every request (off: keeps the hot path lean).")
    log_format: Literal["text", "json"] = Field(
        "text", description="Log lines as text, or as one JSON object per line."
    )
    log_probes: bool = Field(
        False, description="Include health and /metrics probes in the access log."
    )

    # Bounds on what a client may send.
    max_request_bytes: int = Field(64 << 20, ge=1024, description="Largest request body accepted.")
    max_items_per_request: int = Field(4096, ge=1, description="Most items in one request.")

    # Deadlines, slow clients, start-up and shutdown (docs/reliability.md).
    default_timeout_ms: float | None = Field(
        None,
        gt=0,
        le=MAX_TIMEOUT_MS,
        description="Deadline of a request that asks for none, for models whose config.toml "
        "sets no default_timeout_ms (unset: none, up to max_timeout_ms).",
    )
    max_timeout_ms: float = Field(
        MAX_TIMEOUT_MS,
        gt=0,
        le=MAX_TIMEOUT_MS,
        description="Longest any request is kept: a longer timeout asked for (or a model's "
        "default) is lowered to this.",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, le=MAX_TIMEOUT_S, description="Longest a request body may take to arrive (then 408)."
    )
    keepalive_timeout_s: float = Field(
        75.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Close a connection idle this long; also the longest a request's line and "
        "headers may take to arrive.",
    )
    drain_delay_s: float = Field(
        5.0,
        ge=0,
        le=MAX_TIMEOUT_S,
        description="On SIGTERM/SIGINT: readiness answers 503 while requests are still served "
        "this long, so load balancers stop sending.",
    )
    shutdown_grace_s: float = Field(
        20.0,
        ge=0,
        le=MAX_TIMEOUT_S,
        description="Then: longest queued and running requests may take to finish; what is "
        "left is answered 503.",
    )
    # Tracing (docs/observability.md, "Traces"): off unless an endpoint is set.
    otlp_endpoint: str | None = Field(
        None,
        description="Send OpenTelemetry traces by OTLP/HTTP (protobuf) to URL/v1/traces "
        "(unset: no tracing; needs the otel extra). OTEL_* variables are honoured.",
    )
    trace_sample_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Share of requests without a traceparent that start a trace; a caller's "
        "sampled flag is followed (unset: OTEL_TRACES_SAMPLER / _ARG, else every request).",
    )
    trace_service_name: str | None = Field(
        None,
        description="service.name of the spans (unset: OTEL_SERVICE_NAME, else tensorserve).",
    )
    allow_empty_repository: bool = Field(
        False,
        description="Start with no model in the repository (to load models through the "
        "repository API later); off: an empty repository is a start-up error.",
    )

    intra_op_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per model thread (unset: the CPUs this process may "
        "use, counting a container's CPU quota, less one).",
    )
    switch_interval_ms: float = Field(
        0.1,
        gt=0,
        le=100,
        description="Python's GIL switch interval. The default 5 ms lets a busy event loop "
        "starve the model thread of the GIL; 0.1 ms served 1.1-1.2x the items/s "
        "(docs/threading.md).",
    )

    # Overrides applied to every model's config.toml (None: keep the model's own).
    max_batch_size: int | None = Field(None, ge=0, description="Most items in one batch (0, 1: no batching).")
    max_queue_delay_ms: float | None = Field(None, ge=0, description="Longest an item waits for company.")
    device: str | None = Field(None, description="auto | cpu | cuda | cuda:N.")
    dispatch: Literal["eager", "timer"] | None = Field(
        None, description="eager: run as soon as the model is idle; timer: wait for a full batch or the delay."
    )
    policy: Literal["fifo", "length_aware"] | None = Field(
        None, description="Which waiting items form the next batch."
    )
    instance_count: int | None = Field(None, ge=1, description="Model copies executing in parallel.")
    max_batch_tokens: int | Literal["auto"] | None = Field(
        None,
        description="Padded-volume budget per batch (batch x padded item size), >= 0; auto: learnt; "
        "0: none.",
    )
    isolation: Literal["auto", "thread", "process"] | None = Field(
        None, description="Run each model instance in a thread of the server or its own process."
    )

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():  # a flag's or a variable's digits
            value = int(value)
        return None if value is None else check_batch_tokens(value)

    def model_overrides(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in MODEL_OVERRIDES if getattr(self, key) is not None}

"""Server settings: defaults < environment (``TENSORSERVE_*``) < CLI flags.

The per-model overrides (``max_batch_size``, ``max_queue_delay_ms``,
``dispatch``, ``policy``, ``instance_count``, ``max_batch_tokens``,
``isolation``) apply to every model of the repository on top of its
config.toml, as MLServer's settings do. ``device`` is the server's default
instead: it replaces what a model leaves to ``auto``
(``ModelConfig.with_default_device``); ``target_p99_ms`` is a default too,
which a model's own config.toml value overrides.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tensorserve.host import FrontendsChoice, choose_frontends

# No timeout may be longer than this: a deadline of days is a client's bug (a
# unit mix-up), not a deadline. The one bound: the server's timeouts, a model's
# default_timeout_ms (config.toml) and every protocol's timeout parameter
# (wire/request.py timeout_seconds) are checked against it.
MAX_TIMEOUT_S = 3600
MAX_TIMEOUT_MS = MAX_TIMEOUT_S * 1000


# The bounds of every number a model's config.toml declares that a server-wide
# setting also overrides, in one table: config.toml's fields
# (repository/config.py) and the settings, so their flags and environment
# variables, take them from here. A bound only config.toml knew let
# `--instance-count 99` start a server whose every model then failed to load;
# now the flag is refused as the config would be (one line, exit status 2).
class Bounds(TypedDict, total=False):
    """A number's bounds, as pydantic's ``Field`` takes them (``**BOUNDS[name]``)."""

    ge: float
    gt: float
    le: float


BOUNDS: dict[str, Bounds] = {
    "max_batch_size": {"ge": 0, "le": 65_536},
    "max_queue_delay_ms": {"ge": 0, "le": 60_000},
    "instance_count": {"ge": 1, "le": 16},
    "default_timeout_ms": {"gt": 0, "le": MAX_TIMEOUT_MS},
    "target_p99_ms": {"gt": 0, "le": MAX_TIMEOUT_MS},
}
# The longest one element of a bytes (BYTES) input may be, unless the
# server's max_bytes_element_length says otherwise (1 MiB).
DEFAULT_MAX_BYTES_ELEMENT_LENGTH = 1 << 20
# The most one item may carry in one bytes input, all its elements together,
# unless max_bytes_item_bytes says otherwise (16 MiB).
DEFAULT_MAX_BYTES_ITEM_BYTES = 16 << 20


class BytesLimits(NamedTuple):
    """What one item's bytes (BYTES) input may hold: each element at most
    ``element`` bytes, all of them together at most ``item`` bytes."""

    element: int = DEFAULT_MAX_BYTES_ELEMENT_LENGTH
    item: int = DEFAULT_MAX_BYTES_ITEM_BYTES


DEFAULT_BYTES_LIMITS = BytesLimits()


# More front ends than this would only take cores from the models.
MAX_FRONTENDS = 64


def check_device(value: str) -> str:
    """The one check of a device name, for the settings and for config.toml."""
    ok = value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
    if not ok:
        raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {value!r}")
    return value


MODEL_OVERRIDES = (
    "max_batch_size",
    "max_queue_delay_ms",
    "dispatch",
    "policy",
    "instance_count",
    "max_batch_tokens",
    "isolation",
    "target_p99_ms",  # a default: a model's own target_p99_ms wins (repository.config)
)


# The APIs ``restricted_api`` can restrict, by Triton's names; each is a group
# of endpoints (tensorserve/http/app.py ROUTES). Triton's shared-memory, trace
# and logging APIs do not exist here.
RESTRICTABLE_APIS = (
    "health",
    "metadata",
    "inference",
    "model-config",
    "model-repository",
    "statistics",
)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)


def parse_restricted_api(spec: str) -> dict[str, tuple[str, str]]:
    """``"model-repository,statistics:X-Admin-Key=secret"`` -> ``{api: (header,
    value)}``, Triton's ``--http-restricted-api`` syntax; several groups, each
    with its own header, are separated by ``;``. Header names are compared
    case-insensitively (HTTP's rule), so they are kept lower case."""
    restrictions: dict[str, tuple[str, str]] = {}
    for group in filter(None, (part.strip() for part in spec.split(";"))):
        apis, colon, rule = group.partition(":")
        header, equals, value = rule.partition("=")
        header = header.strip()
        if not colon or not equals or not value or not _HEADER_NAME.match(header):
            # Names the APIs, never the rest: it may hold the secret value.
            raise ValueError(
                f"the group for {apis.strip()!r} is not API[,API...]:HEADER=VALUE (e.g. "
                f"'model-repository:X-Admin-Key=secret'), with a header name and a value"
            )
        for api in (a.strip() for a in apis.split(",")):
            if api not in RESTRICTABLE_APIS:
                raise ValueError(f"unknown API {api!r}; choose from {', '.join(RESTRICTABLE_APIS)}")
            if api in restrictions:
                raise ValueError(f"API {api!r} is restricted twice")
            restrictions[api] = (header.lower(), value)
    return restrictions


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
    grpc_port: int = Field(
        8001,
        ge=-1,
        le=65535,
        description="Port of the KServe v2 gRPC front end (0: any free port; -1: no gRPC).",
    )
    frontends: int | Literal["auto"] | None = Field(
        None,
        description="Front-end processes serving HTTP and gRPC on the same ports, feeding one "
        "scheduler process that owns the models and batches all their requests (1: one "
        "process; auto: the CPUs this process may use less one, 1 to 8; unset: auto where a "
        "GPU is visible and device is not cpu, else 1).",
    )
    model_repository: Path = Field(Path("model_repository"), description="Model repository folder.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Log level."
    )
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
    max_bytes_element_length: int = Field(
        DEFAULT_MAX_BYTES_ELEMENT_LENGTH,
        ge=1,
        le=1 << 30,
        description="Longest one element of a bytes (BYTES) input may be, in bytes; a longer "
        "one is that caller's 400, naming the input.",
    )
    max_bytes_item_bytes: int = Field(
        DEFAULT_MAX_BYTES_ITEM_BYTES,
        ge=1,
        le=1 << 30,
        description="Most bytes one item may carry in one bytes (BYTES) input, its elements "
        "together; more is that caller's 400, naming the input.",
    )

    # Deadlines, slow clients, start-up and shutdown (docs/reliability.md).
    default_timeout_ms: float | None = Field(
        None,
        **BOUNDS["default_timeout_ms"],
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
        60.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Longest a request body may take to arrive (then 408).",
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
    liveness_stall_s: float = Field(
        60.0,
        ge=0,
        le=MAX_TIMEOUT_S,
        description="/v2/health/live answers 503 once a model instance has been stuck this "
        "long in a forward the watchdog gave up on and cannot stop (a thread: only a "
        "restart frees it); 0: liveness never fails.",
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

    # Who may change what is served (docs/operations.md, "Model control").
    model_control_mode: Literal["none", "explicit", "poll"] = Field(
        "none",
        description="none: the models found at start-up serve; the repository API's load and "
        "unload answer 403. explicit: that API loads, reloads and unloads models. poll: every "
        "repository_poll_secs the server reloads changed models, loads new folders and "
        "unloads removed ones (the API answers 403).",
    )
    repository_poll_secs: float = Field(
        15.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="In poll mode, how often the repository's files are looked at.",
    )
    restricted_api: str | None = Field(
        None,
        description="APIs answered only for requests carrying a header, as "
        "API[,API...]:HEADER=VALUE (groups separated by ';'); APIs: "
        + ", ".join(RESTRICTABLE_APIS)
        + " (unset: none restricted).",
    )

    intra_op_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per instance thread (unset: the CPUs this process may "
        "use, counting a container's CPU quota, less one).",
    )
    switch_interval_ms: float = Field(
        0.1,
        gt=0,
        le=100,
        description="Python's GIL switch interval. The default 5 ms lets a busy event loop "
        "starve a forward in a thread of the GIL; 0.1 ms served 1.1-1.2x the items/s "
        "(docs/threading.md).",
    )

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where models whose config.toml leaves device (or an instance group's "
        "kind) at auto run. cuda: a model that would run on the CPU for want of CUDA is "
        "FAILED instead, with the reason (torch, its CUDA, the driver); auto: CUDA when "
        "present, else the CPU, with a warning.",
    )

    # Overrides applied to every model's config.toml (None: keep the model's own).
    max_batch_size: int | None = Field(
        None,
        **BOUNDS["max_batch_size"],
        description="Most items in one batch (0: no batch dimension, no batching).",
    )
    max_queue_delay_ms: float | None = Field(
        None, **BOUNDS["max_queue_delay_ms"], description="Longest an item waits for company."
    )
    dispatch: Literal["eager", "timer"] | None = Field(
        None,
        description="eager: run as soon as the model is idle; timer: wait for a full batch or the delay.",
    )
    policy: Literal["fifo", "length_aware"] | None = Field(
        None, description="Which waiting items form the next batch."
    )
    instance_count: int | None = Field(
        None, **BOUNDS["instance_count"], description="Model copies executing in parallel."
    )
    max_batch_tokens: int | Literal["auto"] | None = Field(
        None,
        description="Padded-volume budget per batch (batch x padded item size), >= 0; auto: learnt "
        "on a CPU, max_batch_size full-length items on a GPU; 0: none.",
    )
    isolation: Literal["auto", "thread", "process"] | None = Field(
        None, description="Run each model instance in a thread of the server or its own process."
    )
    target_p99_ms: float | None = Field(
        None,
        **BOUNDS["target_p99_ms"],
        description="Default p99 latency target for models whose config.toml sets none "
        "(batching adapts and late requests are refused with 503 would_miss_target).",
    )

    @field_validator("max_batch_tokens", mode="before")
    @classmethod
    def _budget(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():  # a flag's or a variable's digits
            value = int(value)
        return None if value is None else check_batch_tokens(value)

    @field_validator("frontends", mode="before")
    @classmethod
    def _frontends(cls, value: Any) -> Any:
        if isinstance(value, str) and value.isdigit():  # a flag's or a variable's digits
            value = int(value)
        if isinstance(value, int) and not 1 <= value <= MAX_FRONTENDS:
            raise ValueError(f"must be auto or 1 to {MAX_FRONTENDS}")
        return value

    @field_validator("restricted_api")
    @classmethod
    def _restrictions(cls, value: str | None) -> str | None:
        if value is not None:
            parse_restricted_api(value)  # a bad spec fails at start-up, not per request
        return value

    def frontends_choice(self) -> FrontendsChoice:
        """The front ends this server starts, and why (``host.choose_frontends``:
        unset, it depends on the GPUs visible, read without initialising CUDA)."""
        return choose_frontends(self.frontends, self.device)

    def bytes_limits(self) -> BytesLimits:
        """``max_bytes_element_length`` and ``max_bytes_item_bytes``, as validation takes them."""
        return BytesLimits(self.max_bytes_element_length, self.max_bytes_item_bytes)

    def restrictions(self) -> dict[str, tuple[str, str]]:
        """``restricted_api`` parsed: API -> (lower-case header name, value)."""
        return parse_restricted_api(self.restricted_api or "")

    def model_overrides(self) -> dict[str, Any]:
        return {
            key: getattr(self, key) for key in MODEL_OVERRIDES if getattr(self, key) is not None
        }

"""What the load generator sends to: a server over HTTP, or a model in-process.

A target turns generated items into a ready-to-send payload once, before the
clock starts (``encode``), so the measured loop only sends (``send``). It also
reads the model's batching counters (``counters``), whose differences over a
measured window give the executed batch sizes and the padding efficiency.

    HttpTarget       POST /v2/models/{m}/infer in the native msgpack protocol,
                     KServe v2 JSON or KServe v2 binary (``protocols.py``)
    InProcessTarget  ServedModel.infer_many, no HTTP at all (the ceiling)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from tensorserve_bench.items import FeatureSpec, Item, specs_from_config, specs_from_metadata
from tensorserve_bench.protocols import CONTENT_TYPES, PROTOCOLS, decode_error, encode_request
from tensorserve_bench.rawhttp import RawHttpPool

if TYPE_CHECKING:
    from tensorserve.serving import ServedModel


# A server shedding load (503 / UNAVAILABLE for a full queue or a latency
# target): retry later. Other 503s (a model not ready, say) are errors.
REFUSED_CODES = ("server_busy", "would_miss_target")


class RequestFailed(Exception):
    """A request the target answered with an error (HTTP status or error code).
    ``refused``: the server shed it (``REFUSED_CODES``): overload, not a
    failure of the request."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


@dataclass(frozen=True)
class Counters:
    """Cumulative batching counters of one model at one moment."""

    batches: int = 0
    batch_items: int = 0  # items that reached the model (sum of batch sizes)
    failed_items: int = 0
    # Raw element counts give an exact padding efficiency over a window; a
    # server that reports only the cumulative ratio leaves them None.
    real_elements: int | None = None
    padded_elements: int | None = None
    padding_efficiency: float | None = 1.0  # cumulative, as reported; None: not reported
    histogram: Mapping[str, int] = field(default_factory=dict)  # bucket upper bound -> batches
    # The model's own time over all batches (on a worker process or a GPU,
    # its compute, not the wait in line); None from servers that don't say.
    batch_seconds: float | None = None
    # CPU seconds the server's process tree has used, from targets that run
    # the server themselves (server.ChildServer.usage); None otherwise.
    server_cpu_s: float | None = None


@dataclass(frozen=True)
class BatchingDelta:
    """What the model executed between two ``Counters``."""

    batches: int
    items: int
    avg_batch_size: float
    padding_efficiency: float | None
    padding_efficiency_exact: bool  # False: the server's cumulative ratio
    histogram: dict[str, int]
    avg_batch_ms: float | None  # the model's own time per batch
    server_cpu_s: float | None = None  # the server tree's CPU seconds over the window

    @classmethod
    def between(cls, before: Counters, after: Counters) -> BatchingDelta:
        batches = after.batches - before.batches
        items = after.batch_items - before.batch_items
        histogram = {
            bound: count - before.histogram.get(bound, 0)
            for bound, count in after.histogram.items()
            if count - before.histogram.get(bound, 0) > 0
        }
        efficiency: float | None
        exact = True
        if (
            after.real_elements is not None
            and after.padded_elements is not None
            and before.real_elements is not None
            and before.padded_elements is not None
        ):
            padded = after.padded_elements - before.padded_elements
            real = after.real_elements - before.real_elements
            efficiency = real / padded if padded else None
        elif after.padding_efficiency is None:  # a server that does not say
            efficiency, exact = None, False
        elif before.batches == 0:
            efficiency = after.padding_efficiency if batches else None  # the window is all there is
        else:
            efficiency, exact = after.padding_efficiency, False
        model_ms = None
        if batches and after.batch_seconds is not None and before.batch_seconds is not None:
            model_ms = 1000 * (after.batch_seconds - before.batch_seconds) / batches
        return cls(
            batches=batches,
            items=items,
            avg_batch_size=items / batches if batches else 0.0,
            padding_efficiency=efficiency,
            padding_efficiency_exact=exact,
            histogram=dict(sorted(histogram.items(), key=lambda kv: float(kv[0]))),
            avg_batch_ms=model_ms,
            server_cpu_s=_difference(before.server_cpu_s, after.server_cpu_s),
        )


def _difference(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None


def counters_from_snapshot(snapshot: Mapping[str, Any]) -> Counters:
    """From the ``batching`` object of ``GET /v2/models/{m}/stats``."""
    batches = int(snapshot.get("total_batches", 0))
    batch_items = snapshot.get("batch_items")
    if batch_items is None:  # older servers: only the average
        batch_items = round(float(snapshot.get("avg_batch_size", 0.0)) * batches)
    real, padded = snapshot.get("real_elements"), snapshot.get("padded_elements")
    return Counters(
        batches=batches,
        batch_items=int(batch_items),
        failed_items=int(snapshot.get("failed_items", 0)),
        real_elements=int(real) if real is not None else None,
        padded_elements=int(padded) if padded is not None else None,
        padding_efficiency=float(snapshot.get("padding_efficiency", 1.0)),
        histogram={str(k): int(v) for k, v in snapshot.get("batch_size_histogram", {}).items()},
        batch_seconds=float(seconds)
        if (seconds := snapshot.get("batch_seconds")) is not None
        else None,
    )


class Target(Protocol):
    """What ``run_point`` needs; ``open`` before use, ``aclose`` after."""

    kind: str
    model: str
    specs: list[FeatureSpec]
    parameters: dict[str, Any]  # the model's config parameters (e.g. vocab_size), if known

    async def open(self) -> None: ...

    def encode(self, items: Sequence[Item]) -> Any: ...

    async def send(self, payload: Any) -> None: ...

    async def counters(self) -> Counters: ...

    def describe(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


class HttpTarget:
    """A running tensorserve, spoken to in ``protocol``: ``msgpack`` (the
    native protocol), ``json`` or ``binary`` (KServe v2; see ``protocols.py``).

    Requests go through ``RawHttpPool``, the cheapest client we have: the load
    generator shares the machine with the server and should cost it as little
    as it can. Responses are checked for status but not decoded.

    Another server (a peer of ``benchmarks/peers``) is a subclass that says how
    its protocol spells a request (``content_type``, ``infer_path``,
    ``encode_body``), what its inputs are (``discover``) and where its batch
    counters come from (``counters``); ``send``, the measured part, is this one.
    """

    kind = "http"

    def __init__(
        self, url: str, model: str, *, timeout: float = 60.0, protocol: str = "msgpack"
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}; one of {', '.join(PROTOCOLS)}")
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.protocol = protocol
        self.content_type = CONTENT_TYPES[protocol]
        # KServe v2: whether the model's inputs lead with a batch dimension
        # (max_batch_size >= 1, as in Triton), until discover() reads its config.
        self.batched = True
        self.specs: list[FeatureSpec] = []
        self.parameters: dict[str, Any] = {}
        self._config: dict[str, Any] | None = None
        self.infer_path = f"{urlsplit(self.url).path}/v2/models/{model}/infer"
        self._raw: RawHttpPool | None = None

    async def open(self) -> None:
        self._raw = RawHttpPool(self.url)
        try:
            await self.discover()
        except BaseException:
            await self.aclose()
            raise

    async def discover(self) -> None:
        """Learn the model's inputs (``specs``) and ``parameters`` from the server."""
        config = await self._get_json(f"/v2/models/{self.model}/config", missing_ok=True)
        if config is not None:
            self.specs = specs_from_config(config)
            self.parameters = dict(config.get("parameters") or {})
            self._config = _config_summary(config)
        else:
            config = await self._get_json(f"/v2/models/{self.model}")  # KServe v2 metadata
            self.specs = specs_from_metadata(config)
        if "max_batch_size" in config:
            self.batched = int(config["max_batch_size"]) >= 1

    async def _get_json(self, path: str, missing_ok: bool = False) -> Any:
        assert self._raw is not None, "open() first"
        status, body = await asyncio.wait_for(
            self._raw.send(self._raw.get_request(urlsplit(self.url).path + path)), self.timeout
        )
        if missing_ok and status == 404:
            return None
        if status != 200:
            raise RequestFailed(f"GET {path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    def encode(self, items: Sequence[Item]) -> bytes:
        """The whole request, bytes on the wire, built before the clock starts."""
        assert self._raw is not None, "open() first"
        body, headers = self.encode_body(items)
        return self._raw.request(self.infer_path, body, self.content_type, headers)

    def encode_body(self, items: Sequence[Item]) -> tuple[bytes, Mapping[str, str]]:
        """(body, extra headers) of one infer request for ``items``."""
        dtypes = {s.name: s.dtype for s in self.specs}
        encoded = encode_request(self.protocol, items, dtypes, batched=self.batched)
        return encoded.body, encoded.headers

    async def send(self, payload: bytes) -> None:
        assert self._raw is not None, "open() first"
        status, body = await asyncio.wait_for(self._raw.send(payload), self.timeout)
        if status != 200:
            error = decode_error(body)
            refused = status == 503 and error is not None and error.get("code") in REFUSED_CODES
            raise RequestFailed(_error_text(status, body), refused=refused)

    async def counters(self) -> Counters:
        stats = await self._get_json(f"/v2/models/{self.model}/stats")
        return counters_from_snapshot(stats.get("batching", {}))

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "kind": self.kind,
            "url": self.url,
            "model": self.model,
            "protocol": self.protocol,
        }
        if self._config is not None:
            described["config"] = self._config
        return described

    async def aclose(self) -> None:
        if self._raw is not None:
            await self._raw.close()
            self._raw = None


def _error_text(status: int, body: bytes) -> str:
    error = decode_error(body)
    if error is None:  # not a tensorserve error body (a proxy's, say)
        return f"HTTP {status}: {body[:200]!r}"
    return f"HTTP {status} {error['code']}: {error.get('error', '')}"


class InProcessTarget:
    """A ``ServedModel`` in this process: the batcher and the model with no
    HTTP, serialisation or sockets — the ceiling a server can approach.

    Give ``repository`` and ``model`` (plus config ``overrides`` such as
    ``policy="fifo"``) to load from a model repository, or ``served`` to
    benchmark a model you built yourself (``ServedModel.from_function``).
    ``intra_op_threads`` is the server setting of that name (``--intra-op-threads``;
    unset: cores - 1); an ``intra_op_threads`` key in ``overrides`` sets it
    too, so ``--variant t1:intra_op_threads=1`` means the same in-process and
    with ``--serve``.
    """

    kind = "in-process"

    def __init__(
        self,
        repository: str | None = None,
        model: str | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
        served: ServedModel | None = None,
        warmup: bool = True,
        intra_op_threads: int | None = None,
    ) -> None:
        if served is None and (repository is None or model is None):
            raise ValueError("give either repository and model, or served")
        self.repository = repository
        self.model = served.name if served is not None else str(model)
        self.overrides = dict(overrides or {})
        # A server setting, not a config.toml field: passed on its own.
        self.intra_op_threads = self.overrides.pop("intra_op_threads", intra_op_threads)
        self.warmup = warmup
        self.served = served
        self._owned = served is None
        self.specs: list[FeatureSpec] = []
        self.parameters: dict[str, Any] = {}

    async def open(self) -> None:
        served = self.served
        if served is None:
            assert self.repository is not None
            served = self.served = await asyncio.to_thread(self._load, self.repository)
        if self._owned:
            served.start()
            if self.warmup and served.config.warmup.enabled:
                await asyncio.to_thread(served.warmup)
        config = served.config.model_dump()
        self.specs = specs_from_config(config)
        self.parameters = dict(config.get("parameters") or {})

    def _load(self, repository: str) -> ServedModel:
        """``ServedModel.from_repository`` plus the server's thread setting."""
        from pathlib import Path

        from tensorserve.repository.loader import discover, read_config
        from tensorserve.serving import ServedModel

        sources = discover(Path(repository))
        if self.model not in sources:
            raise KeyError(f"no model {self.model!r} in {repository}; found {', '.join(sources)}")
        source = sources[self.model]
        config = read_config(source, self.overrides)
        return ServedModel.from_source(source, None, config, intra_op_threads=self.intra_op_threads)

    def encode(self, items: Sequence[Item]) -> list[Item]:
        return list(items)

    async def send(self, payload: list[Item]) -> None:
        assert self.served is not None, "open() first"
        await self.served.infer_many(payload)

    async def counters(self) -> Counters:
        assert self.served is not None, "open() first"
        return counters_from_snapshot(self.served.stats.snapshot(0))

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"kind": self.kind, "model": self.model}
        if self.repository is not None:
            described["repository"] = str(self.repository)
        if self.overrides:
            described["overrides"] = dict(self.overrides)
        if self.intra_op_threads is not None:
            described["intra_op_threads"] = self.intra_op_threads
        if self.served is not None:
            described["config"] = {
                **_config_summary(self.served.config.model_dump()),
                "device": str(self.served.device),
            }
        return described

    async def aclose(self) -> None:
        if self.served is not None and self._owned:
            await asyncio.to_thread(self.served.close)
            self.served = None


def _config_summary(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings that shape batching, for the result's provenance."""
    summary = {
        key: config[key] for key in ("max_batch_size", "instance_count", "device") if key in config
    }
    return {**summary, **dict(config.get("dynamic_batching") or {})}

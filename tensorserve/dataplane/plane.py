"""``DataPlane``: the one data path every front end calls.

    front end (HTTP, gRPC)        DataPlane
    ──────────────────────        ─────────
    a call arrives          ──▶   begin: its request id, on every log line;
                                  an infer call's span, when traced (from its
                                  headers' or metadata's traceparent, current
                                  while it runs, so its queued items carry it)
    an infer call           ──▶   infer: track (in flight, for shutdown) ->
                                  the model, ready -> receive -> decode ->
                                  infer_many (validate, admit, wait, within
                                  the deadline) -> encode
    the reply               ──▶   inject_trace: traceparent in its headers or
                                  metadata (only when ``call.span`` is set)
    its outcome             ──▶   observe_infer: request metrics by protocol,
                                  the encode span, the span's outcome and end;
                                  log_failure: one line per failed call
    ◀── the reply, or a tensorserve error the front end maps with the one
        table (errors.CODES: ``http_status``, ``grpc_status``)

A caller that leaves (an HTTP client that disconnects, a gRPC call the
client cancels) cancels its handler's task: its queued items are withdrawn
by the batcher, and the ``CancelledError`` is counted as ``disconnect``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from contextvars import Token
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tensorserve.dataplane.calls import Call, WireCall
from tensorserve.dataplane.lifecycle import Lifecycle
from tensorserve.dataplane.logs import REQUEST_ID, RateLimit, request_id_from
from tensorserve.metrics import Metrics
from tensorserve.metrics.requests import DISCONNECT, UNKNOWN_MODEL, rejection_reason
from tensorserve.pools import on_request_pool
from tensorserve.settings import Settings
from tensorserve.tracing import CallOrigin, RequestTracer, outcome_attributes
from tensorserve.wire.request import effective_timeout

if TYPE_CHECKING:  # the model-owning side's (a front-end process has neither)
    from tensorserve.serving.liveness import Liveness
    from tensorserve.serving.registry import ModelRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")


async def _maybe_in_thread(costly: bool, fn: Callable[..., T], *args: Any) -> T:
    return await on_request_pool(fn, *args) if costly else fn(*args)


class InFlight(Protocol):
    def inc(self, amount: float = 1) -> None: ...

    def dec(self, amount: float = 1) -> None: ...


class RequestObserver(Protocol):
    """Where a call's request metrics go: the Prometheus metrics of this
    process (``metrics/requests.py``), or a front end's report to the
    scheduler process that exports them (``frontends/report.py``)."""

    @property
    def in_flight(self) -> InFlight: ...

    def observe(
        self,
        protocol: str,
        model: str,
        version: str,
        code: str,
        status: int,
        items: int,
        seconds: float,
    ) -> None: ...

    def observe_encode(self, model: str, seconds: float) -> None: ...


class Observers(Protocol):
    @property
    def requests(self) -> RequestObserver: ...


class ModelLookup(Protocol):
    """What the infer path asks of the models: the registry in one process,
    a front end's copy of the scheduler process's table (``frontends/``)."""

    @property
    def entries(self) -> Mapping[str, Any]: ...

    def ready_model(self, name: str, version: str | None = None) -> Any: ...


class DataPlane:
    """The state every front end shares, each piece with one owner: the
    registry (its models' loading and closing are the app's start-up and
    clean-up, ``dataplane/assembly.py``), the metrics, the lifecycle (the server's,
    ``http/server.py``; None outside a running server: always
    serving), the rate limit of lines a client can cause, and the tracer
    (None unless tracing is configured; shut down with the registry).

    In a front-end process (``--frontends N``) the models live in the
    scheduler process: ``models`` is its table, ``remote`` asks it the
    answers of ``dataplane/models.py``, and there is no local registry,
    liveness or Prometheus registry."""

    def __init__(
        self,
        settings: Settings,
        registry: ModelRegistry | None,
        metrics: Metrics | Observers,
        liveness: Liveness | None,
        tracer: RequestTracer | None = None,
        *,
        models: ModelLookup | None = None,
        remote: Callable[[str, tuple[Any, ...]], Awaitable[Any]] | None = None,
    ) -> None:
        self.settings = settings
        self.tracer = tracer
        self._registry = registry
        self.models: ModelLookup = models if models is not None else _required(registry)
        self.remote = remote
        self.metrics = metrics
        self.liveness = liveness  # an instance thread stuck for good? (serving/liveness.py)
        self.lifecycle: Lifecycle | None = None
        # Lines a client can cause (4xx, rejections, disconnects): per code.
        self.log_limit = RateLimit()

    @property
    def registry(self) -> ModelRegistry:
        """This process's registry (not in a front-end process: it asks)."""
        return _required(self._registry)

    @property
    def local_metrics(self) -> Metrics:
        assert isinstance(self.metrics, Metrics), "a front end's metrics are the scheduler's"
        return self.metrics

    # -- request ids, shutdown ------------------------------------------------

    def begin(
        self, protocol: str, given_id: str | None, origin: CallOrigin | None = None
    ) -> tuple[Call, Token[str]]:
        """A new call: the caller's id when it is safe to echo, else a new one,
        set for every log line until ``end``. With an ``origin`` (a front end
        gives one for an infer call when ``self.tracer`` is set) its request
        span starts, continuing the caller's trace, current until
        ``observe_infer`` ends it: begin and observe_infer run in the call's
        own task."""
        call = Call(request_id_from(given_id), protocol)
        token = REQUEST_ID.set(call.request_id)
        if origin is not None and self.tracer is not None:
            call.origin = origin
            call.span = self.tracer.start_request(
                origin.carrier, origin.span_name(), origin.attributes(call.request_id)
            )
        return call, token

    @staticmethod
    def end(token: Token[str]) -> None:
        REQUEST_ID.reset(token)

    @property
    def draining(self) -> bool:
        """Whether readiness must say no because the server is shutting down."""
        return self.lifecycle is not None and self.lifecycle.draining

    def track(self) -> contextlib.AbstractContextManager[None]:
        """``Lifecycle.track`` (nothing, for a plane without a lifecycle)."""
        lifecycle = self.lifecycle
        return lifecycle.track() if lifecycle is not None else contextlib.nullcontext()

    # -- inference ------------------------------------------------------------

    async def infer(
        self,
        call: Call,
        model: str,
        version: str | None,
        wire: WireCall[T],
        transport_timeout_s: float | None = None,
    ) -> T:
        """One infer call, decode -> ``ServedModel.infer_many`` -> encode.
        ``transport_timeout_s`` is what the transport itself still allows (a
        gRPC deadline): the call's deadline is never later."""
        with self.track():  # in flight, for a shutdown's grace period
            settings = self.settings
            served = self.models.ready_model(model, version)
            call.model, call.version = served.name, str(served.version)
            # A latency target refuses before the body is read and decoded.
            served.refuse_if_late()
            await wire.receive()
            config = served.config
            decoded = await _maybe_in_thread(
                wire.decode_is_costly(), wire.decode, config, settings.max_items_per_request
            )
            call.items, call.kserve_id = len(decoded.items), decoded.id
            timeout = effective_timeout(  # the request's, the model's or the server's
                decoded.timeout,
                config.default_timeout_ms,
                settings.default_timeout_ms,
                settings.max_timeout_ms,
            )
            if transport_timeout_s is not None:
                timeout = max(0.0, min(timeout, transport_timeout_s))
            results = await served.infer_many(
                decoded.items,
                timeout=timeout,
                priority=decoded.parameters.get("priority"),
                parameters=decoded.parameters,  # the model's declared ones reach its forward
                bytes_limits=settings.bytes_limits(),
            )
            encode_started = time.perf_counter()
            encoded = await _maybe_in_thread(
                wire.encode_is_costly(decoded, results),
                wire.encode,
                decoded,
                results,
                served.name,
                str(served.version),
                config,
            )
            call.encode_started = encode_started
            call.encode_seconds = time.perf_counter() - encode_started
            return encoded

    # -- what a call leaves behind: metrics, log lines ---------------------------

    def model_label(self, call: Call, route_name: str | None) -> tuple[str, str]:
        """(model, version) labels: the served model's, or the name asked for
        when the registry knows it (not ready), else ``_unknown`` (so a scan
        of random names cannot add series)."""
        if call.model is not None:
            return call.model, call.version
        if route_name is not None and route_name in self.models.entries:
            return route_name, ""
        return UNKNOWN_MODEL, ""

    def observe_infer(
        self, call: Call, route_name: str | None, code: str, status: int, seconds: float
    ) -> None:
        """The request metrics of one finished (or abandoned) infer call;
        ``status`` is its HTTP status, or its code's for a gRPC call. A traced
        call's span ends here, with its outcome."""
        if call.span is not None:
            self._finish_span(call, code, status)
        model, version = self.model_label(call, route_name)
        requests = self.metrics.requests
        requests.observe(call.protocol, model, version, code, status, call.items, seconds)
        if call.encode_seconds is not None:
            requests.observe_encode(model, call.encode_seconds)

    def inject_trace(self, call: Call, headers: MutableMapping[str, str]) -> None:
        """The call's ``traceparent`` into its reply's headers (HTTP) or
        metadata (gRPC); call only when ``call.span`` is set."""
        assert self.tracer is not None
        self.tracer.inject(call.span, headers)

    def _finish_span(self, call: Call, code: str, status: int) -> None:
        tracer, span, origin = self.tracer, call.span, call.origin
        assert tracer is not None and origin is not None
        call.span = None  # ended once, whatever comes next
        if not tracer.recording(span):  # unsampled: it only leaves the context
            tracer.finish_request(span, {}, False)
            return
        if call.encode_seconds is not None:
            tracer.stage(span, "encode", call.encode_started, call.encode_seconds)
        # A caller that left is no fault of the server (gRPC observes it as a 500).
        failed = status >= 500 and code != DISCONNECT
        attributes = outcome_attributes(code, failed, call.model, call.version, call.items)
        attributes.update(origin.outcome(code, status))
        tracer.finish_request(span, attributes, failed)

    def log_failure(
        self,
        call: Call | None,
        where: str,
        status: int | str,
        code: str,
        message: str,
        exc: BaseException,
        server_fault: bool,
    ) -> None:
        """One line per failed call: a fault of the server or the model at
        ERROR with its traceback; a caller's error or a rejection (queue full,
        deadline, not ready) at WARNING, a few lines per code every 10 s, so a
        flood of bad requests cannot flood the log."""
        if call is not None and call.kserve_id is not None:
            where += f" (id {call.kserve_id!r})"
        if server_fault:
            log.error("%s -> %s %s: %s", where, status, code, message, exc_info=exc)
            return
        allowed, dropped = self.log_limit.allow(code)
        if allowed:
            more = f" ({dropped} more since the last line)" if dropped else ""
            log.warning("%s -> %s %s: %s%s", where, status, code, message, more)

    def log_disconnect(self, where: str) -> None:
        allowed, dropped = self.log_limit.allow("disconnect")
        if allowed:
            more = f" ({dropped} more since the last line)" if dropped else ""
            log.info("%s: the client disconnected before the answer%s", where, more)


def _required(registry: ModelRegistry | None) -> ModelRegistry:
    assert registry is not None, "a front-end process has no registry: it asks the scheduler's"
    return registry


def is_server_fault(code: str, status: int) -> bool:
    """A failure that is the server's or the model's, not the caller's."""
    return status >= 500 and rejection_reason(code, status) is None

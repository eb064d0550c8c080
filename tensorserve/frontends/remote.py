"""A front end's end of its socket to the scheduler process: ``Scheduler``,
and ``RemoteModel``, what the data plane's infer path calls in place of a
``ServedModel`` in a front-end process.

A front end decodes and validates each request with the server's own codecs
and validator, against the served config the scheduler process published
(``frontends/table.py``), then sends only the items' arrays and what their
model's scheduler needs (deadline, priority level, parameter values); the
scheduler process trusts them. Its caller's deadline is kept here, as
``Batcher.infer_many`` keeps it in one process: a caller that times out or
leaves is answered here at once, and its items are withdrawn there.

If the scheduler process dies, or the link to it breaks (a message that
cannot be read), the front end cannot serve: it answers every request it
holds with a 503 at once, refuses new ones, and exits once they are written
(``EXIT_GRACE_S`` at most): the supervisor starts another in its place (if
the scheduler process died, the platform restarts the pod).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorserve.dataplane.lag import LoopLag
from tensorserve.dataplane.logs import REQUEST_ID, logged_as
from tensorserve.errors import DeadlineExceeded, InvalidInput, ModelNotReady, WouldMissTarget
from tensorserve.frontends.protocol import (
    Outbox,
    callers,
    check_crossable,
    error_from,
    in_runs,
    split_items,
    unsendable_error,
)
from tensorserve.frontends.report import REPORT_S, FrontEndMetrics
from tensorserve.ipc import messages
from tensorserve.ipc.link import Link
from tensorserve.metrics.processes import cpu_seconds
from tensorserve.repository.config import ModelConfig
from tensorserve.serving.entries import ModelState, lookup, ready
from tensorserve.settings import DEFAULT_BYTES_LIMITS, BytesLimits
from tensorserve.tensors.results import RowResult
from tensorserve.wire.validate import priority_level, validate_item, validate_parameters

log = logging.getLogger(__name__)

# The exit status of a front end whose scheduler process has gone.
EXIT_SCHEDULER_GONE = 3
# How long a front end that lost its scheduler process waits for the 503s it
# answered to be written before it exits; and after the last is answered
# (its count drops before aiohttp writes the response).
EXIT_GRACE_S = 2.0
EXIT_WRITE_S = 0.2


class RemoteModel:
    """A model served by the scheduler process, as the infer path sees it."""

    def __init__(
        self,
        scheduler: Scheduler,
        name: str,
        version: int,
        config: ModelConfig,
        ensemble: bool,
        generation: int,
    ) -> None:
        self.scheduler = scheduler
        self.name, self.version, self.config = name, version, config
        self.ensemble = ensemble
        # Which load of the model ``config`` is: sent with each request, so a
        # request validated against a config reloaded since is refused there.
        self.generation = generation

    def refuse_if_late(self) -> None:
        """``WouldMissTarget`` when the scheduler process last said that one
        more item would miss this model's latency target."""
        late = self.scheduler.late.get(self.name)
        if late is not None:
            self.scheduler.metrics.requests.refused(self.name)
            raise WouldMissTarget(late[0], retry_after=late[1])

    async def infer_many(
        self,
        items: Sequence[Mapping[str, Any]],
        *,
        timeout: float | None = None,
        priority: Any = None,
        parameters: Mapping[str, Any] | None = None,
        bytes_limits: BytesLimits = DEFAULT_BYTES_LIMITS,
    ) -> list[dict[str, np.ndarray]]:
        """Validated here (the one validator), answered there."""
        config = self.config
        rows = [validate_item(item, config.input, i, bytes_limits) for i, item in enumerate(items)]
        if self.ensemble:  # its steps validate their own: it takes the request's own values
            level, values = priority, dict(parameters or {})
            check_crossable(values, level)  # but each must cross to them: else its 400
        else:
            level = priority_level(priority, config.dynamic_batching, self.name)
            specs = config.request_parameter
            values = validate_parameters(parameters, specs, self.name) if specs else {}
            if values:  # (a string may hold a lone surrogate, which cannot cross)
                check_crossable(values)
        return await self.scheduler.infer(self, rows, timeout, level, values)


@dataclass
class RemoteEntry:
    """A front end's copy of one registry entry."""

    name: str
    version: int | None
    state: ModelState
    reason: str
    served: RemoteModel | None


class Scheduler:
    """The scheduler process, as one front end reaches it: the model table
    it published, and requests and questions sent to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.entries: dict[str, RemoteEntry] = {}
        self.late: dict[str, Any] = {}
        self.metrics = FrontEndMetrics()
        self.loop_lag = LoopLag()
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._asked: dict[int, asyncio.Future[Any]] = {}
        self._link: Link | None = None
        self._outbox: Outbox | None = None
        self._reporting: asyncio.TimerHandle | None = None
        self.table_received = asyncio.Event()
        self.gone = False  # the link to the scheduler process broke: nothing more is sent
        # The current request span's traceparent, when tracing is on: the
        # scheduler process's batch spans join the request's trace.
        self.traceparent: Callable[[], str | None] | None = None

    # -- life ------------------------------------------------------------------
    def connect(self) -> None:
        """Start talking, on the running loop: at the app's start-up, or at
        the first call (gRPC starts serving before the app's start-up runs)."""
        if self._link is not None:
            return
        loop = asyncio.get_running_loop()
        self._link = Link(self.sock, loop, self._message, self._gone, many=True)
        self._outbox = Outbox(loop, self._link.send, self._add_report, self._unsendable)
        self.loop_lag.start()
        self._report()

    def close(self) -> None:
        if self._reporting is not None:
            self._reporting.cancel()
        self.loop_lag.stop()
        if self._outbox is not None:  # the last metrics, the calls of the drain among them
            self._outbox.put("report", {"cpu": cpu_seconds(), "lag": self.loop_lag.seconds})
            self._outbox.flush()
        if self._link is not None:
            self._link.close()

    def _gone(self) -> None:
        """The link broke: every caller waiting is answered (503), new ones
        are refused, and the process exits once the answers are written."""
        log.critical("the scheduler process has gone: this front end cannot serve, exiting")
        self.gone = True
        waiting = [*self._waiting.values(), *self._asked.values()]
        self._waiting.clear()
        for answer in waiting:
            if not answer.done():
                answer.set_exception(_lost())
        loop = asyncio.get_running_loop()
        self._exit_when_answered(loop, loop.time() + EXIT_GRACE_S)

    def _exit_when_answered(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self.metrics.requests.in_flight.value > 0 and loop.time() < deadline:
            loop.call_later(0.05, self._exit_when_answered, loop, deadline)
            return
        loop.call_later(EXIT_WRITE_S, _exit_now)

    # -- lookups (the data plane's ModelLookup) ---------------------------------
    def ready_model(self, name: str, version: str | None = None) -> RemoteModel:
        if self.gone:
            raise _lost()
        if not self.table_received.is_set():
            self.connect()
            raise ModelNotReady(f"model {name!r} is not ready: the server is starting")
        served: RemoteModel = ready(lookup(self.entries, name, version))
        return served

    # -- asking ------------------------------------------------------------------
    async def ask(self, what: str, args: tuple[Any, ...]) -> Any:
        """The scheduler process's ``dataplane/models.py`` answer."""
        self.connect()
        assert self._outbox is not None
        if self.gone:
            raise _lost()
        aid = next(self._ids)
        answer = self._outbox.loop.create_future()
        self._asked[aid] = answer
        self._outbox.add("ask", [aid, what, list(args)])
        try:
            return await answer
        finally:
            self._asked.pop(aid, None)

    async def infer(
        self,
        model: RemoteModel,
        rows: list[dict[str, np.ndarray]],
        timeout: float | None,
        level: Any,
        values: dict[str, Any],
    ) -> list[dict[str, np.ndarray]]:
        outbox = self._outbox
        assert outbox is not None
        if not rows:  # nothing to ask for (the codecs refuse an empty request first)
            return []
        if self.gone:
            raise _lost()
        loop = outbox.loop
        rid = next(self._ids)
        names = list(rows[0])
        tensors = [row[name] for row in rows for name in names]
        traced = self.traceparent() if self.traceparent is not None else None
        outbox.add(
            "infer",
            [  # a records.Request, as the array it crosses as: its fields in order
                rid,
                model.name,
                str(model.version),
                model.generation,
                timeout,
                level,
                values,
                names,
                len(rows),
                traced,
                REQUEST_ID.get(),  # the scheduler process's lines about it carry it too
            ],
            tensors,
        )
        answer = loop.create_future()
        self._waiting[rid] = answer
        timer = (
            None
            if timeout is None
            else loop.call_later(timeout, _time_out, answer, model.name, timeout)
        )
        try:
            results: list[dict[str, np.ndarray]] = await answer
            return results
        finally:
            if timer is not None:
                timer.cancel()
            if self._waiting.pop(rid, None) is not None:  # timed out, or the caller left
                outbox.add("cancel", rid)

    def _unsendable(self, section: str, entry: Any, exc: Exception) -> list[Any]:
        """An entry the outbox could not pack (``Outbox._sendable``): its
        callers are answered here, the rest of the message goes on. Admission
        refuses what it can foresee (``check_crossable``); what still gets
        here fails its own request only."""
        if section == "infer":
            error = unsendable_error(entry, exc)
            for rid, request_id in callers(entry):
                with logged_as(request_id):
                    log.error("request %d could not be sent: %s", rid, error.message)
                answer = self._waiting.pop(rid, None)  # popped: no cancel will follow
                if answer is not None and not answer.done():
                    answer.set_exception(error)
        elif section == "ask":
            log.error("a question (%r) could not be sent: %r", entry[1], exc)
            asked = self._asked.get(entry[0])
            if asked is not None and not asked.done():
                asked.set_exception(InvalidInput(f"the request cannot be passed on: {exc}"))
        else:
            log.error("a %r entry could not be sent, dropped: %r", section, exc)
        return []

    # -- in ----------------------------------------------------------------------
    def _message(self, message: messages.InOrder) -> None:
        header, tensors = message
        if "replies" in header:  # first: a table that fails to parse must not cost them
            self._replies(header["replies"], tensors)
        if "models" in header:
            self._models(header["models"])
        if "late" in header:
            self.late = header["late"]
        for aid, ok, value in header.get("answers", ()):
            answer = self._asked.get(aid)
            if answer is not None and not answer.done():
                if ok:
                    answer.set_result(value)
                else:
                    answer.set_exception(error_from(value))

    def _models(self, table: list[Any]) -> None:
        entries = {}
        for name, version, state, reason, config, ensemble, generation in table:
            kept = self.entries.get(name)
            served = None
            if state == ModelState.READY.value and config is not None:
                if (
                    kept is not None
                    and kept.served is not None
                    and kept.served.generation == generation
                ):
                    served = kept.served  # the same load: no need to parse its config again
                else:
                    parsed = ModelConfig.model_validate(config)
                    served = RemoteModel(self, name, version, parsed, ensemble, generation)
            entries[name] = RemoteEntry(name, version, ModelState(state), reason, served)
        self.entries = entries
        self.table_received.set()

    def _replies(self, replies: list[Any], arrays: list[np.ndarray]) -> None:
        start = 0
        for reply in replies:
            if type(reply[0]) is list:  # a run: [[rid, ...], names], one plain item each
                rids, names = reply
                items, start = split_items(arrays, start, names, len(rids))
                for rid, item in zip(rids, items):
                    answer = self._waiting.pop(rid, None)
                    if answer is not None and not answer.done():
                        answer.set_result([item])
                continue
            rid, names, parameters = reply
            answer = self._waiting.pop(rid, None)
            if names is None:  # [rid, None, error]
                if answer is not None and not answer.done():
                    answer.set_exception(error_from(parameters))
                continue
            results: list[dict[str, np.ndarray]] = []
            for i, item_names in enumerate(names):
                (result,), start = split_items(arrays, start, item_names, 1)
                results.append(RowResult(result, parameters[i]) if parameters else result)
            if answer is not None and not answer.done():
                answer.set_result(results)

    # -- reports -----------------------------------------------------------------
    def _add_report(self, outbox: Outbox) -> None:
        """Before each message: its plain requests go as runs (``in_runs``).
        The calls observed since the last report ride with the periodic
        report, and with any question (the metrics' text then counts them)."""
        requests = outbox.sections.get("infer")
        if requests is not None and len(requests) > 1:
            outbox.sections["infer"] = in_runs(requests)
        report = outbox.sections.get("report")
        if report is not None or "ask" in outbox.sections:
            outbox.sections["report"] = {**(report or {}), **self.metrics.requests.take()}

    def _report(self) -> None:
        assert self._outbox is not None
        self._outbox.put("report", {"cpu": cpu_seconds(), "lag": self.loop_lag.seconds})
        self._reporting = self._outbox.loop.call_later(REPORT_S, self._report)


def _lost() -> ModelNotReady:
    return ModelNotReady("this front end lost its link to the scheduler process: retry the request")


def _exit_now() -> None:
    logging.shutdown()
    os._exit(EXIT_SCHEDULER_GONE)


def _time_out(answer: asyncio.Future[Any], name: str, timeout: float) -> None:
    if not answer.done():
        answer.set_exception(DeadlineExceeded(f"model {name!r}: no result within {timeout} s"))

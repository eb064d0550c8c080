"""The scheduler process's end of the front ends: ``FrontEndHub``.

Each front end is one ``Connection`` (a ``Link`` on the scheduler process's
loop, the loop every model's scheduler runs on). What a front end sends in
one message is admitted in one pass (``frontends/intake.py``): each
request's items, already decoded and validated by the front end with the
server's own codecs, go straight into their model's queue, and each
model's scheduler is woken once for the whole message, so requests from
every front end share batches. Each item is answered through a
``ReplySlot`` (what the scheduler resolves in place of a future,
``requests.py``); a request whose items are all answered joins its front
end's outbox, which leaves once per loop iteration.

A front end that dies (its socket closes) takes nothing with it: its
requests' items still queued leave the queue, and what is running is
answered into nothing. The scheduler never waits on a front end.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorserve.dataplane import models as answers
from tensorserve.dataplane.logs import logged_as
from tensorserve.dataplane.plane import DataPlane, is_server_fault
from tensorserve.errors import ModelFailure, TensorServeError
from tensorserve.frontends.intake import InFlight, Intake
from tensorserve.frontends.liveness import Liveness, Stuck, cpu_ticks
from tensorserve.frontends.pacing import ReadPacing
from tensorserve.frontends.protocol import Outbox, error_entry
from tensorserve.frontends.requests import RemoteRequest, ReplySlot
from tensorserve.frontends.table import (
    Generations,
    LatePublisher,
    late_models,
    model_table,
    table_key,
    targeted_models,
)
from tensorserve.ipc import messages
from tensorserve.ipc.link import Link
from tensorserve.serving.model import ServedModel
from tensorserve.tensors.results import row_parameters

log = logging.getLogger(__name__)

# How often the hub looks for a changed model table (poll mode reloads,
# failures) and for a stuck front end (``liveness.py``): a load or unload
# asked through a front end publishes at once.
TABLE_CHECK_S = 0.25


class Connection:
    """One front end: its link, its outbox, its requests in flight."""

    def __init__(self, hub: FrontEndHub, sock: socket.socket, pid: int) -> None:
        self.hub, self.pid = hub, pid
        self.link = Link(sock, hub.loop, self._message, self._lost, many=True)
        self.outbox = Outbox(hub.loop, self.link.send, unsendable=self._unsendable)
        self.requests: dict[int, InFlight] = {}
        self.in_flight = 0  # as it last reported
        self.liveness = Liveness(hub.loop.time())  # when it last sent anything, its CPU time

    # -- in ---------------------------------------------------------------------
    def _message(self, message: messages.InOrder) -> None:
        self.liveness.heard = self.hub.loop.time()
        header, tensors = message
        if "report" in header:
            self.hub.reported(self, header["report"])
        for rid in header.get("cancel", ()):
            self._cancel(rid)
        if "infer" in header:
            self.hub.intake.admit(self, header["infer"], tensors)
        for aid, what, args in header.get("ask", ()):
            self.hub.ask(self, aid, what, args)
        self.hub.pacing.after_message(self.link)

    def _cancel(self, rid: int) -> None:
        request = self.requests.pop(rid, None)
        if isinstance(request, (ReplySlot, RemoteRequest)):
            request.withdraw()
        elif request is not None:
            request.cancel()

    def _lost(self) -> None:
        """The front end died, or its stream broke: its requests leave the
        queues, and its socket closes (a front end still alive sees that and
        exits, and is restarted, rather than writing to nobody)."""
        for rid in list(self.requests):
            self._cancel(rid)
        self.link.sock.close()
        self.hub.detached(self)

    # -- out --------------------------------------------------------------------
    def reply(self, rid: int, results: Sequence[Any]) -> None:
        self.reply_many([(rid, results)])

    def reply_rows(self, rids: Sequence[int], rows: Sequence[dict[str, np.ndarray]]) -> None:
        """Answer one-item requests with their rows of one batch (plain
        results, all with the same outputs), those still waited for, as one
        run: [[rid, ...], names] (``protocol``)."""
        requests, answered = self.requests, []
        tensors: list[np.ndarray] = []
        for rid, row in zip(rids, rows):
            if requests.pop(rid, None) is not None:  # else cancelled meanwhile
                answered.append(rid)
                tensors.extend(row.values())
        if answered:
            self.outbox.add("replies", [answered, list(rows[0])], tensors)

    def reply_many(self, replies: Sequence[tuple[int, Sequence[Any]]]) -> None:
        """Answer each (request id, its items' results) still waited for."""
        requests, entries = self.requests, []
        tensors: list[np.ndarray] = []
        for rid, results in replies:
            if requests.pop(rid, None) is None:
                continue  # cancelled meanwhile: nobody waits for it
            names = [list(result) for result in results]
            parameters = [row_parameters(result) for result in results]
            entries.append([rid, names, parameters if any(parameters) else None])
            tensors.extend(array for result in results for array in result.values())
        if entries:
            self.outbox.add_many("replies", entries, tensors)

    def fail(
        self,
        rid: int,
        exc: BaseException,
        *,
        admitted: bool = True,
        request_id: str | None = None,
    ) -> None:
        """Answer ``exc``; an ``admitted`` request only if still waited for.
        A fault of the model or the server is logged here, with its
        traceback (the model's own frames, which do not cross), as about
        ``request_id`` (None: the request whose id is current)."""
        if self.requests.pop(rid, None) is None and admitted:
            return
        entry = error_entry(exc)
        if not isinstance(exc, TensorServeError) or is_server_fault(exc.code, exc.http_status):
            with logged_as(request_id):
                log.error(
                    "front end pid %d, request %d -> %s: %s",
                    self.pid,
                    rid,
                    exc.code if isinstance(exc, TensorServeError) else "internal",
                    entry[1],
                    exc_info=exc,
                )
        self.outbox.add("replies", [rid, None, entry])

    def _unsendable(self, section: str, entry: Any, exc: Exception) -> list[Any]:
        """An entry its outbox could not pack (``Outbox._sendable``): a
        reply becomes its request's error (output parameters a model made
        that cannot cross), an answer the question's; the rest still goes."""
        log.error("front end pid %d: a %r entry cannot be sent: %r", self.pid, section, exc)
        if section == "replies":
            rids = entry[0] if type(entry[0]) is list else [entry[0]]
            error = error_entry(ModelFailure(f"its results cannot be passed on: {exc!r}"))
            return [[rid, None, error] for rid in rids]
        if section == "answers":
            error = error_entry(
                TensorServeError(f"internal error: the answer cannot be passed on: {exc!r}")
            )
            return [[entry[0], False, error]]
        return []

    def close(self) -> None:
        self.link.close()
        self.link.sock.close()


class FrontEndHub:
    """Every front end of this scheduler process (``frontends/supervisor.py``
    attaches and detaches them); runs on the process's one loop."""

    def __init__(self, plane: DataPlane, loop: asyncio.AbstractEventLoop) -> None:
        self.plane, self.loop = plane, loop
        self.connections: dict[int, Connection] = {}
        self._generations = Generations()
        self.intake = Intake(plane, loop, self._generations, lambda: self._check_table(False))
        self.pacing = ReadPacing(plane, loop, self.intake.held_wakes)  # when sockets are read
        self._key: tuple[Any, ...] | None = None
        self._table: list[Any] = []
        self._asking: set[asyncio.Task[None]] = set()
        # Called with the pid of a front end that is stuck (the supervisor kills it).
        self.on_silent: Callable[[int, Stuck], None] | None = None
        self._late = LatePublisher(lambda: late_models(plane), self._publish_late)
        self._checking: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._check_table()

    def stop(self) -> None:
        if self._checking is not None:
            self._checking.cancel()
        self._late.stop()
        self.pacing.stop()
        for connection in list(self.connections.values()):
            connection.close()
        self.connections.clear()

    def attach(self, sock: socket.socket, pid: int) -> Connection:
        connection = Connection(self, sock, pid)
        self.connections[pid] = connection
        connection.outbox.put("models", self._table)
        self._late.send_to(connection.outbox)
        return connection

    def detached(self, connection: Connection) -> None:
        if self.connections.get(connection.pid) is connection:
            del self.connections[connection.pid]
        self.plane.local_metrics.processes.forget(connection.pid)
        self._count_in_flight()

    # -- answers about the server and its models ---------------------------------
    def ask(self, connection: Connection, aid: int, what: str, args: list[Any]) -> None:
        task = self.loop.create_task(self._answer(connection, aid, what, args))
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _answer(self, connection: Connection, aid: int, what: str, args: list[Any]) -> None:
        try:
            value = await answers.answer(self.plane, what, *args)
        except Exception as exc:
            if not isinstance(exc, TensorServeError):
                log.error(
                    "front end %d asked %s: the server failed", connection.pid, what, exc_info=exc
                )
            self._check_table(reschedule=False)
            connection.outbox.add("answers", [aid, False, error_entry(exc)])
            return
        self._check_table(reschedule=False)  # a load or unload: the table goes first
        connection.outbox.add("answers", [aid, True, value])

    # -- what every front end is told -------------------------------------------
    def _check_silent(self) -> None:
        """A front end alive but stuck (silent, and its CPU time still:
        stopped, deadlocked) takes its share of the connections and serves
        none of them: it is killed, and restarted as any front end that dies
        (``on_silent``). One silent but busy is left to finish (``liveness.py``)."""
        now = self.loop.time()
        for connection in list(self.connections.values()):
            stuck = connection.liveness.check(now, functools.partial(cpu_ticks, connection.pid))
            if stuck is not None and self.on_silent is not None:
                self.on_silent(connection.pid, stuck)

    def _check_table(self, reschedule: bool = True) -> None:
        key = table_key(self.plane.registry, self._generations)
        if key != self._key:
            self._key = key
            self._table = table = model_table(self.plane.registry, self._generations)
            for connection in self.connections.values():
                connection.outbox.put("models", table)
            self._late.models_changed(bool(targeted_models(self.plane)))
        if reschedule:
            self._check_silent()
            self._checking = self.loop.call_later(TABLE_CHECK_S, self._check_table)

    def _publish_late(self, late: dict[str, Any]) -> None:
        for connection in self.connections.values():
            connection.outbox.put("late", late)

    # -- what the front ends report ----------------------------------------------
    def reported(self, connection: Connection, report: dict[str, Any]) -> None:
        metrics = self.plane.local_metrics
        for outcome in report.get("requests", ()):
            metrics.requests.observe_many(*outcome)
        for model, counts, total in report.get("encode", ()):
            metrics.requests.observe_encode_many(model, counts, total)
        for model, refusals in report.get("refused", ()):
            entry = self.plane.registry.entries.get(model)
            served = entry.served if entry is not None else None
            if isinstance(served, ServedModel) and served.batcher.latency_target is not None:
                served.batcher.latency_target.count_refused(refusals)
        if "cpu" in report:
            metrics.processes.report("frontend", connection.pid, report["cpu"], report["lag"])
        if "in_flight" in report:
            connection.in_flight = report["in_flight"]
            self._count_in_flight()

    def _count_in_flight(self) -> None:
        total = sum(c.in_flight for c in self.connections.values())
        self.plane.local_metrics.requests.in_flight.set(total)

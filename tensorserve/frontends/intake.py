"""What one front end's message admits into its models' queues: ``Intake``.

A message's "infer" section holds ``records.Request``s and ``records.Run``s
(``protocol.in_runs``), read by name. Every request is admitted by one path,
``_admit``: its model looked up and its generation checked, then its items
queued (``Batcher.submit_into``) with a ``ReplySlot`` each, or its ensemble
started; a refusal is its caller's answer, and the next request goes on.

A run (consecutive one-item requests for one model with nothing of their
own but their arrays: most of what a front end sends) is a shortcut in
front of that path: it goes in whole (one lookup of the model, one check of
its generation, one pass through its admission lock, one count in its
statistics) instead of each request paying for all of it, since the
scheduler process's CPU per request is what caps one GPU, whatever the
number of front ends. Admission takes a run whole or not at all: a run that
cannot go whole (an ensemble, a model with a latency target, a reload, a
queue without room for all of it) leaves nothing queued, and each of its
requests then goes through ``_admit`` as if it came alone, so each gets the
answer it would have got alone (queue full, too late, not ready).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from tensorserve.batching.admission import NO_PARAMETERS
from tensorserve.batching.batcher import Batcher
from tensorserve.dataplane.logs import REQUEST_ID
from tensorserve.dataplane.plane import DataPlane
from tensorserve.ensemble import Ensemble
from tensorserve.errors import ModelNotReady
from tensorserve.frontends.protocol import split_items
from tensorserve.frontends.records import Request, Run
from tensorserve.frontends.requests import Answerer, RemoteRequest, ReplySlot, one_item
from tensorserve.frontends.table import Generations
from tensorserve.serving.text import TextServedModel

# What a front end has in flight here, by its request id: a cancel withdraws it.
InFlight = ReplySlot | RemoteRequest | asyncio.Task[Any]


class Connection(Answerer, Protocol):
    """A front end as admission sees it (``hub.Connection``)."""

    requests: dict[int, InFlight]

    def reply(self, rid: int, results: Sequence[Any]) -> None: ...


class Intake:
    """Admits what the front ends send; the hub owns it (and the model
    generations it checks requests against)."""

    def __init__(
        self,
        plane: DataPlane,
        loop: asyncio.AbstractEventLoop,
        generations: Generations,
        table_changed: Callable[[], None],
    ) -> None:
        self.plane, self.loop = plane, loop
        self.generations = generations
        self._table_changed = table_changed  # publish the model table now (a reload)
        # While not None, the schedulers to wake once several messages are in
        # (``held_wakes``), instead of after each.
        self._held: dict[int, Batcher] | None = None

    def admit(
        self, connection: Connection, entries: list[list[Any]], arrays: list[np.ndarray]
    ) -> None:
        """Queue every request of one message, in order; wake each model's
        scheduler once, after the whole message."""
        start = 0
        woken: dict[int, Batcher] = {}
        try:
            for entry in entries:
                if type(entry[0]) is list:  # a run (protocol.in_runs)
                    start = self._admit_run(connection, Run(*entry), arrays, start, woken)
                else:
                    start = self._admit(connection, Request(*entry), arrays, start, woken)
        finally:
            if self._held is not None:
                self._held.update(woken)
            else:
                _wake(woken)

    @contextlib.contextmanager
    def held_wakes(self) -> Iterator[None]:
        """Admit every message read meanwhile before any model forms a batch
        from them (then wake each once): what waited in the sockets while
        the models were busy goes into the next batches together, not the
        first message alone into a batch of its own (``pacing.py``)."""
        self._held, held = {}, self._held
        try:
            yield
        finally:
            woken, self._held = self._held, held
            _wake(woken)

    def _admit_run(
        self,
        connection: Connection,
        run: Run,
        arrays: list[np.ndarray],
        start: int,
        woken: dict[int, Batcher],
    ) -> int:
        """Queue a run whole, if nothing stands in the way; else admit each
        of its requests as if it came alone (``_admit``), so each gets the
        answer it would have got alone. Where the next entry's arrays begin."""
        batcher = self._takes_whole(run)
        if batcher is not None:
            after = self._queue_run(connection, run, batcher, arrays, start, woken)
            if after is not None:
                return after
        for request in run.requests():
            start = self._admit(connection, request, arrays, start, woken)
        return start

    def _queue_run(
        self,
        connection: Connection,
        run: Run,
        batcher: Batcher,
        arrays: list[np.ndarray],
        start: int,
        woken: dict[int, Batcher],
    ) -> int | None:
        """Queue a run whole: where the next entry's arrays begin, or None
        (refused whole, nothing queued)."""
        items, after = split_items(arrays, start, run.names, len(run.rids))  # one item each
        slots = [
            one_item(connection, rid, request_id, batcher)
            for rid, request_id in zip(run.rids, run.request_ids)
        ]
        try:
            entries = batcher.submit_into(
                items,
                slots,
                self.loop,
                timeout=run.timeout,
                priority=run.priority,
                parameters=NO_PARAMETERS,
                wake=False,
                one_per_request=True,
            )
        except Exception:  # noqa: BLE001 - refused whole, nothing queued: each on its own
            return None
        for slot, entry in zip(slots, entries):
            slot.entry = entry
        connection.requests.update(zip(run.rids, slots))
        woken[id(batcher)] = batcher
        return after

    def _takes_whole(self, run: Run) -> Batcher | None:
        """The batcher of a run's model, if the run may be queued as one:
        the model is ready and of the generation the run was validated
        against, not an ensemble nor a text model (an ensemble's steps, a
        text model's tokenizing: each request on its own), and without a
        latency target (whose refusals are counted per request)."""
        try:
            served = self.plane.registry.ready_model(run.model, run.version)
        except Exception:  # noqa: BLE001 - each request is then answered on its own
            return None
        if (
            isinstance(served, (Ensemble, TextServedModel))
            or served.batcher.latency_target is not None
            or not self.generations.current(run.model, served, run.generation)
        ):
            return None
        return served.batcher

    def _admit(
        self,
        connection: Connection,
        request: Request,
        arrays: list[np.ndarray],
        start: int,
        woken: dict[int, Batcher],
    ) -> int:
        """Queue one request (or start its ensemble), or answer why not;
        where the next entry's arrays begin. Its caller's id is current
        meanwhile, as in one process: a line logged, or by its ensemble's
        task, carries it; and a traced request's span (in its front end), so
        its batch's and steps' spans join its trace."""
        items, after = split_items(arrays, start, request.names, request.items)
        token = REQUEST_ID.set(request.request_id)
        try:
            tracer = self.plane.tracer
            traceparent = request.traceparent
            if traceparent and tracer is not None:
                tracer.request_context(traceparent).run(
                    self._queue, connection, request, items, woken
                )
            else:
                self._queue(connection, request, items, woken)
        finally:
            REQUEST_ID.reset(token)
        return after

    def _queue(
        self,
        connection: Connection,
        request: Request,
        items: list[dict[str, np.ndarray]],
        woken: dict[int, Batcher],
    ) -> None:
        rid, model = request.rid, request.model
        try:
            served = self.plane.registry.ready_model(model, request.version)
            if not self.generations.current(model, served, request.generation):
                # Validated against another config than the one serving now
                # (a reload the front end had not heard of): never batched.
                self._table_changed()
                raise ModelNotReady(
                    f"model {model!r} was reloaded while this request was on its way; retry it"
                )
            if isinstance(served, Ensemble):
                coroutine = served.infer_many(
                    items,
                    timeout=request.timeout,
                    priority=request.priority,
                    parameters=request.parameters,
                    bytes_limits=self.plane.settings.bytes_limits(),
                )
                _answer_when_done(connection, rid, self.loop.create_task(coroutine))
                return
            if isinstance(served, TextServedModel):
                # Validated by the front end; tokenized here, off the loop, then queued.
                text = served.infer_validated(
                    items,
                    timeout=request.timeout,
                    level=request.priority,
                    values=request.parameters or NO_PARAMETERS,
                )
                _answer_when_done(connection, rid, self.loop.create_task(text))
                return
            batcher = served.batcher
            waiting: ReplySlot | RemoteRequest
            slots: list[ReplySlot]
            if len(items) == 1:
                waiting = one_item(connection, rid, request.request_id, batcher)
                slots = [waiting]
            else:
                waiting = RemoteRequest(connection, rid, len(items), request.request_id)
                waiting.batcher = batcher
                slots = waiting.slots()
            entries = batcher.submit_into(
                items,
                slots,
                self.loop,
                timeout=request.timeout,
                priority=request.priority,
                parameters=request.parameters or NO_PARAMETERS,
                wake=False,
            )
        except Exception as exc:  # noqa: BLE001 - its caller's answer; the next request goes on
            # Unknown, not ready, queue full, too large; or a fault of the
            # server, which must fail this request only (and is logged).
            connection.fail(rid, exc, admitted=False)
            return
        if isinstance(waiting, RemoteRequest):
            waiting.entries = entries
        else:
            waiting.entry = entries[0]
        connection.requests[rid] = waiting
        woken[id(batcher)] = batcher


def _wake(woken: dict[int, Batcher]) -> None:
    """Let each model form batches from what was just queued for it."""
    for batcher in woken.values():
        batcher.scheduler.wake()


def _answer_when_done(connection: Connection, rid: int, task: asyncio.Task[Any]) -> None:
    """An ensemble's steps run here, each through its model's scheduler:
    its request is answered when its task is done."""
    connection.requests[rid] = task

    def done(task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            connection.reply(rid, task.result())
        else:
            connection.fail(rid, exc)

    task.add_done_callback(done)

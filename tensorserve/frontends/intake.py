"""What one front end's message admits into its models' queues: ``Intake``.

A message carries the requests a front end received in one loop iteration,
usually many one-item requests for one model with nothing of their own but
their arrays, which the front end sends as runs (``protocol.in_runs``).
A run goes in whole: one lookup of the model, one check of
its generation, one pass through its admission lock, one count in its
statistics, instead of each request paying for all of it (the scheduler
process's CPU per request is what caps one GPU, whatever the number of
front ends). Everything else (ensembles, models with a latency target,
requests of several items, with parameters or traced), and any run that
admission refuses, goes one request at a time, exactly as before: a run is admitted whole or not at
all, so a refused run leaves nothing queued and each of its requests then
gets its own answer (queue full, too late, not ready) from its own
admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tensorserve.batching.admission import NO_PARAMETERS
from tensorserve.batching.batcher import Batcher
from tensorserve.dataplane.logs import REQUEST_ID
from tensorserve.dataplane.plane import DataPlane
from tensorserve.ensemble import Ensemble
from tensorserve.errors import ModelNotReady
from tensorserve.frontends.protocol import each_of_run, split_items
from tensorserve.frontends.requests import RemoteItem, RemoteRequest, ReplySlot
from tensorserve.frontends.table import Generations
from tensorserve.serving.text import TextServedModel

if TYPE_CHECKING:
    from tensorserve.frontends.hub import Connection

T = TypeVar("T")


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

    def admit(self, connection: Connection, requests: list[Any], arrays: list[np.ndarray]) -> None:
        """Queue every request of one message, in order; wake each model's
        scheduler once, after the whole message."""
        start = 0
        woken: dict[int, Batcher] = {}
        try:
            for request in requests:
                if type(request[0]) is not list:
                    start = self._admit_each(connection, request, arrays, start, woken)
                    continue
                # A run of plain requests (protocol.in_runs): whole, or each on its own.
                after = self._admit_run(connection, request, arrays, start, woken)
                if after is not None:
                    start = after
                    continue
                for one in each_of_run(request):
                    start = self._admit_each(connection, one, arrays, start, woken)
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
        run: list[Any],
        arrays: list[np.ndarray],
        start: int,
        woken: dict[int, Batcher],
    ) -> int | None:
        """Queue a run of plain one-item requests whole; where the next
        request's arrays begin, or None (nothing queued) if anything stands
        in the way."""
        rids, model, version, generation, timeout, priority, names, request_ids = run
        try:
            served = self.plane.registry.ready_model(model, version)
        except Exception:  # noqa: BLE001 - each request is then answered on its own
            return None
        if (
            # an ensemble's steps, a text model's tokenizing: each request on its own
            isinstance(served, (Ensemble, TextServedModel))
            # a refusal for the latency target is counted: once per request
            or served.batcher.latency_target is not None
            or not self.generations.current(model, served, generation)
        ):
            return None
        items, after = split_items(arrays, start, names, len(rids))  # one item each
        batcher = served.batcher
        remote = [
            RemoteItem(connection, rid, request_id, batcher)
            for rid, request_id in zip(rids, request_ids)
        ]
        try:
            entries = batcher.submit_into(
                items,
                remote,
                self.loop,
                timeout=timeout,
                priority=priority,
                parameters=NO_PARAMETERS,
                wake=False,
                one_per_request=True,
            )
        except Exception:  # noqa: BLE001 - refused whole, nothing queued: each on its own
            return None
        for request, entry in zip(remote, entries):
            request.entry = entry
        connection.requests.update(zip(rids, remote))
        woken[id(batcher)] = batcher
        return after

    def _admit_each(
        self,
        connection: Connection,
        request: list[Any],
        arrays: list[np.ndarray],
        start: int,
        woken: dict[int, Batcher],
    ) -> int:
        """Queue one request (or start its ensemble); where the next
        request's arrays begin."""
        (rid, model, version, generation, timeout, priority, parameters, names, count, traced,
         request_id) = request  # fmt: skip
        items, start = split_items(arrays, start, names, count)
        # Its caller's id is current while it is admitted, as in one process:
        # a line logged meanwhile, or by its ensemble's task, carries it.
        token = REQUEST_ID.set(request_id)
        try:
            tracer = self.plane.tracer
            # A traced request's span (in its front end) is current while its
            # items are queued: its batch's and steps' spans join its trace.
            context = tracer.request_context(traced) if traced and tracer is not None else None
            self._admit_one(
                connection, rid, model, version, generation, timeout, priority,
                parameters, items, context, woken, request_id,
            )  # fmt: skip
        finally:
            REQUEST_ID.reset(token)
        return start

    def _admit_one(
        self,
        connection: Connection,
        rid: int,
        model: str,
        version: str,
        generation: int,
        timeout: float | None,
        priority: Any,
        parameters: Any,
        items: list[dict[str, np.ndarray]],
        context: contextvars.Context | None,
        woken: dict[int, Batcher],
        request_id: str,
    ) -> None:
        try:
            served = self.plane.registry.ready_model(model, version)
            if not self.generations.current(model, served, generation):
                # Validated against another config than the one serving now
                # (a reload the front end had not heard of): never batched.
                self._table_changed()
                raise ModelNotReady(
                    f"model {model!r} was reloaded while this request was on its way; retry it"
                )
            if isinstance(served, Ensemble):
                coroutine = served.infer_many(
                    items,
                    timeout=timeout,
                    priority=priority,
                    parameters=parameters,
                    bytes_limits=self.plane.settings.bytes_limits(),
                )
                _answer_when_done(
                    connection, rid, _within(context, self.loop.create_task, coroutine)
                )
                return
            if isinstance(served, TextServedModel):
                # Validated by the front end; tokenized here, off the loop, then queued.
                text = served.infer_validated(
                    items, timeout=timeout, level=priority, values=parameters or NO_PARAMETERS
                )
                _answer_when_done(connection, rid, _within(context, self.loop.create_task, text))
                return
            request = RemoteRequest(connection, rid, len(items), request_id)
            request.batcher = batcher = served.batcher
            request.entries = _within(
                context,
                batcher.submit_into,
                items,
                [ReplySlot(request, i) for i in range(len(items))],
                self.loop,
                timeout=timeout,
                priority=priority,
                parameters=parameters or NO_PARAMETERS,
                wake=False,
            )
        except Exception as exc:  # noqa: BLE001 - its caller's answer; the next request goes on
            # Unknown, not ready, queue full, too large; or a fault of the
            # server, which must fail this request only (and is logged).
            connection.fail(rid, exc, admitted=False)
            return
        connection.requests[rid] = request
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


def _within(
    context: contextvars.Context | None, fn: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    return fn(*args, **kwargs) if context is None else context.run(fn, *args, **kwargs)

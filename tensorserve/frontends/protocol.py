"""What the front ends and the scheduler process say to each other.

Each message is one ``ipc`` message (a msgpack header, then raw tensor
bytes: nothing is ever pickled; the tensors read back in order, announced
in runs by ``messages.frames_in_order``) on a front end's socket to the
scheduler process. Its header holds any of these sections, so what one
loop iteration produced travels as one message, whatever the number of
requests in it:

    front end -> scheduler process
    "infer"    [[rid, model, version, generation, timeout, priority, parameters, names,
                 items, traceparent, request_id], ...]; ``generation``: the load of the
               model whose config the front end validated against
               (``table.Generations``); ``request_id``: its caller's (X-Request-ID),
               on the scheduler process's log lines about it
               the tensors: each request's items, each item's ``names`` in order.
               Or a run (``in_runs``): [[rid, ...], model, version, generation,
               timeout, priority, names, [request_id, ...]], consecutive plain
               requests (one item, no parameters, no trace) that share the rest
    "cancel"   [rid, ...]: callers that left or timed out; their items leave the queue
    "ask"      [[aid, what, args], ...]: the answers about the server and its models
               (``dataplane/models.py ANSWERS``: health, metadata, statistics,
               the repository extension, the metrics' text)
    "report"   this process's request metrics, CPU seconds, loop lag and
               requests in flight (``RequestReport``)

    scheduler process -> front end
    "models"   the model table (``model_table``), sent when it changes, and
               always before the answer of a load or unload that changed it
    "late"     {model: [message, retry_after]}: the models whose latency target
               a request would miss now; a front end refuses those before it
               reads a body. Published when the set or a Retry-After (whole
               seconds) changes, not asked per request; the message names
               only those (``table.refusals``), so it holds until the next one
    "replies"  [[rid, [names per item], [parameters per item] | None], ...] or
               [[rid, None, error], ...]; the tensors: each answered item's outputs.
               Or a run: [[rid, ...], names], one plain item each (no parameters)
    "answers"  [[aid, True, value] | [aid, False, error], ...]

The "infer" entries are ``records.Request`` and ``records.Run``, by name: a
record crosses as the array of its fields, the lists above.

An error travels as [class name, message, retry_after | None] and is raised
again as the same ``TensorServeError`` class on the other side.

One entry that cannot be packed (an integer beyond 64 bits, a string that
is not valid Unicode, nesting deeper than msgpack allows) must not cost the
others queued with it: ``Outbox.flush`` then packs entry by entry and hands
each that fails to its owner (``Unsendable``), which answers its request.
A front end refuses such values at admission first (``check_crossable``),
so its caller gets a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
import msgspec
import numpy as np

from tensorserve import errors
from tensorserve.errors import InvalidInput, ServerBusy, TensorServeError
from tensorserve.frontends.records import Request, Run
from tensorserve.ipc import messages

log = logging.getLogger(__name__)

# The sections that are lists of entries (``Outbox.add``); the others hold
# one value each (``Outbox.put``: "models", "late", "report").
ENTRY_SECTIONS = frozenset({"infer", "cancel", "ask", "replies", "answers"})

# An entry that cannot be sent, as its owner answers it: (section, entry,
# why) -> the entries to send in its place (its request's error), no tensors.
Unsendable = Callable[[str, Any, Exception], list[Any]]

# Every error class a reply may name, by class name.
ERROR_CLASSES: dict[str, type[TensorServeError]] = {
    name: value
    for name, value in vars(errors).items()
    if isinstance(value, type) and issubclass(value, TensorServeError)
}


def error_entry(exc: BaseException) -> list[Any]:
    """An exception as it travels: a tensorserve error keeps its class; any
    other is the server's fault (``internal``), worded as the front ends word
    it in one process."""
    if isinstance(exc, TensorServeError):
        return [type(exc).__name__, exc.message, getattr(exc, "retry_after", None)]
    return ["TensorServeError", f"internal error: {type(exc).__name__}: {exc}", None]


def error_from(entry: Sequence[Any]) -> TensorServeError:
    name, message, retry_after = entry
    cls = ERROR_CLASSES.get(name, TensorServeError)
    if issubclass(cls, ServerBusy):
        return cls(message, retry_after=retry_after if retry_after is not None else 1.0)
    try:
        return cls(message)
    except TypeError:  # a class whose constructor wants more (WorkerCrashed): its code stays
        error = TensorServeError(message)
        error.code = cls.code
        error.http_status, error.grpc_status = cls.http_status, cls.grpc_status
        return error


class Outbox:
    """What one side sends, gathered over a loop iteration and sent as one
    message: the first entry schedules the send (``call_soon``), so every
    request a loop iteration answered or received rides in the same one.
    Runs on the loop's thread only."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        send: Callable[[list[messages.Buffer]], None],
        before_send: Callable[[Outbox], None] | None = None,
        unsendable: Unsendable | None = None,
    ) -> None:
        self.loop = loop
        self._send = send
        self._before_send = before_send  # adds what is due with any message (a report)
        # Answers an entry that cannot be packed (None: it is dropped, logged).
        self._unsendable = unsendable
        self.sections: dict[str, Any] = {}
        self.tensors: list[np.ndarray] = []
        self._scheduled = False

    def add(self, section: str, entry: Any, tensors: Sequence[np.ndarray] = ()) -> None:
        """Append ``entry`` to a list section (its tensors after those queued)."""
        self.sections.setdefault(section, []).append(entry)
        if tensors:
            self.tensors.extend(tensors)
        self.schedule()

    def add_many(self, section: str, entries: list[Any], tensors: Sequence[np.ndarray]) -> None:
        """``add`` for each of ``entries``, their tensors in order."""
        self.sections.setdefault(section, []).extend(entries)
        self.tensors.extend(tensors)
        self.schedule()

    def put(self, section: str, value: Any) -> None:
        """Set a section that is a value, not a list (the latest wins)."""
        self.sections[section] = value
        self.schedule()

    def schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        if self._before_send is not None:
            self._before_send(self)
        if not self.sections:
            return
        sections, tensors = self.sections, self.tensors
        self.sections, self.tensors = {}, []
        try:  # all at once: the common case, one pack
            buffers = messages.frames_in_order(sections, tensors)
        except Exception:  # noqa: BLE001 - some entry cannot be packed: find it, answer it
            sections, tensors = self._sendable(sections, tensors)
            if not sections:
                return
            buffers = messages.frames_in_order(sections, tensors)
        # Many tensors: one copy into one buffer costs less than a buffer
        # each through the socket (and through ``Link``'s bookkeeping).
        self._send([buffers[0], b"".join(buffers[1:])] if len(buffers) > 2 else buffers)

    def _sendable(
        self, sections: dict[str, Any], tensors: list[np.ndarray]
    ) -> tuple[dict[str, Any], list[np.ndarray]]:
        """``sections`` and ``tensors`` without what cannot be packed, each
        entry packed alone (with its tensors) to find out; an entry that
        fails is replaced by what its owner answers (``Unsendable``), a
        value section that fails is dropped. Rare: only when the one pack
        of the whole message failed."""
        kept: dict[str, Any] = {}
        kept_tensors: list[np.ndarray] = []
        at = 0
        for section, value in sections.items():
            if section not in ENTRY_SECTIONS:
                try:
                    _packs({section: value}, ())
                except Exception as exc:  # noqa: BLE001 - this section only
                    log.error("the %r section cannot be sent, dropped: %r", section, exc)
                else:
                    kept[section] = value
                continue
            entries: list[Any] = []
            for entry in value:
                count = tensor_count(section, entry)
                own = tensors[at : at + count]
                at += count
                try:
                    _packs({section: [entry]}, own)
                except Exception as exc:  # noqa: BLE001 - this entry's request only
                    if self._unsendable is None:
                        log.error("a %r entry cannot be sent, dropped: %r", section, exc)
                    else:
                        entries.extend(self._unsendable(section, entry, exc))
                else:
                    entries.append(entry)
                    kept_tensors.extend(own)
            if entries:
                kept[section] = entries
        return kept, kept_tensors


def _packs(header: dict[str, Any], tensors: Sequence[np.ndarray]) -> None:
    """Raise what packing ``header`` with ``tensors`` raises, or unpacking
    the header again (nesting the other side cannot unpack)."""
    head = messages.frames_in_order(header, tensors)[0]
    msgpack.unpackb(memoryview(head)[4:])


def tensor_count(section: str, entry: Any) -> int:
    """How many of a message's tensors belong to ``entry`` of ``section``
    (the formats in this module's docstring)."""
    if section == "infer":
        record = infer_record(entry)
        if isinstance(record, Run):  # one item of ``names`` a request
            return len(record.rids) * len(record.names)
        return len(record.names) * int(record.items)
    if section == "replies":
        if type(entry[0]) is list:  # a run: one plain item of ``names`` a request
            return len(entry[0]) * len(entry[1])
        names = entry[1]
        return 0 if names is None else sum(len(item) for item in names)
    return 0


def check_crossable(parameters: Mapping[str, Any], priority: Any = None) -> None:
    """``InvalidInput`` naming the first of a request's values that cannot
    cross to the scheduler process: one msgpack cannot pack, or nested too
    deep for the other side to unpack where it sits in a message. What a
    front end forwards unchecked (an ensemble's parameters and priority;
    its steps check their own) is checked here, at admission, so it is its
    caller's 400, not a failure of the message it would travel in."""
    fields = [("priority", priority), *parameters.items()]
    for name, value in fields:
        try:
            # As deep as a message holds it: header, "infer", entry, parameters.
            msgpack.unpackb(msgpack.packb([[[[value]]]]))
        except Exception as exc:  # noqa: BLE001 - whatever msgpack refuses, named
            raise InvalidInput(
                f"parameters.{name} cannot be passed on to the model: {_why(exc)}"
            ) from None


def infer_record(entry: list[Any]) -> Request | Run:
    """An "infer" entry as the record it is (``records.py``)."""
    return Run(*entry) if type(entry[0]) is list else Request(*entry)


def callers(entry: list[Any]) -> list[tuple[int, str]]:
    """(rid, request id) of each request an "infer" entry (or run) stands for."""
    record = infer_record(entry)
    if isinstance(record, Run):
        return list(zip(record.rids, record.request_ids))
    return [(record.rid, record.request_id)]


def unsendable_error(entry: list[Any], exc: Exception) -> TensorServeError:
    """What the callers of an "infer" entry that cannot be packed are
    answered: their own value, named (a 400), when it is one; else the
    server's fault."""
    record = infer_record(entry)
    if isinstance(record, Request):
        try:
            check_crossable(record.parameters or {}, record.priority)
        except InvalidInput as invalid:
            return invalid
    return TensorServeError(f"internal error: the request could not be passed on: {exc!r}")


def _why(exc: Exception) -> str:
    """msgpack's refusal in a caller's words."""
    if isinstance(exc, OverflowError):
        return "an integer outside the 64-bit range"
    if isinstance(exc, UnicodeError):
        return "a string that is not valid Unicode"
    if isinstance(exc, msgpack.exceptions.StackError) or "recursion" in str(exc):
        return "nested too deeply"
    return f"{type(exc).__name__}: {exc}"


def in_runs(requests: list[Any]) -> list[Any]:
    """``requests`` ("infer" entries) with each stretch of consecutive plain
    requests (one item, no parameters, no trace) for the same model,
    version, generation, timeout, priority and feature names written as
    one run entry. A front end sends many such requests in one message;
    the scheduler process admits a run whole (``frontends/intake.py``) and
    unpacks two values a request, not eleven: its CPU per request is what
    caps a GPU. The tensors are unchanged: a run's are its requests', in
    order. Positions are ``records.Request``'s fields (1-5: model, version,
    generation, timeout, priority; 6 parameters, 7 names, 8 items, 9
    traceparent, 10 request id): this runs per request in the front end,
    where indexing a list costs less than naming it."""
    out: list[Any] = []
    at = 0
    while at < len(requests):
        first = requests[at]
        end = at + 1
        if first[8] == 1 and not first[9] and not first[6]:
            key, names = first[1:6], first[7]
            while end < len(requests):
                r = requests[end]
                if r[8] != 1 or r[9] or r[6] or r[1:6] != key or r[7] != names:
                    break
                end += 1
        if end - at == 1:
            out.append(first)
        else:
            run = requests[at:end]
            out.append([[r[0] for r in run], *key, names, [r[10] for r in run]])
        at = end
    return out


def each_of_run(run: list[Any]) -> list[list[Any]]:
    """A run entry as the plain requests it stands for (``in_runs``)."""
    return [list(msgspec.structs.astuple(request)) for request in Run(*run).requests()]


def split_items(
    arrays: Sequence[np.ndarray], start: int, names: Sequence[str], items: int
) -> tuple[list[dict[str, np.ndarray]], int]:
    """``items`` dicts of ``names`` read from ``arrays`` at ``start``; and
    where the next request's tensors begin. This runs for every request the
    scheduler process admits and every row a front end gets back."""
    width = len(names)
    end = start + width * items
    if width == 2:  # ids and their mask, the usual pair: a dict display is ~4x dict(zip())
        first, second = names
        pairs = iter(arrays[start:end])
        return [{first: a, second: b} for a, b in zip(pairs, pairs)], end
    if width == 0:
        return [{} for _ in range(items)], end
    columns = [arrays[start + k : end : width] for k in range(width)]
    return [dict(zip(names, row)) for row in zip(*columns)], end

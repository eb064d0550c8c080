"""The records of a front end's "infer" section, by name (``protocol.py``
draws the whole message).

Each is a ``msgspec.Struct`` with ``array_like=True``: on the wire a record
is the msgpack array of its fields in the order declared here, byte for byte
what a list of them is (``msgspec.msgpack.encode(record) ==
msgpack.packb(list)``), so naming costs the wire nothing; the order below
*is* the format. The scheduler process reads each entry it receives as one
(``Request(*entry)``: ~0.1 us, about a dict lookup's worth) and never by
position after that (``intake.py``). ``gc=False``: a record holds no cycle.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Request(msgspec.Struct, array_like=True, gc=False):
    """One request: its items' arrays follow in the message's tensors, each
    item's ``names`` in order."""

    rid: int  # the front end's id of the request (its reply carries it)
    model: str
    version: str
    generation: int  # the model's load the front end validated against (``table.Generations``)
    timeout: float | None  # seconds left of its caller's deadline
    priority: Any  # its priority level (validated)
    parameters: dict[str, Any] | None  # the model's declared parameters' values
    names: list[str]  # each item's inputs, in order
    items: int
    traceparent: str | None  # its span, in its front end, when traced
    request_id: str  # its caller's (X-Request-ID): on this process's lines about it

    def plain(self) -> bool:
        """One item, no parameters, no trace: it may travel in a ``Run``."""
        return self.items == 1 and not self.traceparent and not self.parameters


class Run(msgspec.Struct, array_like=True, gc=False):
    """Consecutive plain requests (``Request.plain``) that share all but their
    ids (``protocol.in_runs``): one item of ``names`` each, in order."""

    rids: list[int]
    model: str
    version: str
    generation: int
    timeout: float | None
    priority: Any
    names: list[str]
    request_ids: list[str]

    def requests(self) -> list[Request]:
        """The requests the run stands for, each as if sent alone."""
        head = (self.model, self.version, self.generation, self.timeout, self.priority)
        return [
            Request(rid, *head, None, self.names, 1, None, request_id)
            for rid, request_id in zip(self.rids, self.request_ids)
        ]

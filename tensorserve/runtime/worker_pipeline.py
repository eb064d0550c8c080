"""The order in which a worker process takes, runs and answers batches.
Pure: the socket and the executor come in as callables (``WorkerPorts``),
so the order is tested without either.

    recv      the next message, blocking (EOFError / ConnectionError: the
              server has gone)
    waiting   whether a message (or the socket's end) can be read now,
              without blocking
    launch    a batch queued on the device (on a CPU: run to the end); what
              it returns is ``collect``'s, and carries the batch's answer
              already if its launch failed
    collect   the launched batch's reply, once the device is done with it
    send      one reply

On a CPU, ``launch`` runs the forward to the end, so a second batch taken
early would only wait for the first: one batch at a time (``depth`` 1),
exactly as before. On CUDA, ``launch`` returns once the batch is queued on
the instance's stream; if the server has already sent the next batch, the
worker takes and launches it before collecting the first, so the GPU never
waits while the worker decodes a batch or encodes a reply (``depth`` 2). Not
deeper: a third batch would only queue behind two on the same stream, and
every batch launched ahead is one more that a dying worker takes with it.

Replies go out in the order the batches came, each exactly once: the server
pairs them by order (``worker_channel.py``). A launch that fails is answered
in its turn, after the batch before it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tensorserve.ipc import messages as ipc

# How many batches a worker on CUDA holds at once (launched, not yet
# answered). The server counts on it too: when such a worker dies, this many
# of the batches sent to it may have run (worker_process.py).
CUDA_BATCHES_IN_FLIGHT = 2

Started = TypeVar("Started")  # what launch returns and collect takes


@dataclass(frozen=True)
class WorkerPorts(Generic[Started]):
    """What ``serve`` drives (see the module docstring for each)."""

    recv: Callable[[], ipc.Message]
    waiting: Callable[[], bool]
    launch: Callable[[ipc.Message], Started]
    collect: Callable[[Started], ipc.Message]
    send: Callable[[ipc.Message], None]


def serve(ports: WorkerPorts[Started], depth: int) -> None:
    """Run batches until the server closes the socket or says stop, with at
    most ``depth`` launched and not yet answered. Returns then without
    answering what is in flight: nobody reads those replies any more (the
    server stops a worker by closing its socket). What launch or collect
    raises (a lost CUDA context) leaves here, for the caller to exit on."""
    if depth < 1:
        raise ValueError(f"a worker runs at least one batch at a time, not {depth}")
    in_flight: deque[Started] = deque()  # launched, oldest first
    while True:
        # Take another batch while there is room: waiting for one when none
        # is in flight (nothing else to do), else only one already there, so
        # the batch in flight is never answered later for a batch to come.
        if len(in_flight) < depth and (not in_flight or ports.waiting()):
            try:
                header, features = ports.recv()
            except (EOFError, ConnectionError):
                return  # the server closed its end: stopped or gone
            if header.get("stop"):
                return
            in_flight.append(ports.launch((header, features)))
            continue
        reply = ports.collect(in_flight.popleft())
        try:
            ports.send(reply)
        except ConnectionError:  # BrokenPipeError: the server has gone
            return

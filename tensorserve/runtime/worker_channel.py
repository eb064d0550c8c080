"""The server's end of one worker process's socket, driven by an event loop
(the model's scheduler): a ``Link`` (``ipc/link.py``: messages out without
ever blocking the loop) whose replies come back in the order the batches
were sent, each to the callback sent with it.

If the connection breaks (the worker died, or was killed), ``lost`` is
called once with the callbacks still waiting for a reply, oldest first.
Everything here runs on the loop's thread.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable

from tensorserve.ipc import messages as ipc
from tensorserve.ipc.link import Link

# A batch's reply: (message, None), or (None, error) from whoever saw it lost.
OnReply = Callable[[ipc.Message | None, BaseException | None], None]
Lost = Callable[[list[OnReply]], None]


class WorkerChannel:
    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, lost: Lost) -> None:
        self._lost = lost
        self._waiting: deque[OnReply] = deque()  # one per batch sent, oldest first
        self._link = Link(sock, loop, self._reply, self._broken)

    @property
    def sock(self) -> socket.socket:
        return self._link.sock

    def send(self, buffers: list[ipc.Buffer], on_reply: OnReply) -> None:
        """Queue one message; what the socket takes now is written now."""
        self._waiting.append(on_reply)
        self._link.send(buffers)

    def close(self) -> None:
        """Stop watching the socket (the caller closes it); nothing is reported."""
        self._link.close()

    def _reply(self, message: ipc.Message) -> None:
        if not self._waiting:  # a reply nobody asked for: the stream is not ours
            self._link.close()
            self._broken()
            return
        self._waiting.popleft()(message, None)

    def _broken(self) -> None:
        waiting, self._waiting = list(self._waiting), deque()
        self._lost(waiting)

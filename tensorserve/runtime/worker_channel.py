"""The server's end of one worker process's socket, driven by an event loop
(the model's scheduler): messages out and replies in, never blocking it.

A batch is written as far as the socket takes it now; the rest is written
as the socket drains (``add_writer``), so the loop never waits on a worker,
however small the host lets a socket buffer be (Linux clamps ``SO_SNDBUF``
to ``net.core.wmem_max``, 208 KiB on most hosts). Replies come back in the
order the batches were sent, each to the callback sent with it.

If the connection breaks (the worker died, or was killed), ``lost`` is
called once with the callbacks still waiting for a reply, oldest first.
Everything here runs on the loop's thread.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable

from tensorserve.runtime import ipc

# A batch's reply: (message, None), or (None, error) from whoever saw it lost.
OnReply = Callable[[ipc.Message | None, BaseException | None], None]
Lost = Callable[[list[OnReply]], None]


class WorkerChannel:
    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, lost: Lost) -> None:
        self.sock = sock
        self.loop = loop
        self._lost = lost
        self._waiting: deque[OnReply] = deque()  # one per batch sent, oldest first
        self._unsent: deque[memoryview] = deque()
        self._reader = ipc.MessageReader()
        self._writing = False
        self.open = True
        sock.setblocking(False)
        loop.add_reader(sock, self._readable)

    @property
    def waiting(self) -> int:
        """Batches sent whose reply has not come back."""
        return len(self._waiting)

    def send(self, buffers: list[bytes | memoryview], on_reply: OnReply) -> None:
        """Queue one message; what the socket takes now is written now."""
        self._waiting.append(on_reply)
        self._unsent.extend(memoryview(b).cast("B") for b in buffers)
        self._flush()

    def close(self) -> None:
        """Stop watching the socket (the caller closes it); nothing is reported."""
        if self.open:
            self.open = False
            self.loop.remove_reader(self.sock)
            if self._writing:
                self.loop.remove_writer(self.sock)
                self._writing = False
            self._unsent.clear()

    def _flush(self) -> None:
        while self._unsent:
            try:
                sent = self.sock.send(self._unsent[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._broken()
                return
            if sent < len(self._unsent[0]):
                self._unsent[0] = self._unsent[0][sent:]
            else:
                self._unsent.popleft()
        if self._unsent and not self._writing:
            self.loop.add_writer(self.sock, self._flush)
            self._writing = True
        elif not self._unsent and self._writing:
            self.loop.remove_writer(self.sock)
            self._writing = False

    def _readable(self) -> None:
        while self.open:
            try:
                message = self._reader.feed(self.sock)
            except (EOFError, OSError):
                self._broken()
                return
            if message is None:
                return
            self._reader = ipc.MessageReader()
            if not self._waiting:  # a reply nobody asked for: the stream is not ours
                self._broken()
                return
            self._waiting.popleft()(message, None)

    def _broken(self) -> None:
        if not self.open:
            return
        self.close()
        waiting, self._waiting = list(self._waiting), deque()
        self._lost(waiting)

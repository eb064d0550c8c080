"""``Link``: one end of a stream socket (a ``socketpair``), driven by an event
loop: messages out and in, never blocking the loop.

A message is written as far as the socket takes it now; the rest is written
as the socket drains (``add_writer``), so the loop never waits on the other
process, however small the host lets a socket buffer be (Linux clamps
``SO_SNDBUF`` to ``net.core.wmem_max``, 208 KiB on most hosts). Each
complete message read is handed to ``on_message``; if the connection breaks
(the other process died, or was killed), ``on_lost`` is called once.
Everything here runs on the loop's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tensorserve.ipc import messages

# Buffers per sendmsg call (Linux's IOV_MAX is 1024).
MAX_BUFFERS = 512
# Reads per readable callback before the loop's other callbacks get a turn.
MAX_READS = 16

log = logging.getLogger(__name__)


class Link:
    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_lost: Callable[[], None],
        *,
        many: bool = False,
    ) -> None:
        """``many``: the socket carries many small messages (a front end's),
        read as many per ``recv`` as it brings (``messages.StreamReader``),
        each handed to ``on_message`` as a ``messages.InOrder``; else one
        large message at a time, each read straight into its own buffer (a
        worker's batches), handed over as a ``messages.Message``."""
        self.sock = sock
        self.loop = loop
        self._on_message = on_message
        self._on_lost = on_lost
        self._unsent: deque[memoryview] = deque()
        self._reader = messages.StreamReader() if many else None
        self._message_reader = messages.MessageReader()
        self._writing = False
        self.open = True
        self.paused = False  # not reading (pause_reading)
        sock.setblocking(False)
        loop.add_reader(sock, self._readable)

    @property
    def unsent_bytes(self) -> int:
        return sum(len(b) for b in self._unsent)

    def send(self, buffers: Sequence[messages.Buffer]) -> None:
        """Queue one message's buffers (``messages.frames``); what the socket
        takes now is written now."""
        if not self.open:
            return
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
        unsent = self._unsent
        while unsent:
            try:  # every buffer in one system call, as far as the socket takes them
                sent = self.sock.sendmsg(list(itertools.islice(unsent, MAX_BUFFERS)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._broken()
                return
            while sent:
                first = unsent[0]
                if len(first) > sent:
                    unsent[0] = first[sent:]
                    break
                sent -= len(first)
                unsent.popleft()
        if self._unsent and not self._writing:
            self.loop.add_writer(self.sock, self._flush)
            self._writing = True
        elif not self._unsent and self._writing:
            self.loop.remove_writer(self.sock)
            self._writing = False

    def pause_reading(self) -> None:
        """Stop watching the socket: what arrives waits in it until
        ``read_pending`` or ``resume_reading``."""
        if self.open and not self.paused:
            self.paused = True
            self.loop.remove_reader(self.sock)

    def resume_reading(self) -> None:
        """Watch the socket again, and read what waits in it now."""
        if self.open and self.paused:
            self.paused = False
            self.loop.add_reader(self.sock, self._readable)
            self._readable()

    def read_pending(self) -> None:
        """Read what waits in the socket now, watched or not."""
        self._read(paused_too=True)

    def _readable(self) -> None:
        self._read(paused_too=False)

    def _read(self, paused_too: bool) -> None:
        # A bounded number of reads per callback: a peer that writes as fast
        # as this end reads cannot hold the loop in one callback.
        for _ in range(MAX_READS):
            if not self.open or (self.paused and not paused_too):
                return  # (what one read brought is still handed over)
            try:
                read: list[messages.InOrder] | list[messages.Message] | None
                if self._reader is not None:
                    read = self._reader.feed(self.sock)
                else:
                    one = self._message_reader.feed(self.sock)
                    read = None if one is None else [one]
            except (EOFError, OSError):
                self._broken()
                return
            except Exception:
                # Corrupt (bad msgpack, an unknown dtype, a malformed spec):
                # where the next message starts is unknown, so nothing after
                # it can be trusted either. Broken, as if the other end had
                # died: its requests are answered and its process replaced.
                log.exception("a message from the other process cannot be read: link broken")
                self._broken()
                return
            if read is None:
                return
            if self._reader is None:
                self._message_reader = messages.MessageReader()
            for message in read:
                if not self.open:
                    return
                try:
                    self._on_message(message)
                except Exception:  # a bug handling one message costs that message only
                    log.exception("a message from the other process could not be handled")
            if self._reader is not None and self._reader.drained:
                return  # no second recv to learn it is empty (one a read, saved)

    def _broken(self) -> None:
        if self.open:
            self.close()
            self._on_lost()

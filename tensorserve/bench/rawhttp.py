"""A minimal HTTP/1.1 keep-alive client for the load generator's hot path.

A general client (aiohttp's) costs ~140 us of client CPU per small request
(~255 us for an infer request, docs/client.md), and on a small machine the
load generator shares the cores with the server it measures. This one writes
a prebuilt request and reads back a ``Content-Length`` response: ~45 us per
small request (both measured on the 2-core VM, 2026-11-22). It is only for
requests to tensorserve itself (bodies with ``Content-Length``, no
chunking, no redirects).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit


class RawHttpPool:
    """Keep-alive connections to one host, reused across requests."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def request(self, path: str, body: bytes, content_type: str) -> bytes:
        """The full request bytes; build once per payload, send many times."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("ascii") + body

    def get_request(self, path: str) -> bytes:
        """A ``GET`` of ``path`` (the bench's config and stats reads)."""
        return f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode("ascii")

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """(status, body) of one request on a pooled connection."""
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            keep_alive = True
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    keep_alive = False
            body = await reader.readexactly(length) if length else b""
        except BaseException:
            writer.close()
            raise
        if keep_alive:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return status, body

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

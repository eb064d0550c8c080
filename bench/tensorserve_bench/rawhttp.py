"""A minimal HTTP/1.1 keep-alive client for the load generator's hot path.

A general client (aiohttp's) costs ~140 us of client CPU per small request
(~255 us for an infer request, docs/client.md), and on a small machine the
load generator shares the cores with the server it measures. This one writes
a prebuilt request and reads back the response: ~45 us per small request
(both measured on the 2-core VM, 2026-11-22). Every server the benchmarks
measure (tensorserve, and the peers of ``benchmarks/peers``) is spoken to
with it, so they all pay the same client cost. It reads ``Content-Length``
and chunked bodies, and bodies ended by ``Connection: close``; no redirects,
no TLS, no proxies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RawResponse:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


class RawHttpPool:
    """Keep-alive connections to one host, reused across requests."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def request(
        self,
        path: str,
        body: bytes,
        content_type: str,
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """A ``POST`` as bytes; build once per payload, send many times."""
        extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        )
        return head.encode("ascii") + body

    def get_request(self, path: str) -> bytes:
        """A ``GET`` of ``path`` (the bench's config and stats reads)."""
        return f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode("ascii")

    async def send(self, request: bytes) -> tuple[int, bytes]:
        """(status, body) of one request on a pooled connection."""
        status, _, body = await self._roundtrip(request, want_headers=False)
        return status, body

    async def exchange(self, request: bytes) -> RawResponse:
        """Status, headers and body of one request on a pooled connection."""
        status, headers, body = await self._roundtrip(request, want_headers=True)
        return RawResponse(status, headers or {}, body)

    async def _roundtrip(
        self, request: bytes, want_headers: bool
    ) -> tuple[int, dict[str, str] | None, bytes]:
        if self._idle:
            reader, writer = self._idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            http10 = head.startswith(b"HTTP/1.0")
            keep_alive = not http10
            length: int | None = None
            chunked = False
            headers: dict[str, str] | None = {} if want_headers else None
            for line in head[:-4].split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection":
                    value = value.lower()
                    keep_alive = value == b"keep-alive" if http10 else value != b"close"
                elif name == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                if headers is not None:
                    headers[name.decode("latin-1")] = value.decode("latin-1")
            if length is not None:
                body = await reader.readexactly(length) if length else b""
            elif chunked:
                body = await _read_chunked(reader)
            elif not keep_alive and status >= 200 and status not in (204, 304):
                body = await reader.read()  # the body ends with the connection
            else:
                body = b""
        except BaseException:
            writer.close()
            raise
        if keep_alive:
            self._idle.append((reader, writer))
        else:
            writer.close()
        return status, headers, body

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
                pass
            return b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])

"""The load generator's raw HTTP client against a canned server: the three
ways a response body ends, headers, and connection reuse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tensorserve_bench.rawhttp import RawHttpPool

RESPONSES = {
    b"/length": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"
    b"Inference-Header-Content-Length: 2\r\n\r\nhello",
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"4;ext=1\r\nwiki\r\n6\r\npedia!\r\n0\r\nTrailer: x\r\n\r\n",
    b"/close": b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\nuntil the end",
}


@pytest.fixture
async def canned() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server answering each path with its canned response; it logs one
    entry per connection and the request bodies it read."""
    log: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        log.append(b"connection")
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            path = head.split(b" ")[1]
            length = next(
                (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length")), 0,
            )  # fmt: skip
            log.append(head.split(b"\r\n")[0] + b" " + await reader.readexactly(length))
            writer.write(RESPONSES[path])
            await writer.drain()
            if path == b"/close":
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", log
    server.close()
    await server.wait_closed()


async def test_bodies_end_by_length_by_chunks_or_by_close(canned: tuple[str, list[bytes]]) -> None:
    url, log = canned
    pool = RawHttpPool(url)
    try:
        response = await pool.exchange(pool.request("/length", b"{}", "application/json"))
        assert (response.status, response.body) == (200, b"hello")
        assert response.headers["inference-header-content-length"] == "2"  # names in lower case
        assert await pool.send(pool.get_request("/chunked")) == (200, b"wikipedia!")
        assert await pool.send(pool.get_request("/close")) == (503, b"until the end")
        assert await pool.send(pool.get_request("/length")) == (200, b"hello")
    finally:
        await pool.close()
    # Keep-alive until the server said close: two connections for four requests.
    assert log.count(b"connection") == 2
    assert log[1] == b"POST /length HTTP/1.1 {}"


async def test_extra_headers_go_into_the_prebuilt_request() -> None:
    pool = RawHttpPool("http://127.0.0.1:9")
    request = pool.request("/infer", b"abc", "application/octet-stream", {"X-Peer": "triton"})
    head, _, body = request.partition(b"\r\n\r\n")
    assert body == b"abc"
    assert b"\r\nX-Peer: triton" in head and b"\r\nContent-Length: 3" in head

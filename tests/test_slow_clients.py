"""Slow clients cannot hold a connection forever: a body that does not arrive
within ``body_timeout_s`` gets 408 and the connection is closed; a request
whose line and headers do not arrive within ``keepalive_timeout_s`` has its
connection closed. A real server, spoken to over raw sockets that trickle."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest

from tests.conftest import ServerProcess
from tests.helpers import ECHO, POISON_MODEL, body, write_toy_model

BODY_TIMEOUT_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
# aiohttp reads what is left of an unread body for up to 10 s after the reply
# (its lingering close), so the client reads the 408 rather than a reset.
LINGER_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("slow-clients")
    write_toy_model(repository, "echo", POISON_MODEL, **ECHO)
    process = ServerProcess(
        repository,
        "--body-timeout-s", str(BODY_TIMEOUT_S),
        "--keepalive-timeout-s", str(KEEPALIVE_TIMEOUT_S),
    )  # fmt: skip
    yield process
    process.stop()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=LINGER_S + 10)
    return sock


def head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/msgpack\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


class Trickler(threading.Thread):
    """Sends ``data`` one byte every ``every`` seconds until done, stopped, or
    the server closes the connection."""

    def __init__(self, sock: socket.socket, data: bytes, every: float) -> None:
        super().__init__(daemon=True)
        self.sock, self.data, self.every = sock, data, every
        self.stopped = threading.Event()

    def run(self) -> None:
        for byte in self.data:
            if self.stopped.wait(self.every):
                return
            try:
                self.sock.send(bytes([byte]))
            except OSError:
                return


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed without a response: {received!r}"
        received += chunk
    raw_head, _, rest = received.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in lines[1:])
    headers = {name.strip().lower(): value.strip() for name, _, value in fields}
    length = int(headers["content-length"])
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers, rest[:length]


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (no more bytes ever come)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:  # closed with our trickled bytes still unread
        return True


def test_a_trickled_body_gets_408_and_its_connection_is_closed(server: ServerProcess) -> None:
    payload = body([{"x": [[1.0, 2.0, 3.0, 4.0]]}])
    with connect(server) as sock:
        sock.sendall(head("/v2/models/echo/infer", len(payload)))
        sent = time.monotonic()
        trickler = Trickler(sock, payload, every=0.2)  # needs far longer than the bound
        trickler.start()
        try:
            status, _, reply = read_response(sock)
            answered = time.monotonic() - sent
            message = (
                f"the request body did not arrive within {BODY_TIMEOUT_S:g} s (body_timeout_s); "
                f"the connection is closed"
            )
            assert (status, msgpack.unpackb(reply)["error"]) == (408, message)
            assert BODY_TIMEOUT_S <= answered < BODY_TIMEOUT_S + 5, answered
            assert closed(sock)  # while the client still trickles
            assert time.monotonic() - sent < BODY_TIMEOUT_S + LINGER_S + 8
        finally:
            trickler.stopped.set()


def test_a_slow_body_that_arrives_in_time_is_served(server: ServerProcess) -> None:
    payload = body([{"x": [[1.0, 2.0, 3.0, 4.0]]}])
    with connect(server) as sock:
        sock.sendall(head("/v2/models/echo/infer", len(payload)))
        for start in range(0, len(payload), 16):  # a few pieces, well within the bound
            time.sleep(0.02)  # the point of the test: the body arrives slowly
            sock.sendall(payload[start : start + 16])
        status, _, reply = read_response(sock)
        assert status == 200, reply
        y = msgpack.unpackb(reply)["outputs"][0]["y"]
        assert y["shape"] == [1, 4]


def test_headers_that_never_finish_are_cut_off(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: test\r\n")
        opened = time.monotonic()
        trickler = Trickler(sock, b"X-Slow: " + b"a" * 200, every=0.2)
        trickler.start()
        try:
            assert closed(sock)  # no response: there is no request to answer yet
            elapsed = time.monotonic() - opened
            assert KEEPALIVE_TIMEOUT_S - 0.5 <= elapsed < KEEPALIVE_TIMEOUT_S + 5, elapsed
        finally:
            trickler.stopped.set()

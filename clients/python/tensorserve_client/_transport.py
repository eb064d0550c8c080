"""Carries calls to the server and back: the retry loop (``Transport``),
around one attempt sent over HTTP (``HttpTransport``: one aiohttp session, a
keep-alive connection pool) or gRPC (``_grpc.GrpcTransport``: one channel).
``open_transport`` picks one by the URL's scheme. Both twins use it —
``AsyncClient`` on the caller's event loop, ``Client`` on its own loop thread —
so there is one sending path. Transport failures come back as error *values*
(not raised) so that the same retry decision and ``Call.complete`` see every
outcome.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import random
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tensorserve_client._protocol import MSGPACK, Call, Outcome, Response, next_delay
from tensorserve_client._retry import RetryPolicy
from tensorserve_client._version import __version__
from tensorserve_client.errors import (
    ConnectionError,
    ProtocolError,
    RequestTimeout,
    TensorServeError,
)

log = logging.getLogger("tensorserve_client")

# How long past the caller's deadline we still wait for an answer: the server
# enforces the deadline itself (and says so with a 504 that names the item),
# so its answer should win over a bare client-side timeout.
DEADLINE_GRACE_S = 1.0


GRPC_MISSING = "grpc:// URLs need grpcio and protobuf: pip install 'tensorserve-client[grpc]'"


def base_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` or ``grpc://host:port``, without a
    trailing slash."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https", "grpc") or not parts.netloc:
        raise ValueError(f"url must look like http://host:port or grpc://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"url must not carry a query or fragment, got {url!r}")
    if parts.scheme == "grpc" and parts.path.strip("/"):
        raise ValueError(f"a grpc:// url has no path, got {url!r}")
    return url.rstrip("/")


def open_transport(
    url: str,
    *,
    timeout: float | None,
    retries: int | RetryPolicy,
    headers: Mapping[str, str] | None,
    max_connections: int,
) -> Transport:
    """The transport for ``url``'s scheme; grpcio is imported only for grpc://."""
    if urlsplit(base_url(url)).scheme != "grpc":
        return HttpTransport(
            url, timeout=timeout, retries=retries, headers=headers, max_connections=max_connections
        )
    try:
        from tensorserve_client._grpc import GrpcTransport
    except ImportError as exc:
        if (exc.name or "").split(".")[0] in ("grpc", "google"):
            raise ImportError(GRPC_MISSING) from None
        raise
    return GrpcTransport(
        url, timeout=timeout, retries=retries, headers=headers, max_connections=max_connections
    )


class Transport(abc.ABC):
    """Sends a call until its outcome is final; a subclass sends one attempt."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None,
        retries: int | RetryPolicy,
        headers: Mapping[str, str] | None,
        max_connections: int,
    ) -> None:
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(
                f"max_connections must be a whole number >= 1, got {max_connections!r}"
            )
        self.url = base_url(url)
        self.timeout = timeout
        self.retries = RetryPolicy.of(retries)
        self.headers = {"User-Agent": f"tensorserve-client/{__version__}", **(headers or {})}
        self.max_connections = max_connections
        self._rng = random.Random()

    @abc.abstractmethod
    async def _send_once(self, call: Call[Any], remaining: float | None, attempts: int) -> Outcome:
        """One attempt; ``remaining``: seconds left of the caller's deadline."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the connections; on the event loop they ran on."""

    async def exchange(self, call: Call[Any]) -> Outcome:
        """Send ``call`` until its outcome is final: retries and backoff included."""
        if not call.send:
            return Response(200, MSGPACK, b"", attempts=0)
        started = time.monotonic()
        retry = 0
        while True:
            remaining = (
                None if call.timeout is None else call.timeout - (time.monotonic() - started)
            )
            outcome = await self._send_once(call, remaining, attempts=retry + 1)
            if call.timeout is not None:
                remaining = call.timeout - (time.monotonic() - started)
            delay = next_delay(
                self.retries, call, outcome, retry, remaining, self._rng, time.time()
            )
            if delay is None:
                return outcome
            log.info(
                "%s %s: %s; retry %d of %d in %.2f s",
                call.method,
                call.path,
                _describe(outcome),
                retry + 1,
                self.retries.retries,
                delay,
            )
            await asyncio.sleep(delay)
            retry += 1

    def _attempt_timeout(self, remaining: float | None) -> float | None:
        if remaining is None:
            return self.timeout
        allowed = max(remaining, 0.0) + DEADLINE_GRACE_S
        return allowed if self.timeout is None else min(self.timeout, allowed)


class HttpTransport(Transport):
    """Attempts over HTTP, in the native msgpack protocol (the call's body)."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _session_here(self) -> aiohttp.ClientSession:
        # aiohttp sessions belong to the loop they were made on, so make it on first use.
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                headers=self.headers,
            )
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                "an AsyncClient belongs to the event loop it first ran on; "
                "create one client per event loop (e.g. per asyncio.run)"
            )
        return self._session

    async def _send_once(self, call: Call[Any], remaining: float | None, attempts: int) -> Outcome:
        session = self._session_here()
        timeout = self._attempt_timeout(remaining)
        url = self.url + call.path
        headers = {"Content-Type": MSGPACK, "Accept": MSGPACK} if call.body is not None else None
        try:
            async with session.request(
                call.method,
                url,
                data=call.body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as answer:
                body = await answer.read()
                return Response(
                    answer.status,
                    answer.content_type,
                    body,
                    answer.headers.get("Retry-After"),
                    attempts,
                )
        except aiohttp.ConnectionTimeoutError as exc:  # nothing was sent: safe to retry
            return _failed(
                ConnectionError, f"{call.method} {url}: connecting timed out", exc, attempts
            )
        except asyncio.TimeoutError as exc:
            return _failed(
                RequestTimeout,
                f"{call.method} {url}: no answer within "
                + (f"{timeout:g} s" if timeout is not None else "the transport's limits"),
                exc,
                attempts,
            )
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            return _failed(
                ConnectionError, f"{call.method} {url}: {exc or type(exc).__name__}", exc, attempts
            )
        except aiohttp.ClientError as exc:
            return _failed(
                ProtocolError, f"{call.method} {url}: {exc or type(exc).__name__}", exc, attempts
            )

    async def aclose(self) -> None:
        if self._session is not None and asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "close an AsyncClient on the event loop it ran on: its connections live there"
            )
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def _failed(
    cls: type[TensorServeError], message: str, cause: BaseException, attempts: int
) -> TensorServeError:
    error = cls(message, attempts=attempts)
    error.__cause__ = cause
    return error


def _describe(outcome: Outcome) -> str:
    if isinstance(outcome, Response):
        return f"HTTP {outcome.status}"
    return f"{type(outcome).__name__}: {outcome}"

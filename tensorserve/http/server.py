"""Running the server: start-up checks, the listening socket, the event loop,
and a shutdown in phases (docs/reliability.md, "Start-up" and "Shutdown").

The command line calls ``run``; everything that needs aiohttp stays under
``tensorserve/http/``. Other front ends (gRPC) are given to ``run`` as
factories of the data plane's ``FrontEnd``: they run on the same loop and
data plane, and go through the same shutdown phases, and this module never
imports them (the command line does).

Start-up, in this order, so a start that cannot succeed fails before any
model loads or any worker process starts:

1. the model repository is a readable folder holding at least one model
   (or ``allow_empty_repository``);
2. the socket is bound and listening (a port in use fails here);
3. the app starts, and models load in the background (liveness answers
   meanwhile; readiness once they are ready).

Each failure is a ``StartupError`` whose message is one sentence; the CLI
prints it as one line and exits non-zero.

Shutdown, on SIGTERM or SIGINT (the phases of ``dataplane/lifecycle.py``):
readiness turns 503 at once while requests are still served for
``drain_delay_s``, each response closing its connection; then the listening
socket closes and requests in flight get ``shutdown_grace_s`` to finish;
whatever is still waiting then is answered 503; connections close, models
close (their worker processes stop) and the process exits 0. A second signal exits at
once with status 128 + the signal's number, as a shell reports a process
killed by it.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import warnings
from collections.abc import Sequence

from aiohttp import web

from tensorserve.dataplane import logs
from tensorserve.dataplane.frontend import FrontEnd, FrontEndFactory, StartupError
from tensorserve.dataplane.lifecycle import Lifecycle, Phase
from tensorserve.errors import ConfigError
from tensorserve.http.app import create_app
from tensorserve.http.keys import PLANE
from tensorserve.repository.loader import discover
from tensorserve.settings import Settings

log = logging.getLogger(__name__)

BACKLOG = 1024
# After the grace period every tracked request has been answered; what aiohttp
# still waits for is handlers of other routes (a model load, say).
CLOSE_TIMEOUT_S = 5.0
# How long connections still open after the last reply may take to send a
# request (or close) before shutdown closes them; idle keep-alive
# connections make a shutdown this much longer, at most.
ARRIVAL_S = 1.0


def check_repository(settings: Settings) -> None:
    """A readable folder holding at least one model, unless empty ones are allowed."""
    path = settings.model_repository
    if not path.exists():
        raise StartupError(f"model repository {str(path)!r} does not exist")
    try:
        models = discover(path)
    except ConfigError as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:  # a folder we may not list
        raise StartupError(
            f"model repository {str(path)!r} cannot be read: {exc.strerror or exc}"
        ) from None
    if not models and not settings.allow_empty_repository:
        raise StartupError(
            f"model repository {str(path)!r} holds no model (a folder with a config.toml); "
            f"pass --allow-empty-repository to start without one and load models later "
            f"through the repository API (--model-control-mode explicit) or from the "
            f"repository's files (--model-control-mode poll)"
        )


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on ``host:port``, or ``StartupError`` saying why not.
    ``reuse_port``: one of the front ends' sockets on the same port
    (``SO_REUSEPORT``: the kernel spreads connections among them)."""
    try:
        return socket.create_server((host, port), backlog=BACKLOG, reuse_port=reuse_port)
    except OSError as exc:
        raise cannot_listen(f"{host}:{port}", exc) from None


def cannot_listen(where: str, exc: OSError) -> StartupError:
    """The one sentence of a socket that cannot be bound (``where``: "host:port",
    or "for gRPC on host:port")."""
    if isinstance(exc, socket.gaierror):
        return StartupError(f"cannot listen on {where}: unknown host ({exc.strerror})")
    reason = "the port is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
    return StartupError(f"cannot listen on {where}: {reason or exc}")


def _install_uvloop() -> None:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def tune_process(settings: Settings) -> None:
    """What every serving process sets before its loop starts."""
    _install_uvloop()
    sys.setswitchinterval(settings.switch_interval_ms / 1000)
    # nn.TransformerEncoder's default fast path announces itself on every start:
    # noise for operators, not a problem of theirs.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype")


__all__ = ["StartupError", "run"]


def run(
    settings: Settings,
    front_ends: Sequence[FrontEndFactory] = (),
    *,
    app: web.Application | None = None,
    sock: socket.socket | None = None,
    process: str | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then shut down in phases. Raises
    ``StartupError`` (before anything started) when the server cannot start.
    A front-end process (``--frontends N``) gives its ``app`` and its
    ``sock``: the scheduler process has checked the repository and the ports;
    ``process`` names it on every log line ("frontend 2")."""
    logs.configure(
        settings.log_level, settings.log_format, process
    )  # text or JSON lines, request ids
    if sock is None:
        check_repository(settings)
        sock = bind(settings.host, settings.port)
        # Only a server that can start logs its banner: one that cannot says why
        # in one line (the CLI prints the StartupError), nothing else.
        logs.log_startup(settings)
    tune_process(settings)
    try:
        app = app if app is not None else create_app(settings)
        app[PLANE].lifecycle = Lifecycle()
        app.on_response_prepare.append(_close_when_draining)
        # Everything imported so far (torch, grpcio's and protobuf's modules)
        # lives as long as the process: kept out of the collector's full
        # passes, which otherwise stalled the loop ~50-100 ms every few
        # seconds (wrk at c=1 with the gRPC front end loaded: p99 55-70 ms
        # -> 0.7 ms; benchmarks/results/HISTORY.md, "gRPC beside HTTP").
        gc.collect()
        gc.freeze()
        asyncio.run(_serve(app, sock, settings, front_ends))
    finally:
        sock.close()


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    """Once shutdown begins, every response closes its connection (``Connection:
    close``), so clients reconnect through their load balancer to another
    replica. Without it, closing an idle keep-alive connection later races
    with the client's next request on it, which it would see as a reset."""
    if request.app[PLANE].draining:
        response.force_close()
        # aiohttp has already chosen the Connection header when this hook runs.
        response.headers["Connection"] = "close"


async def _serve(
    app: web.Application,
    sock: socket.socket,
    settings: Settings,
    factories: Sequence[FrontEndFactory],
) -> None:
    stop = asyncio.Event()
    _handle_signals(stop)
    others: list[FrontEnd] = []
    for factory in factories:  # bound before any model loads: a port in use fails here
        front_end = factory(app[PLANE])
        await front_end.start()
        others.append(front_end)
    runner = web.AppRunner(
        app,
        handle_signals=False,  # ours: a shutdown in phases
        access_log=None,  # tensorserve.access, with latency and request id (http/observe.py)
        handler_cancellation=True,  # a caller that disconnects frees its queued items
        keepalive_timeout=settings.keepalive_timeout_s,
        shutdown_timeout=CLOSE_TIMEOUT_S,
    )
    await runner.setup()  # the app's start-up: models begin to load
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        host, port = sock.getsockname()[:2]
        log.info("serving %s on http://%s:%s", settings.model_repository, host, port)
        await stop.wait()
        lifecycle = app[PLANE].lifecycle
        assert lifecycle is not None  # set by the app's start-up, which has run
        await _shut_down(lifecycle, runner, site, sock, settings, others)
    finally:
        for front_end in others:
            await front_end.close()
        await runner.cleanup()  # models close: queued items withdrawn, workers stopped
    log.info("shutdown: done")


def _handle_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("shutdown: second %s, exiting at once (status %d)", name, 128 + signum)
            logging.shutdown()
            os._exit(128 + signum)  # worker processes exit when their socket closes
        log.info("shutdown: %s received (send it again to exit at once)", name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def _stop_listening(site: web.BaseSite, sock: socket.socket, runner: web.AppRunner) -> None:
    """Close the listening socket without resetting the connections the kernel
    has already queued on it (clients that connected, and may have sent a
    request, in the instant before): a duplicate descriptor keeps the socket
    open while aiohttp stops accepting, those connections are accepted and
    served, and only then is it closed."""
    queued = sock.dup()
    queued.setblocking(False)
    try:
        await site.stop()
        loop = asyncio.get_running_loop()
        while runner.server is not None:
            try:
                connection, _ = queued.accept()
            except (BlockingIOError, InterruptedError):
                break
            await loop.connect_accepted_socket(runner.server, connection)
    finally:
        queued.close()


async def _finish_in_flight(lifecycle: Lifecycle, runner: web.AppRunner, grace: float) -> bool:
    """True once nothing is in flight, within ``grace`` seconds. A connection
    still open when the handlers are done may have a request on its way (a
    client that connected as the socket closed): such connections get up to
    ``ARRIVAL_S`` to send it, or to close, before the runner closes them."""
    loop = asyncio.get_running_loop()
    grace_ends = loop.time() + grace
    if not await lifecycle.wait_idle(grace):
        return False
    arrivals_end = min(loop.time() + ARRIVAL_S, grace_ends)
    while runner.server is not None and runner.server.connections and loop.time() < arrivals_end:
        await asyncio.sleep(0.02)  # polled: aiohttp has no event for "a connection closed"
    return await lifecycle.wait_idle(max(0.0, grace_ends - loop.time()))


async def _shut_down(
    lifecycle: Lifecycle,
    runner: web.AppRunner,
    site: web.BaseSite,
    sock: socket.socket,
    settings: Settings,
    others: Sequence[FrontEnd] = (),
) -> None:
    lifecycle.phase = Phase.DRAINING
    log.info(
        "shutdown: readiness answers 503; still serving for %.1f s (drain_delay_s)",
        settings.drain_delay_s,
    )
    await asyncio.sleep(settings.drain_delay_s)

    lifecycle.phase = Phase.CLOSING
    # No new connections. Open ones stay: a request may be on its way on each
    # (closing it now would lose that request); every reply closes its
    # connection, and what is idle at the end closes with the runner.
    await _stop_listening(site, sock, runner)
    for front_end in others:
        await front_end.stop_accepting()
    log.info(
        "shutdown: no longer accepting; %d request(s) in flight get %.1f s to finish "
        "(shutdown_grace_s)",
        lifecycle.in_flight,
        settings.shutdown_grace_s,
    )
    if not await _finish_in_flight(lifecycle, runner, settings.shutdown_grace_s):
        left = lifecycle.abort()
        log.warning(
            "shutdown: grace period over; answering %d request(s) still waiting with 503", left
        )
        await lifecycle.wait_idle(CLOSE_TIMEOUT_S)
    log.info("shutdown: every request answered; closing models")

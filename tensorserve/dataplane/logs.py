"""Logging: request ids on every line, text or JSON lines, and a rate limit
for lines a client can cause.

A request's id lives in a ``ContextVar`` that each front end sets when a
call arrives (``DataPlane.begin``): from the caller's ``X-Request-ID`` header
(HTTP) or ``x-request-id`` metadata (gRPC), else a new one. A log-record factory copies it onto every record as
``record.request_id`` ("-" outside a request), so a line logged by any code
the handler calls (a codec, the registry, a thread started with
``asyncio.to_thread``) carries the id of the request it is about.

    2026-11-23 16:20:01,532 WARNING tensorserve.dataplane [3f2a...]: POST /v2/models/m/infer -> 400 invalid_input ...
    {"ts": "...", "level": "WARNING", "logger": "tensorserve.dataplane", "request_id": "3f2a...", ...}
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from tensorserve.host import available_cpus, choose_frontends

REQUEST_ID: ContextVar[str] = ContextVar("tensorserve_request_id", default="-")
HEADER = "X-Request-ID"  # gRPC: the same name, as metadata (lower case)
MAX_ID_LENGTH = 128
_SAFE_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ID_LENGTH}}}")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# Record attributes that are not "extra" fields of the JSON line.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "request_id",
}


def request_id_from(header: str | None) -> str:
    """The caller's ``X-Request-ID`` when it is safe to echo and log (at most
    128 of ``A-Z a-z 0-9 . _ : -``), else a new random id."""
    if header is not None and _SAFE_ID.fullmatch(header):
        return header
    return os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID


@contextlib.contextmanager
def logged_as(request_id: str | None) -> Iterator[None]:
    """Lines logged inside carry ``request_id`` (None: the current one), for
    code that acts for a request outside its task: the scheduler process,
    answering a front end's request."""
    if request_id is None:
        yield
        return
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


_factory_lock = threading.Lock()
_installed = False


def install_request_ids() -> None:
    """Make every log record carry ``request_id`` (idempotent)."""
    global _installed
    with _factory_lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            record.request_id = REQUEST_ID.get()
            return record

        logging.setLogRecordFactory(factory)
        _installed = True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request id, message,
    the ``extra`` fields given to the call, and the traceback if any; and
    which of the server's processes wrote it, when it has several."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if self.process is not None:
            line["process"] = self.process
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        return json.dumps(line, default=str)


def configure(level: str, fmt: str, process: str | None = None) -> None:
    """The server's logging: one stderr handler, text or JSON lines.
    ``process``: which of the server's processes this is ("scheduler",
    "frontend 2"), on every line, when it has several (``--frontends N``)."""
    install_request_ids()
    handler = logging.StreamHandler(sys.stderr)
    text = (
        TEXT_FORMAT
        if process is None
        else TEXT_FORMAT.replace("%(name)s", f"%(name)s {{{process}}}")
    )
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else logging.Formatter(text))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's own access log is replaced by tensorserve.access (http/observe.py).
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class RateLimit:
    """At most ``burst`` lines per ``period`` seconds for each key (an error
    code, say); a flood of bad requests then costs a few lines, the first of
    which after a quiet spell says how many were left out."""

    def __init__(self, burst: int = 10, period: float = 10.0) -> None:
        self.burst, self.period = burst, period
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[float, int, int]] = {}  # key -> (start, sent, dropped)

    def allow(self, key: str, now: float | None = None) -> tuple[bool, int]:
        """(log this line?, lines left out since the last one logged)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            start, sent, dropped = self._windows.get(key, (now, 0, 0))
            if now - start >= self.period:
                start, sent = now, 0
            if sent < self.burst:
                self._windows[key] = (start, sent + 1, 0)
                return True, dropped
            self._windows[key] = (start, sent, dropped + 1)
            return False, dropped + 1


# The settings an operator needs to read a server's log (the rest are defaults).
STARTUP_SETTINGS = (
    "host",
    "port",
    "grpc_port",
    "frontends",
    "model_repository",
    "log_level",
    "log_format",
    "access_log",
    "max_request_bytes",
    "max_items_per_request",
    "intra_op_threads",
    "device",
    "liveness_stall_s",
    "model_control_mode",
)


def effective_frontends(
    frontends: int | str | None, device: str = "auto", cpus: int | None = None
) -> str:
    """``--frontends`` as the startup line shows it: a number as given, and
    ``auto`` or the default with what it became here and why
    (``auto → 1 (2 CPUs)``, ``default → 1 (no GPU visible)``)."""
    cpus = available_cpus() if cpus is None else cpus
    return choose_frontends(frontends, device, cpus=cpus).shown


def log_startup(settings: Any) -> None:
    """The first line of a server's log: version, Python, the settings that
    matter, and every per-model override given. (The listening address, with
    the real ports of ``--port 0`` and ``--grpc-port 0``, follows once the socket is bound.)"""
    from tensorserve import __version__

    chosen = {name: getattr(settings, name) for name in STARTUP_SETTINGS}
    chosen["frontends"] = effective_frontends(settings.frontends, settings.device)
    chosen.update(settings.model_overrides())
    logging.getLogger("tensorserve").info(
        "tensorserve %s (Python %s) starting: %s",
        __version__,
        sys.version.split()[0],
        ", ".join(f"{k}={v}" for k, v in chosen.items()),
        extra={"version": __version__, "settings": {k: str(v) for k, v in chosen.items()}},
    )

"""The standby: one spare worker process per model, loaded in the background
for whichever instance's worker dies next, so that a crash costs a swap
instead of a model load.

A spare belongs to the thread that loads it until it is ready, then to the
standby (under its lock) until ``take`` hands it to ``repair`` (on a
pool thread of the scheduler's loop), which replaces a dead worker; ``close`` only kills one that is still loading.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tensorserve.errors import ConfigError
from tensorserve.runtime.template import Template
from tensorserve.runtime.worker_process import LOAD_TIMEOUT_S, WorkerProcess

log = logging.getLogger("tensorserve.runtime.isolated")


class Standby:
    """One model's spare worker (see the module docstring)."""

    def __init__(self, hello: dict[str, Any], label: str, template: Template | None = None) -> None:
        self.hello = hello
        self.template = template
        self.label = f"{label} standby"
        self._lock = threading.Lock()
        self._ready: WorkerProcess | None = None
        self._loading: WorkerProcess | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def refill(self) -> None:
        with self._lock:
            if self._closed or self._ready is not None or self._loading is not None:
                return
            self._loading = WorkerProcess(self.hello, self.label, self.template)
            self._thread = threading.Thread(target=self._load, name=self.label, daemon=True)
            self._thread.start()

    def _load(self) -> None:
        worker = self._loading
        assert worker is not None
        try:
            worker.start()
        except ConfigError as exc:
            if not self._closed:
                log.error(
                    "%s: could not start (%s); crashes will reload the model", self.label, exc
                )
            worker = None
        with self._lock:
            self._loading = None
            if worker is not None and not self._closed:
                self._ready, worker = worker, None
        if worker is not None:
            worker.stop()  # closed while it loaded

    def take(self) -> WorkerProcess | None:
        """The loaded spare (waiting for one that is loading: it is further
        along than a new start would be); a new one starts loading."""
        with self._lock:
            thread = self._thread if self._loading is not None else None
        if thread is not None:
            thread.join(LOAD_TIMEOUT_S)
        with self._lock:
            spare, self._ready = self._ready, None
        if spare is not None and not spare.running():  # off the loop: it may ask the template
            spare.stop()
            spare = None
        self.refill()
        return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._ready = self._ready, None
            loading, thread = self._loading, self._thread
        if loading is not None:
            loading.kill("the model is closing")  # its start() then fails at once
        if thread is not None:
            thread.join()
        if spare is not None:
            spare.stop()

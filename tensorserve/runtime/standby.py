"""The standby: a spare worker process, made in the background for whichever
instance's worker dies next, so that a crash costs a swap instead of a
model load or a fork.

``SharedSpare``: one for every model the worker template holds loaded (the
default on the CPU): a worker forked from the template that has not been
told its model yet; ``take`` tells it (``WorkerProcess.assign``: a message
and its answer), and a new one is forked. Why one, not one per model: a
crash is rare and replacing the spare is a fork (docs/threading.md, "One
template, one spare"). ``Standby``: a spare of one model's own, loaded
already, for a model the template does not load (on a GPU, ONNX Runtime).

A spare belongs to the thread that makes it until it is ready, then to the
standby (under its lock) until ``take`` hands it to ``repair`` (on a
pool thread of the scheduler's loop), which replaces a dead worker; ``close``
only kills one that is still loading.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tensorserve.errors import ConfigError
from tensorserve.runtime.template import Template
from tensorserve.runtime.worker_process import LOAD_TIMEOUT_S, WorkerProcess

log = logging.getLogger("tensorserve.runtime.isolated")

SPARE = "the spare worker"


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

    @property
    def ready(self) -> WorkerProcess | None:
        return self._ready

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


class SharedSpare:
    """One forked spare for every model the template holds (see the module
    docstring); it may serve the models the template held when it was forked."""

    def __init__(self, template: Template) -> None:
        self.template = template
        self._lock = threading.Lock()
        self._ready: WorkerProcess | None = None
        self._keys: frozenset[str] = frozenset()  # the models the ready one may serve
        self._thread: threading.Thread | None = None  # forking one
        self._again = False  # a model was added while it forked: fork a newer one
        self._closed = False

    def ready_for(self, key: str) -> WorkerProcess | None:
        """The spare, if it is up and can serve the model ``key``."""
        with self._lock:
            return self._ready if key in self._keys else None

    def refill(self) -> None:
        """Fork a spare, unless one that can serve every model is ready (in
        the background: a fork may wait for a model the template loads)."""
        with self._lock:
            if self._closed:
                return
            if self._thread is not None:
                self._again = True
                return
            if self._ready is not None and self._keys >= self.template.keys:
                return
            self._thread = threading.Thread(target=self._fork, name=SPARE, daemon=True)
            self._thread.start()

    def _fork(self) -> None:
        keys = self.template.keys  # before the fork: it holds at least these
        forked = WorkerProcess({}, SPARE, self.template)
        worker: WorkerProcess | None = forked
        try:
            forked.start_idle()
        except (ConfigError, EOFError, OSError) as exc:
            if not self._closed:
                log.error("%s: could not fork (%s); a crash forks a new worker", SPARE, exc)
            worker = None
        with self._lock:
            self._thread, again, self._again = None, self._again, False
            old = None
            if worker is not None and not self._closed:
                old, self._ready, self._keys, worker = self._ready, worker, keys, None
        for stale in (old, worker):
            if stale is not None:
                stale.stop()
        if again:
            self.refill()

    def take(self, hello: dict[str, Any], label: str) -> WorkerProcess | None:
        """The spare, told that it now serves ``hello``'s model (waiting for
        one being forked only if the ready one cannot serve it: a fork may
        wait for another model's load in the template); None if none can; a
        new one is forked."""
        with self._lock:
            usable = self._ready is not None and hello.get("key") in self._keys
            thread = None if usable else self._thread
        if thread is not None:
            thread.join(LOAD_TIMEOUT_S)
        with self._lock:
            spare, self._ready = self._ready, None
            serves = hello.get("key") in self._keys
        if spare is not None and (not serves or not spare.running()):
            spare.stop()  # off the loop: running() may ask the template
            spare = None
        if spare is not None:
            try:
                spare.assign(hello, label)
            except ConfigError as exc:
                log.error("%s: could not take over (%s)", label, exc)
                spare = None
        self.refill()
        return spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spare, self._ready = self._ready, None
            thread = self._thread
        if thread is not None:
            thread.join()
        if spare is not None:
            spare.stop()


class SharedStandby:
    """A model's view of the shared spare, with ``Standby``'s methods;
    ``spare`` is set once the model has its template (``ProcessExecutor.start``)."""

    def __init__(self, hello: dict[str, Any], label: str) -> None:
        self.hello = hello
        self.label = label
        self.spare: SharedSpare | None = None

    @property
    def ready(self) -> WorkerProcess | None:
        """The shared spare, once it is up and can serve this model."""
        return self.spare.ready_for(self.hello["key"]) if self.spare is not None else None

    def refill(self) -> None:
        if self.spare is not None:
            self.spare.refill()

    def take(self) -> WorkerProcess | None:
        return self.spare.take(self.hello, self.label) if self.spare is not None else None

    def close(self) -> None:
        """The spare is the template's: it stays for the other models."""

"""The worker template and the spare worker that every process-isolated
model of this process shares: started by the first model that needs them,
stopped after the last one closes. Why shared, not one each per model:
docs/threading.md, "One template, one spare".

A template found dead (a model's code killed it) is replaced for the models
that come next; the models that used it spawn their workers afresh, as
without a template, until they are loaded again.

``prestart``: the server spawns the template before it imports torch itself,
so that the two imports overlap (each is one core's work for seconds on a
small machine) rather than the template's starting once the first model
loads; ``end_prestart`` after the first loads stops it if no model took it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tensorserve.errors import ConfigError
from tensorserve.runtime.standby import SharedSpare
from tensorserve.runtime.template import Template


@dataclass
class SharedWorkers:
    template: Template
    spare: SharedSpare
    users: int = 0  # models that hold it (acquire, not yet release)


class _Holder:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # also makes a second model wait while the template starts
        self.current: SharedWorkers | None = None
        self.prestarted: SharedWorkers | None = None  # holds one use until end_prestart


_HOLDER = _Holder()


def acquire(log_level: str) -> SharedWorkers:
    """The shared template and spare, started if need be (``ConfigError`` if
    the template cannot start); every ``acquire`` is paired with a ``release``."""
    with _HOLDER.lock:
        shared = _HOLDER.current
        if shared is not None and not shared.template.started and shared.template.alive:
            try:
                shared.template.wait_started()  # prestarted: it may still be importing
            except ConfigError:
                pass  # a new one, below
        if shared is None or not shared.template.started or not shared.template.alive:
            template = Template(log_level)
            template.start()
            shared = _HOLDER.current = SharedWorkers(template, SharedSpare(template))
        shared.users += 1
        return shared


def prestart(log_level: str) -> None:
    """Spawn the template now, without waiting for it (see the module docstring)."""
    with _HOLDER.lock:
        if _HOLDER.current is not None:
            return
        template = Template(log_level)
        template.launch()
        shared = _HOLDER.current = _HOLDER.prestarted = SharedWorkers(
            template, SharedSpare(template)
        )
        shared.users += 1


def end_prestart() -> None:
    """The first loads are done: the template stays only if a model took it."""
    with _HOLDER.lock:
        shared, _HOLDER.prestarted = _HOLDER.prestarted, None
    if shared is not None:
        release(shared)


def release(shared: SharedWorkers) -> None:
    """One model is done with them; the last one stops them."""
    with _HOLDER.lock:
        shared.users -= 1
        if shared.users > 0:
            return
        if _HOLDER.current is shared:
            _HOLDER.current = None
    shared.spare.close()
    shared.template.stop()

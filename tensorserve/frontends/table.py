"""What the scheduler process tells every front end about its models: the
model table (what each front end needs to decode, validate and encode
without asking: name, version, state, reason, the served config) and which
models' latency targets a request would miss now."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tensorserve.dataplane.plane import DataPlane
from tensorserve.ensemble import Ensemble
from tensorserve.errors import WouldMissTarget
from tensorserve.serving.model import ServedModel
from tensorserve.serving.registry import ModelRegistry

log = logging.getLogger(__name__)

# How often the models with a latency target are asked whether one more item
# would miss it. A front end refuses on what it was told last: at most this
# old, against a prediction that moves by whole batches.
LATE_CHECK_S = 0.005


class Generations:
    """A number per model that changes whenever what serves it does (a load,
    a reload of the same version, an unload): the front ends send it with
    each request, and a request validated against another generation's
    config is refused, not batched (``hub.py``). The served objects are held
    only to compare them, never by address (an address is reused)."""

    def __init__(self) -> None:
        self._served: dict[str, tuple[Any, int]] = {}
        self._next = 0

    def of(self, name: str, served: Any) -> int:
        known = self._served.get(name)
        if known is not None and known[0] is served:
            return known[1]
        self._next += 1
        self._served[name] = (served, self._next)
        return self._next

    def current(self, name: str, served: Any, generation: int) -> bool:
        known = self._served.get(name)
        return known is not None and known[0] is served and known[1] == generation


def table_key(registry: ModelRegistry, generations: Generations) -> tuple[Any, ...]:
    """Changes whenever the table would, at a fraction of its cost (it is
    asked every ``TABLE_CHECK_S``; a config's dump only when it changed)."""
    return tuple(
        (e.name, e.version, e.state, e.reason, generations.of(e.name, e.served))
        for e in registry.entries.values()
    )


def model_table(registry: ModelRegistry, generations: Generations) -> list[list[Any]]:
    """[[name, version, state, reason, config, is_ensemble, generation], ...]:
    the config as the served model uses it (what "auto" became on this
    device), as JSON-like data the front end validates back into a
    ``ModelConfig``; None where nothing serves (a front end needs none)."""
    table = []
    for entry in registry.entries.values():
        served = entry.served
        config = served.config if served is not None else None
        table.append(
            [
                entry.name,
                entry.version,
                entry.state.value,
                entry.reason,
                config.model_dump(mode="json") if config is not None else None,
                isinstance(served, Ensemble),
                generations.of(entry.name, served),
            ]
        )
    return table


class LatePublisher:
    """Publishes ``{model: [message, retry_after]}`` for the models whose
    target one more item at the highest priority would miss, when that
    changes; a timer on the loop while any served model has a target."""

    def __init__(self, plane: DataPlane, publish: Callable[[dict[str, Any]], None]) -> None:
        self.plane = plane
        self._publish = publish
        self.late: dict[str, Any] = {}
        self._timer: asyncio.TimerHandle | None = None

    def send_to(self, outbox: Any) -> None:
        outbox.put("late", self.late)

    def models_changed(self) -> None:
        """Start or stop the timer as models with a target come and go."""
        if self._targeted() and self._timer is None:
            self._tick()
        elif not self._targeted():
            self.stop()
            if self.late:
                self.late = {}
                self._publish(self.late)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _targeted(self) -> list[ServedModel]:
        return [
            e.served
            for e in self.plane.registry.entries.values()
            if isinstance(e.served, ServedModel) and e.served.batcher.latency_target is not None
        ]

    def _tick(self) -> None:
        try:
            late: dict[str, Any] = {}
            for served in self._targeted():
                try:
                    served.refuse_if_late(count=False)
                except WouldMissTarget as exc:
                    late[served.name] = [exc.message, exc.retry_after]
            if late != self.late:
                self.late = late
                self._publish(late)
        except Exception:  # a bug here must not leave the front ends refusing for good
            log.exception("publishing the latency targets failed")
        finally:
            self._timer = asyncio.get_running_loop().call_later(LATE_CHECK_S, self._tick)

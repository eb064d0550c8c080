"""What the scheduler process tells every front end about its models: the
model table (what each front end needs to decode, validate and encode
without asking: name, version, state, reason, the served config) and which
models' latency targets a request would miss now."""

from __future__ import annotations

import asyncio
import logging
import math
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


# A late model: its latency target and the Retry-After its refusal would
# carry now, in seconds (both move with the queue; the target only on a reload).
Late = tuple[float, float]


def late_models(plane: DataPlane) -> dict[str, Late]:
    """The served models whose target one more item at the highest priority
    would miss now (as a front end asks before reading a request)."""
    late: dict[str, Late] = {}
    for served in targeted_models(plane):
        try:
            served.refuse_if_late(count=False)
        except WouldMissTarget as exc:
            target = served.batcher.latency_target
            assert target is not None
            late[served.name] = (target.target_s, exc.retry_after)
    return late


def targeted_models(plane: DataPlane) -> list[ServedModel]:
    return [
        e.served
        for e in plane.registry.entries.values()
        if isinstance(e.served, ServedModel) and e.served.batcher.latency_target is not None
    ]


def as_acted_on(late: dict[str, Late]) -> dict[str, Late]:
    """What a front end does with ``late``: which models it refuses, and the
    Retry-After it sends, in whole seconds as both protocols round it
    (``math.ceil``: http/errors.py, grpc/errors.py)."""
    return {
        name: (target_s, math.ceil(retry_after)) for name, (target_s, retry_after) in late.items()
    }


def refusals(acted_on: dict[str, Late]) -> dict[str, list[Any]]:
    """``{model: [message, retry_after]}``, what a front end refuses with
    before it reads a request. Built only from what it acts on, so it stays
    true for as long as it is published: the predicted wait, which moves
    with every item queued, is left to the refusals of admission itself."""
    return {
        name: [
            (
                f"model {name!r} is over its {1000 * target_s:.0f} ms latency target: a "
                f"request now would wait longer; retry in {retry_after:.0f} s"
            ),
            retry_after,
        ]
        for name, (target_s, retry_after) in acted_on.items()
    }


class LatePublisher:
    """Publishes ``refusals`` to every front end when what they act on
    changes (which models are late, or a Retry-After in whole seconds), not
    when only the predicted wait moves; a timer on the loop, every
    ``LATE_CHECK_S``, while any served model has a target.

    ``find_late``: ``late_models`` of the scheduler process's plane (made
    up in tests)."""

    def __init__(
        self,
        find_late: Callable[[], dict[str, Late]],
        publish: Callable[[dict[str, Any]], None],
    ) -> None:
        self._find_late = find_late
        self._publish = publish
        self._seen: dict[str, Late] = {}
        self.late: dict[str, Any] = {}  # as last published
        self._timer: asyncio.TimerHandle | None = None

    def send_to(self, outbox: Any) -> None:
        outbox.put("late", self.late)

    def models_changed(self, targeted: bool) -> None:
        """Start or stop the timer as models with a target come and go."""
        if targeted and self._timer is None:
            self._tick()
        elif not targeted:
            self.stop()
            self._changed({})

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def check(self) -> None:
        """One look: publish if what a front end acts on changed."""
        self._changed(self._find_late())

    def _changed(self, late: dict[str, Late]) -> None:
        acted_on = as_acted_on(late)
        if acted_on != self._seen:
            self._seen = acted_on
            self.late = refusals(acted_on)
            self._publish(self.late)

    def _tick(self) -> None:
        try:
            self.check()
        except Exception:  # a bug here must not leave the front ends refusing for good
            log.exception("publishing the latency targets failed")
        finally:
            self._timer = asyncio.get_running_loop().call_later(LATE_CHECK_S, self._tick)

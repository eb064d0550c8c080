"""The rules of looking a model up among the entries of a registry: its
state (``ModelState``), ``lookup`` (an unknown model or version) and
``ready`` (what serves it, or why nothing does). The registry
(``registry.py``) and a front-end process's copy of its table
(``frontends/remote.py``) answer alike with them; kept apart from the
registry so that a front end, which runs no model, imports no torch."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from tensorserve.errors import ModelNotFound, ModelNotReady


class ModelState(str, enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    FAILED = "FAILED"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"  # unloaded on request


class Entry(Protocol):
    """What a lookup reads of a model's entry: the registry's ``ModelEntry``,
    or a front end's copy of it (``frontends/remote.py``)."""

    name: str
    state: ModelState
    reason: str
    version: int | None

    @property
    def served(self) -> Any: ...


E = TypeVar("E", bound=Entry)


def lookup(entries: Mapping[str, E], name: str, version: str | None) -> E:
    """The entry of ``name``, or ``ModelNotFound`` for an unknown model or
    a version that is not the one served."""
    entry = entries.get(name)
    if entry is None:
        raise ModelNotFound(f"unknown model {name!r}")
    if version is not None and entry.version is not None and version != str(entry.version):
        raise ModelNotFound(
            f"model {name!r} version {version!r} is not served (serving version {entry.version})"
        )
    return entry


def ready(entry: Entry) -> Any:
    """What serves the entry's requests, or ``ModelNotReady`` with its state
    and reason."""
    if entry.state is not ModelState.READY or entry.served is None:
        detail = f": {entry.reason}" if entry.reason else ""
        raise ModelNotReady(f"model {entry.name!r} is not ready ({entry.state.value}){detail}")
    return entry.served

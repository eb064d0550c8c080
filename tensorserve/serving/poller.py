"""Poll mode (``model_control_mode = "poll"``): the repository's files decide
what is served, as in Triton's poll mode.

Every ``interval`` seconds the repository is scanned: a model folder whose
files changed (by path, modification time and size) is reloaded, a new one
is loaded, a removed one is unloaded. Reloading is ``ModelRegistry.load``,
so a reload that fails keeps serving the old version.

``RepositoryPoller.run`` is one asyncio task on the server's loop, owned by
the app (``http/app.py`` starts and cancels it); the scans run in a thread,
so a slow disk never blocks the loop. A scan or a load that raises is logged
and the next poll tries again: the poller never dies silently.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from tensorserve.errors import ConfigError
from tensorserve.pools import on_control_pool
from tensorserve.repository.loader import discover
from tensorserve.serving.registry import ModelRegistry

log = logging.getLogger(__name__)

# A model folder's files: (path inside the folder, mtime in ns, size), sorted.
Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(folder: Path) -> Fingerprint:
    """What a model folder holds, down to each file's mtime and size. Python's
    bytecode caches are left out: importing model.py writes them, and a load
    must not look like a change."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = Path(root, name)
            try:
                stat = path.stat()  # follows links: a ConfigMap's files are links
            except FileNotFoundError:
                continue  # removed while we looked: the next poll sees the rest
            files.append((str(path.relative_to(folder)), stat.st_mtime_ns, stat.st_size))
    return tuple(files)


def scan(repository: Path) -> dict[str, Fingerprint]:
    """Every model of the repository with its fingerprint."""
    return {name: fingerprint(source.path) for name, source in discover(repository).items()}


@dataclass(frozen=True)
class Changes:
    added: list[str]
    changed: list[str]
    removed: list[str]


def compare(before: dict[str, Fingerprint], after: dict[str, Fingerprint]) -> Changes:
    return Changes(
        added=sorted(set(after) - set(before)),
        changed=sorted(name for name in set(after) & set(before) if after[name] != before[name]),
        removed=sorted(set(before) - set(after)),
    )


class RepositoryPoller:
    def __init__(self, registry: ModelRegistry, interval: float) -> None:
        self.registry = registry
        self.interval = interval
        # What the last scan saw; None: no scan has succeeded yet.
        self.seen: dict[str, Fingerprint] | None = None

    def take_baseline(self) -> None:
        """Scan once before the first load, so a file changed while models
        load is reloaded by the first poll."""
        try:
            self.seen = scan(self.registry.repository)
        except (OSError, ConfigError) as exc:  # the start-up load reports it
            log.warning("poll mode: cannot scan the repository yet: %s", exc)

    async def run(self, first_load: asyncio.Task[None]) -> None:
        """Poll until cancelled, from when the start-up load has finished."""
        await asyncio.wait({first_load})  # wait, never cancel it with us
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except Exception:
                log.exception("poll mode: polling the repository failed; trying again")

    async def poll(self) -> Changes:
        """One look at the repository, and the loads and unloads it calls for."""
        try:
            now = await on_control_pool(scan, self.registry.repository)
        except (OSError, ConfigError) as exc:  # briefly unreadable or gone (a remount)
            log.warning("poll mode: cannot scan the repository: %s", exc)
            return Changes([], [], [])
        if self.seen is None:
            self.seen = now  # the baseline failed: this scan is the baseline
            return Changes([], [], [])
        changes = compare(self.seen, now)
        self.seen = now
        for name in changes.removed:
            log.info("poll mode: model %s left the repository; unloading it", name)
            await self.registry.remove(name)
        for name in changes.added + changes.changed:
            log.info(
                "poll mode: model %s %s; loading it",
                name,
                "is new" if name in changes.added else "changed",
            )
        loading = changes.added + changes.changed
        # A load that fails is logged by the registry; this is one that raised
        # (its folder gone again already): the next poll sees what is left.
        outcomes = await asyncio.gather(
            *(self.registry.load(name) for name in loading), return_exceptions=True
        )
        for name, outcome in zip(loading, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("poll mode: loading model %s failed: %s", name, outcome)
        return changes

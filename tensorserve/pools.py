"""The server's two thread pools, each bounded and each for one kind of work.

- ``request``: the request path's costly steps that must not run on the event
  loop (decoding a large body, decompressing it, encoding a large answer).
  They are short and many: a few threads, a multiple of the CPUs this process
  may use (``host.available_cpus``), so a burst of large bodies queues here
  instead of stalling every other caller on the loop.
- ``control``: loads, closes, repairs (a new worker), scans and reports of a
  dead worker. They are long (a repair may take minutes) and rare; on their own
  threads a reload storm or a crash loop never starves the request path, and
  the request path never delays a repair.

``asyncio.to_thread`` and ``run_in_executor(None)`` share the loop's one
default pool for both, which is what this module replaces. Both helpers copy
the caller's context (the request id on every log line), as ``to_thread``
does. The pools start their threads lazily and live for the process; a
forked child (``runtime/template.py``) gets fresh ones (``os.register_at_fork``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tensorserve.host import available_cpus, name_native_thread

T = TypeVar("T")

# Decode/encode is CPU-bound and holds the GIL most of the time: more threads
# than CPUs only add contention; at least 2 so one large body never waits
# behind another.
REQUEST_THREADS = max(2, min(8, 2 * available_cpus()))
# Loads and repairs mostly wait (a file, a fork, a worker's start), and a close
# waits for its model to finish: enough threads that closes waiting never keep a
# repair they wait on from starting; threads start only when needed. A repair of
# each instance of a few models may run at once.
CONTROL_THREADS = 32

_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}


def _pool(kind: str, threads: int) -> ThreadPoolExecutor:
    pool = _pools.get(kind)
    if pool is None:
        with _lock:
            pool = _pools.get(kind)
            if pool is None:
                pool = ThreadPoolExecutor(
                    threads,
                    thread_name_prefix=f"tensorserve-{kind}",
                    initializer=name_native_thread,
                )
                _pools[kind] = pool
    return pool


def request_pool() -> ThreadPoolExecutor:
    return _pool("request", REQUEST_THREADS)


def control_pool() -> ThreadPoolExecutor:
    return _pool("control", CONTROL_THREADS)


def _in(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    return loop.run_in_executor(pool, functools.partial(context.run, fn, *args))


async def on_request_pool(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the request path's pool, awaited."""
    return await _in(request_pool(), fn, *args)


async def on_control_pool(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the pool for loads, closes and repairs, awaited."""
    return await _in(control_pool(), fn, *args)


def _forget_after_fork() -> None:
    # A forked child inherits the dicts but not the threads: new pools there.
    global _lock
    _lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_forget_after_fork)

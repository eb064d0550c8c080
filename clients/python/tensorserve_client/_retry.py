"""How long to wait before the next attempt: exponential backoff with jitter,
never sooner than the server's ``Retry-After``. Pure arithmetic; which answers
are worth retrying is decided in ``_protocol.py``.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """When and how a request is sent again.

    Only answers that say "not now" are retried: a connection that could not
    be made or was dropped, 503 (model not ready, server busy) and 429. The
    n-th retry waits a random time in ``[cap/2, cap]`` where
    ``cap = min(max_backoff, backoff * 2**n)``; if the server sent
    ``Retry-After``, the wait is that long plus a random ``[0, cap]`` so that
    clients told the same number do not all come back at once.

    A retried inference request may have run on the server twice (e.g. the
    connection dropped after the server computed the answer). Inference has
    no side effects on the server, so this only costs time.
    """

    retries: int = 3
    """Attempts after the first; 0 turns retrying off."""
    backoff: float = 0.1
    """Seconds before the first retry (before jitter); doubles each retry."""
    max_backoff: float = 5.0
    """Longest backoff between two attempts, in seconds (before Retry-After)."""
    max_retry_after: float = 30.0
    """A server asking to wait longer than this is not waited for: its error is raised."""

    def __post_init__(self) -> None:
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ValueError(f"retries must be a whole number >= 0, got {self.retries!r}")
        for name in ("backoff", "max_backoff", "max_retry_after"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")

    @classmethod
    def of(cls, retries: int | RetryPolicy) -> RetryPolicy:
        """``Client(retries=3)`` is ``Client(retries=RetryPolicy(retries=3))``."""
        return retries if isinstance(retries, RetryPolicy) else cls(retries=retries)

    def delay(
        self,
        retry: int,
        retry_after: float | None,
        remaining: float | None,
        rng: random.Random,
    ) -> float | None:
        """Seconds to wait before retry number ``retry`` (0-based), or None to give up.

        Gives up when the retries are spent, when the server asks for longer than
        ``max_retry_after``, or when the wait would run past the caller's deadline
        (``remaining`` seconds left; None: no deadline).
        """
        if retry >= self.retries:
            return None
        if retry_after is not None and retry_after > self.max_retry_after:
            return None
        cap = min(self.max_backoff, self.backoff * 2.0**retry)
        if retry_after is None:
            wait = rng.uniform(cap / 2, cap)
        else:
            wait = retry_after + rng.uniform(0, cap)
        if remaining is not None and wait >= remaining:
            return None
        return wait


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` in seconds from ``now`` (a POSIX time): delta-seconds or an
    HTTP date (RFC 9110 §10.2.3). None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # "-0000": GMT by definition of HTTP dates
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = when.timestamp() - now
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)

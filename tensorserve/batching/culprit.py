"""How to find the item that crashed a worker: which of a crash's suspects
to try next, alone. Pure arithmetic: no clocks, no threads (``Recovery`` asks).

A crashed batch's items are its *suspects*; we assume one of them kills any
worker that runs it. The search runs one *trial* at a time: a few suspects
in a batch of their own, between the queue's ordinary batches. A trial that
runs clears its items (they are answered); one that crashes leaves the
other suspects cleared (they go back to the queue's head and ride with new
items); either way the search goes on in the half that holds the culprit,
which must crash a worker alone to be condemned. So only one trial of each
level runs, and a good item runs once more at most.

With ``F(k)`` the seconds a forward of ``k`` suspects costs (the learnt cost
model), ``R`` what a worker restart costs (measured by the executor), and
the culprit equally likely to be any suspect, the expected seconds a search
of ``n`` suspects takes when it tries ``h`` of them next:

    cost(n, h) = F(h) + h/n * (R + E'(h)) + (n-h)/n * E(n-h)
        the trial runs; with chance h/n it held the culprit (a restart, and
        the search goes on in it; E'(1) = 0: it crashed alone), else the
        culprit is in the other n-h
    E(1) = F(1) + R          a lone suspect must crash alone to be condemned
    E(n) = min(cost(n, 1), cost(n, n // 2))

``h = 1`` is a search one item at a time (it stops at the culprit); ``n // 2``
halves. On a tie, one at a time (it kills fewer workers). A flat-cost model
(a GPU: F = 100 ms whatever k) with a 35 ms restart halves down to 5
suspects, then tries one at a time (E(4): 0.285 s one at a time, 0.303 s
in halves); a model that costs per item (F(k) = k * 10 ms) tries one at a
time from the start (each trial costs a tenth of a halving's).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal

Search = Literal["halves", "singles"]
ForwardSeconds = Callable[[int], float]  # F(k): the seconds a forward of k of the items costs


def next_trial(n: int, forward_s: ForwardSeconds, restart_s: float) -> int:
    """How many of ``n`` suspects to trial next: 1 or ``n // 2``."""
    return _plans(forward_s, restart_s)(n)[1]


def choose(n: int, forward_s: ForwardSeconds, restart_s: float) -> Search:
    """The cheaper way to search ``n`` suspects, as the stats name it."""
    return "halves" if next_trial(n, forward_s, restart_s) > 1 else "singles"


def expected_seconds(n: int, forward_s: ForwardSeconds, restart_s: float) -> float:
    """E(n): the expected seconds of the cheaper search, choosing at every trial."""
    return _plans(forward_s, restart_s)(n)[0]


def _plans(forward_s: ForwardSeconds, restart_s: float) -> Callable[[int], tuple[float, int]]:
    """``plans(n) -> (E(n), the trial size that reaches it)`` for one cost model.
    Two candidates a level keep it O(n) forwards' costs for a batch of n."""

    @cache
    def plans(n: int) -> tuple[float, int]:
        if n <= 1:
            return forward_s(1) + restart_s, 1

        def cost(h: int) -> float:
            held = restart_s + (plans(h)[0] if h > 1 else 0.0)
            return forward_s(h) + h / n * held + (n - h) / n * plans(n - h)[0]

        singles, halves = cost(1), cost(n // 2)
        return (halves, n // 2) if halves < singles else (singles, 1)

    return plans

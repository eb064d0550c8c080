"""How to find the item that crashed a worker: run the crashed batch's items
again in halves, or one at a time, whichever is expected to cost the model
less time. Pure arithmetic: no clocks, no threads (``Recovery`` asks).

A crashed batch of ``n`` items holds (we assume) one item that kills any
worker that runs it. Every other item must still run once, and the culprit
must crash a worker alone to be condemned. With ``F(k)`` the seconds a
forward of ``k`` of these items costs (the learnt cost model) and ``R`` the
seconds a worker restart costs (measured by the executor):

    singles(n) = n * F(1) + R
        every item alone; only the culprit's run crashes.
    halves(n)  = F(ceil(n/2)) + F(floor(n/2)) + R + best(ceil(n/2))
        both halves run, the one with the culprit crashes, and the search
        goes on in it (at worst the larger half).
    best(1) = 0  (a lone item that crashed again is condemned)
    best(n) = min(singles(n), halves(n))

Halves are chosen only when strictly cheaper: on a tie, singles kill fewer
workers. A flat-cost model (a GPU: F(k) = 100 ms whatever k) with a 35 ms
restart, n = 16: halves twice, then the crashed 4 one at a time,
2 * (0.2 + 0.035) + (0.4 + 0.035) = 0.905 s against singles 1.635 s (at
4 items, halves cost 0.4 s + 2R, singles 0.4 s + R).
A model that costs per item (F(k) = k * f) never halves: the halves alone
cost ~2n * f against n * f for singles, and log2(n) restarts against one.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal

Search = Literal["halves", "singles"]
ForwardSeconds = Callable[[int], float]  # F(k): the seconds a forward of k of the items costs


def singles_seconds(n: int, forward_s: ForwardSeconds, restart_s: float) -> float:
    """Expected seconds to run ``n`` crashed items one at a time."""
    return n * forward_s(1) + restart_s


def choose(n: int, forward_s: ForwardSeconds, restart_s: float) -> Search:
    """The cheaper way to search a crashed batch of ``n`` items."""
    plans = _plans(forward_s, restart_s)
    return "halves" if plans(n)[1] < singles_seconds(n, forward_s, restart_s) else "singles"


def best_seconds(n: int, forward_s: ForwardSeconds, restart_s: float) -> float:
    """Expected seconds of the cheaper search, choosing again at every level."""
    return _plans(forward_s, restart_s)(n)[0]


def _plans(forward_s: ForwardSeconds, restart_s: float) -> Callable[[int], tuple[float, float]]:
    """``plans(n) -> (best(n), halves(n))`` for one cost model."""

    @cache
    def plans(n: int) -> tuple[float, float]:
        if n <= 1:
            return 0.0, 0.0
        larger, smaller = (n + 1) // 2, n // 2
        halves = forward_s(larger) + forward_s(smaller) + restart_s + plans(larger)[0]
        return min(singles_seconds(n, forward_s, restart_s), halves), halves

    return plans

"""How a batch forms: start here. ``next_batch`` is the one place the
scheduler asks what an instance runs next; this docstring walks the flow
and names the module that decides each step.

    admit      Scheduler.admit (any thread, under Scheduler.lock)
               -> AdmissionQueue.make_room / admit (admission.py): a request's
               items join the queue all or none, or it is refused: queue full
               (ServerBusy, Retry-After from drain.py's DrainRate), too large
               for one batch (RequestTooLarge), or, with a latency target, a
               wait it would miss (WouldMissTarget, target.py)
    wake       Scheduler.wake: on the scheduler's loop ``_pump`` runs at once,
               from another thread through one wake-up of the loop
    claim      Scheduler.free_instance: the least busy instance with room
               (not being repaired, not given up on by the watchdog)
    next       next_batch (below), under the lock:
               1. recovery's parts first: a poisoned batch's halves before
                  any new batch, a crash's trials every other batch, each
                  alone on an idle instance (recovery.Reruns.first)
               2. is a batch due? AdmissionQueue.due_in: full (the target's
                  cap, target.py), the oldest item's max_queue_delay_ms is up,
                  eager dispatch, or closing; not yet: the scheduler's alarm
                  comes back then, and a trial may run meanwhile
                  (Reruns.instead). Behind a running batch only one that
                  cannot grow any more goes (leave_growing)
               3. which items: AdmissionQueue.take offers a window of the
                  queue (by priority level, then age) to the policy
                  (policy.py: FIFO, or length-aware under a padded-volume
                  budget learnt in budget.py from what batches cost), then
                  keeps the padded batch under the element cap
                  (max_batch_elements, and the memory ceiling recovery learnt:
                  ceiling.py MemoryCeiling, copied to AdmissionQueue.memory_limit)
    expire     Scheduler._dispatch -> AdmissionQueue.expire: late items are
               answered (DeadlineExceeded), those whose caller left dropped
    pad        Collator.pad (collate.py), pure: the batch's tensors
    dispatch   instance.dispatch(padded, done): the batch runs; what follows
               (un-pad, answer, or recover) starts at recovery.py's docstring

Every decision above is plain data with the clock passed in (admission,
policy, budget, target: unit-tested with made-up times); the scheduler
(scheduler.py) holds the lock, owns the loop and the instances, and runs
what they decide.
"""

from __future__ import annotations

import math

from tensorserve.batching.admission import AdmissionQueue, Pending
from tensorserve.batching.recovery import Reruns

# What an instance runs next: (entries, for a trial the rest of its crash's
# suspects, seconds until the queue's next batch is due: when the scheduler's
# alarm is to come back, ``math.inf`` not until something changes).
Next = tuple[list[Pending], list[Pending] | None, float]


def next_batch(
    queue: AdmissionQueue,
    reruns: Reruns,
    now: float,
    *,
    ahead: bool,
    cut_short: bool,
    closing: bool,
) -> Next:
    """The next batch for an instance (``ahead``: one that holds a batch
    already); no entries: none now. ``cut_short``: behind a running batch,
    also a batch the policy cuts short of what waits (a budget), which takes
    a policy selection (an arriving item only checks for a full one). The
    caller holds the scheduler's lock."""
    if (rerun := reruns.first(ahead)) is not None:
        return (*rerun, math.inf)
    due_in = queue.due_in(now, ahead=ahead, closing=closing)
    if ahead:  # only a batch that cannot grow goes behind a running one
        if due_in > 0 and not cut_short:
            return [], None, math.inf
        return queue.take(now, leave_growing=due_in > 0), None, math.inf
    if due_in > 0:  # come back when the oldest item is due; a trial need not wait
        return (*reruns.instead(ahead), due_in)
    return queue.take(now), None, math.inf

"""What the scheduler process publishes to every front end about latency
targets (frontends/table.py ``LatePublisher``), without processes or a
loop: the late models are made up, one look at a time. A front end is told
again only when what it acts on changes (which models it refuses, and the
Retry-After it sends, in whole seconds), never because the predicted wait
moved, and what it is told stays true while it is not told again."""

from __future__ import annotations

from typing import Any

from tensorserve.frontends.table import Late, LatePublisher


class MadeUp:
    """The scheduler process's late models, as a test sets them."""

    def __init__(self) -> None:
        self.late: dict[str, Late] = {}
        self.published: list[dict[str, Any]] = []
        self.publisher = LatePublisher(lambda: dict(self.late), self.published.append)

    def look(self, **late: Late) -> int:
        """One check with these models late; how many publications so far."""
        self.late = late
        self.publisher.check()
        return len(self.published)


def test_a_moving_predicted_wait_with_the_same_retry_after_is_not_published_again() -> None:
    made_up = MadeUp()
    assert made_up.look() == 0  # nothing late, as the front ends were told at attach
    # A 200 ms target, a queue growing then shrinking: Retry-After (the
    # predicted wait past the target, at least 1 s) rounds to 2 s each time.
    assert made_up.look(m=(0.2, 1.3)) == 1
    for retry_after in (1.5, 1.9, 2.0, 1.01):
        assert made_up.look(m=(0.2, retry_after)) == 1, retry_after
    ((message, retry_after),) = made_up.published[0].values()
    assert retry_after == 2
    assert message == (
        "model 'm' is over its 200 ms latency target: a request now would wait longer; retry in 2 s"
    )


def test_a_changed_set_or_whole_second_is_published_once() -> None:
    made_up = MadeUp()
    assert made_up.look(m=(0.2, 1.0)) == 1
    assert made_up.look(m=(0.2, 1.0), n=(0.05, 1.0)) == 2  # another model late
    assert made_up.look(m=(0.2, 1.0), n=(0.05, 1.0)) == 2
    assert made_up.look(m=(0.2, 2.5), n=(0.05, 1.0)) == 3  # m's Retry-After: 1 s -> 3 s
    assert made_up.look(m=(0.2, 2.9), n=(0.05, 1.0)) == 3
    assert made_up.look(n=(0.05, 1.0)) == 4  # m on time again
    assert made_up.look() == 5  # nobody late
    assert made_up.look() == 5
    assert [sorted((k, v[1]) for k, v in p.items()) for p in made_up.published] == [
        [("m", 1)],
        [("m", 1), ("n", 1)],
        [("m", 3), ("n", 1)],
        [("n", 1)],
        [],
    ]
    assert made_up.publisher.late == {}  # what a front end attaching now is sent


def test_no_model_with_a_target_left_clears_what_was_published() -> None:
    made_up = MadeUp()
    made_up.look(m=(0.2, 1.0))
    made_up.publisher.models_changed(targeted=False)  # m unloaded: its timer stops
    assert made_up.published[-1] == {} and len(made_up.published) == 2
    made_up.publisher.models_changed(targeted=False)
    assert len(made_up.published) == 2

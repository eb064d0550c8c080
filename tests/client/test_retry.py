"""Retries against a scripted aiohttp server: "not now" answers are retried
with backoff, honouring Retry-After; answers about the request itself are not."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from tensorserve_client import (
    AsyncClient,
    Client,
    InvalidInput,
    ModelFailure,
    RequestTimeout,
    RetryPolicy,
    ServerBusy,
    ServerError,
    TensorServeError,
)

from tests.client.helpers import FAST, Answer, ScriptedServer, error_body

BUSY = Answer(
    503, error_body("model 'm': queue is full", "server_busy"), headers={"Retry-After": "1"}
)


def gaps(server: ScriptedServer) -> list[float]:
    times = [t for t, _ in server.seen]
    return [b - a for a, b in itertools.pairwise(times)]


def test_503_with_retry_after_then_200_succeeds_after_waiting(scripted: ScriptedServer) -> None:
    scripted.answer(BUSY)
    with Client(scripted.url) as client:
        out = client.infer("m", {"x": [1.0]})
    np.testing.assert_array_equal(out["y"], [1.0, 2.0])
    assert len(scripted.seen) == 2
    assert gaps(scripted)[0] >= 1.0  # Retry-After: 1 was honoured


async def test_the_async_twin_retries_the_same_way(scripted: ScriptedServer) -> None:
    scripted.answer(
        Answer(503, error_body("loading", "model_not_ready")),
        Answer(429, b"slow down", content_type="text/plain"),
    )
    async with AsyncClient(scripted.url, retries=FAST) as client:
        out = await client.infer("m", {"x": [1.0]})
    assert out["y"].shape == (2,) and len(scripted.seen) == 3


def test_backoff_grows_between_attempts(scripted: ScriptedServer) -> None:
    scripted.answer(*[Answer(503, b"")] * 3)
    policy = RetryPolicy(retries=3, backoff=0.05, max_backoff=1.0)
    with Client(scripted.url, retries=policy) as client:
        client.infer("m", {"x": [1.0]})
    waits = gaps(scripted)
    assert len(waits) == 3
    assert 0.025 <= waits[0] and 0.05 <= waits[1] and 0.1 <= waits[2]  # >= cap/2 each time


def test_a_dropped_connection_is_retried(scripted: ScriptedServer) -> None:
    scripted.answer(Answer(drop=True))
    with Client(scripted.url, retries=FAST) as client:
        assert client.infer("m", {"x": [1.0]})["y"].shape == (2,)
    assert len(scripted.seen) == 2


@pytest.mark.parametrize(
    "answer, error",
    [
        (Answer(400, error_body("item 0, feature 'x': bad", "invalid_input")), InvalidInput),
        (Answer(500, error_body("model 'm' failed: boom", "model_failure")), ModelFailure),
        (Answer(502, b"<html>bad gateway</html>", content_type="text/html"), ServerError),
    ],
)
def test_answers_about_the_request_are_never_retried(
    scripted: ScriptedServer, answer: Answer, error: type[TensorServeError]
) -> None:
    scripted.answer(answer)
    with Client(scripted.url, retries=FAST) as client, pytest.raises(error) as caught:
        client.infer("m", {"x": [1.0]})
    assert len(scripted.seen) == 1 and caught.value.attempts == 1


def test_when_retries_run_out_the_last_answer_is_raised(scripted: ScriptedServer) -> None:
    scripted.answer(*[Answer(503, error_body("queue is full", "server_busy"))] * 5)
    policy = RetryPolicy(retries=2, backoff=0.001)
    with Client(scripted.url, retries=policy) as client, pytest.raises(ServerBusy) as caught:
        client.infer("m", {"x": [1.0]})
    assert str(caught.value) == "queue is full"
    assert caught.value.attempts == 3 and len(scripted.seen) == 3


def test_retries_stop_at_the_callers_deadline(scripted: ScriptedServer) -> None:
    scripted.answer(BUSY, BUSY)
    with Client(scripted.url) as client:
        started = time.monotonic()
        with pytest.raises(ServerBusy):
            client.infer("m", {"x": [1.0]}, timeout=0.5)  # Retry-After: 1 would outlive it
    assert time.monotonic() - started < 0.9 and len(scripted.seen) == 1


def test_a_slow_answer_is_a_request_timeout_and_not_retried(scripted: ScriptedServer) -> None:
    scripted.answer(Answer(delay=0.6))
    with (
        Client(scripted.url, timeout=0.2, retries=FAST) as client,
        pytest.raises(RequestTimeout, match="no answer within 0.2 s"),
    ):
        client.infer("m", {"x": [1.0]})
    assert len(scripted.seen) == 1

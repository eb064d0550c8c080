"""The soak (benchmarks/soak.py) as a test: a short fault soak, good callers
beside every kind of bad request the model thread can meet, against a real
server; and the one set of request generators both scenarios send."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from tensorserve_bench.soak import faults
from tensorserve_bench.soak.model import KILL, POISON, SLOW
from tensorserve_bench.soak.requests import (
    FAULT_KINDS,
    GOOD_ROWS,
    fault_body,
    good_item,
    malformed_native,
    status_of,
)


@pytest.mark.slow
def test_a_short_fault_soak_fails_no_good_request() -> None:
    result = faults.run("thread", seconds=3.0, callers=4, bad_every_s=0.05)
    # The invariant: no good request lost, hung or failed, with or without the bad ones.
    assert faults.failures(result) == {}
    assert result["without_bad"]["good_correct"] > 0 and result["with_bad"]["good_correct"] > 0
    # Every kind of bad request was sent, and answered as docs/reliability.md says.
    statuses = {kind: set(codes) for kind, codes in result["with_bad"]["bad"].items()}
    assert statuses == {
        "poison": {"500 model_failure"},
        "oom_split": {"200"},  # split from its company, it fits alone
        "oom_alone": {"413 out_of_memory"},
        "deadline": {"504 deadline_exceeded"},
        "disconnect": {"left"},
    }
    assert result["ready_after"] == 200


def _x(body: bytes) -> np.ndarray:
    x = msgpack.unpackb(body)["items"][0]["x"]
    return np.frombuffer(x["data"], np.float32).reshape(x["shape"])


def test_good_items_never_carry_a_marker_and_bad_ones_carry_theirs() -> None:
    rng = random.Random(1)
    for _ in range(200):
        x = good_item(rng)
        assert GOOD_ROWS[0] <= len(x) <= GOOD_ROWS[1] and x.min() >= 20
    first = {kind: _x(fault_body(kind, rng))[0, 0] for kind in FAULT_KINDS}
    assert (first["poison"], first["worker_kill"], first["deadline"]) == (POISON, KILL, SLOW)
    assert _x(fault_body("oom_alone", rng)).size == 8000
    with pytest.raises(ValueError, match="no bad request of kind 'typo'"):
        fault_body("typo", rng)


def test_malformed_bodies_are_reproducible_from_their_seed() -> None:
    assert [malformed_native(random.Random(5)) for _ in range(3)] == [
        malformed_native(random.Random(5)) for _ in range(3)
    ]
    assert status_of(200, b"") == "200"
    assert status_of(413, msgpack.packb({"error": "x", "code": "out_of_memory"})) == "413 out_of_memory"

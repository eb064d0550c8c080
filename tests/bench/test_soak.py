"""The fault soak (benchmarks/soak.py) as a test: a short run of the same
scenario, good callers beside every kind of bad request the model thread
can meet, against a real server."""

from __future__ import annotations

import pytest
from tensorserve_bench import soak


@pytest.mark.slow
def test_a_short_fault_soak_fails_no_good_request() -> None:
    result = soak.run("thread", seconds=3.0, callers=4, bad_every_s=0.05)
    # The invariant: no good request lost, hung or failed, with or without the bad ones.
    assert soak.failures(result) == {}
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

"""Every error code the server sends, provoked on a real server and raised by
the client as the class of its own that the code maps to
(``tensorserve_client.errors.CODES``, held to the server's table by
tests/test_error_codes.py)."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorserve_client as tc
from tensorserve_client import Client, RetryPolicy

from tensorserve import errors
from tests.conftest import ServerProcess
from tests.helpers import ECHO, SLEEPY_IO, wait_until, write_toy_model

# y = 2x; raises for a negative value, a tensorserve error of the server's own
# base class (a bug, as the server sees it) for 7, and out of memory above 1000.
CODES_MODEL = """
    import torch
    from tensorserve.errors import TensorServeError

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x < 0).any():
                raise ValueError("negative input is not allowed")
            if (x == 7).any():
                raise TensorServeError("seven is a bug on purpose")
            if (x > 1000).any():
                raise torch.OutOfMemoryError("this item does not fit on purpose")
            return x * 2
"""
# Marks that a batch has started (a file the test waits for), then sleeps.
SLOW_MODEL = """
    import pathlib
    import time
    import torch

    class Model(torch.nn.Module):
        def forward(self, ms):
            pathlib.Path({marker!r}).touch()
            time.sleep(float(ms.max()) / 1000)
            return ms * 2
"""
NO_RETRIES = RetryPolicy(retries=0)
STATS_KEY = {"X-Stats-Key": "k"}


class Codes:
    def __init__(self, url: str, repository: Path) -> None:
        self.url, self.repository = url, repository
        self.marker = repository / "slow-started"


@pytest.fixture(scope="module")
def codes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Codes]:
    """A default server (model control none) whose statistics API is
    restricted; ``pending`` is copied in after start-up: listed, not ready."""
    repository = tmp_path_factory.mktemp("codes")
    write_toy_model(repository, "coded", CODES_MODEL, **{**ECHO, "max_batch_size": 1})
    write_toy_model(
        repository, "slow", SLOW_MODEL.format(marker=str(repository / "slow-started")),
        **SLEEPY_IO, max_batch_size=1, dynamic_batching={"max_queue_size": 1},
    )  # fmt: skip
    # A latency target no batch can keep: once a few batches are measured,
    # any request with one item queued ahead of it is refused.
    write_toy_model(
        repository, "targeted", SLOW_MODEL.format(marker=str(repository / "targeted-started")),
        **SLEEPY_IO, max_batch_size=1, dynamic_batching={"target_p99_ms": 0.01},
    )  # fmt: skip
    process = ServerProcess(repository, "--restricted-api", "statistics:X-Stats-Key=k")
    shutil.copytree(repository / "coded", repository / "pending")
    yield Codes(process.url, repository)
    process.stop()


def x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 4), value, np.float32)}


def queue_full_and_deadline(codes: Codes, client: Client) -> dict[str, tc.TensorServeError]:
    """One batch running 3 s on ``slow``, one item queued (the queue's one
    place) with a 0.5 s deadline, one more refused: server_busy, then
    deadline_exceeded for the queued one."""
    caught: dict[str, tc.TensorServeError] = {}

    def send(name: str, ms: float, timeout: float | None = None) -> None:
        try:
            client.infer("slow", {"ms": np.array([ms], np.float32)}, timeout=timeout)
        except tc.TensorServeError as exc:
            caught[name] = exc

    running = threading.Thread(target=send, args=("running", 3000.0))
    running.start()
    wait_until(codes.marker.exists, "the slow batch running")
    queued = threading.Thread(target=send, args=("queued", 0.0, 0.5))
    queued.start()
    wait_until(lambda: client.stats("slow")["batching"]["queue_depth"] == 1, "one item queued")
    send("refused", 0.0)
    queued.join(10)
    running.join(10)
    assert "running" not in caught
    return {"server_busy": caught["refused"], "deadline_exceeded": caught["queued"]}


def late_for_target(codes: Codes, client: Client) -> tc.TensorServeError:
    """Four batches measured on ``targeted``, one running 3 s, one item
    queued behind it; one more would be late: would_miss_target."""
    for _ in range(4):
        client.infer("targeted", {"ms": np.array([0.0], np.float32)})
    caught: dict[str, tc.TensorServeError] = {}

    def send(name: str, ms: float) -> None:
        try:
            client.infer("targeted", {"ms": np.array([ms], np.float32)})
        except tc.TensorServeError as exc:
            caught[name] = exc

    marker = codes.repository / "targeted-started"
    marker.unlink(missing_ok=True)
    running = threading.Thread(target=send, args=("running", 3000.0))
    running.start()
    wait_until(marker.exists, "the long batch running")
    queued = threading.Thread(target=send, args=("queued", 0.0))
    queued.start()
    wait_until(lambda: client.stats("targeted")["batching"]["queue_depth"] == 1, "one item queued")
    send("refused", 0.0)
    queued.join(10)
    running.join(10)
    assert "running" not in caught and "queued" not in caught
    return caught["refused"]


# code -> what provokes it through the client.
PROVOKE: dict[str, Callable[[Client], Any]] = {
    "invalid_input": lambda c: c.infer("coded", {"x": np.ones((1, 4), np.int64)}),
    "model_not_found": lambda c: c.infer("nope", x(1.0)),
    # Listing the models finds the folder copied in after start-up: not loaded.
    "model_not_ready": lambda c: (c.models(), c.infer("pending", x(1.0))),
    "request_too_large": lambda c: c.infer_batch("slow", [{"ms": [0.0]}] * 2),
    # Larger than anything that fit: too large, 413. As large as a batch that
    # fit just before: memory is tight for now, 503 (batching/recovery.py).
    "out_of_memory": lambda c: c.infer("coded", {"x": np.full((64, 4), 2000.0, np.float32)}),
    "memory_tight": lambda c: (c.infer("coded", x(1.0)), c.infer("coded", x(2000.0))),
    "model_failure": lambda c: c.infer("coded", x(-1.0)),
    "internal": lambda c: c.infer("coded", x(7.0)),
    "model_control_disabled": lambda c: c.unload("coded"),
    "api_restricted": lambda c: c.stats("coded"),
}


def test_every_code_the_server_sends_is_provoked_here() -> None:
    assert set(PROVOKE) | {"server_busy", "deadline_exceeded", "would_miss_target"} == set(
        errors.CODES
    )


@pytest.mark.parametrize("code", sorted(PROVOKE))
def test_the_client_raises_each_codes_own_class(codes: Codes, code: str) -> None:
    status, cls = tc.errors.CODES[code]
    with Client(codes.url, retries=NO_RETRIES) as client, pytest.raises(cls) as caught:
        PROVOKE[code](client)
    assert type(caught.value) is cls
    assert (caught.value.status, caught.value.code) == (status, code)


def test_a_full_queue_and_a_late_item_raise_their_own_classes(codes: Codes) -> None:
    with Client(codes.url, retries=NO_RETRIES, headers=STATS_KEY) as client:
        caught = queue_full_and_deadline(codes, client)
        caught["would_miss_target"] = late_for_target(codes, client)
    for code, error in caught.items():
        status, cls = tc.errors.CODES[code]
        assert type(error) is cls, error
        assert (error.status, error.code) == (status, code)


def test_the_restricted_api_answers_the_client_that_sends_its_header(codes: Codes) -> None:
    with Client(codes.url, headers=STATS_KEY) as client:
        assert client.stats("coded")["name"] == "coded"
    with Client(codes.url) as client:
        with pytest.raises(tc.ApiRestricted, match="the statistics API is restricted"):
            client.stats("coded")
        # Refused by the server's settings: the model still serves.
        with pytest.raises(tc.ModelControlDisabled, match="cannot unload model 'coded'"):
            client.unload("coded")
        np.testing.assert_array_equal(client.infer("coded", x(1.0))["y"], np.full((1, 4), 2.0))

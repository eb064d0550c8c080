"""Liveness (serving/liveness.py): a model thread stuck for good in a forward
makes ``/v2/health/live`` answer 503, so the orchestrator restarts the pod; a
hung worker process is killed and replaced, and the server stays live."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tensorserve_bench.server import ServerProcess as BareServer

from tensorserve import ServedModel
from tensorserve.errors import ModelFailure
from tensorserve.serving.liveness import Liveness
from tensorserve.serving.registry import ModelEntry, ModelRegistry, ModelState
from tests.conftest import ServerProcess
from tests.helpers import ECHO, MSGPACK, HangOn, body, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(180)

# Value 99 never comes back from the forward (a deadlock in model code, a
# device that stopped answering); any other value is doubled.
HANGS = """
    import threading, torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 99).any():
                threading.Event().wait()
            return x * 2
"""
X_IN = [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0}]
Y_OUT = [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}]


def _infer(url: str, model: str, value: float) -> int:
    item = {"x": np.full((3, 4), value, np.float32)}
    reply = httpx.post(f"{url}/v2/models/{model}/infer", content=body([item]), headers=MSGPACK,
                       timeout=60)
    return reply.status_code


# ---------------------------------------------------------------------- in process
def test_an_instance_is_stuck_while_a_forward_the_watchdog_gave_up_on_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fn = HangOn(99.0)
    entered, release = fn.entered, fn.release
    model = ServedModel.from_function(
        fn, inputs=X_IN, outputs=Y_OUT, max_batch_size=8, faults={"watchdog_ms": 200}
    )
    registry = ModelRegistry(tmp_path)
    registry.entries["m"] = ModelEntry("m", ModelState.READY, served=model)
    liveness, never = Liveness(registry, stall_s=0.5), Liveness(registry, stall_s=0)
    with model:
        hung = model.submit_many([{"x": np.full(3, 99.0, np.float32)}])[0]
        assert entered.wait(10)
        assert model.stuck_instances() == []  # running, but the watchdog still waits
        with pytest.raises(ModelFailure):
            hung.result(10)
        assert [i for i, _ in model.stuck_instances()] == [0]
        with caplog.at_level(logging.ERROR, logger="tensorserve.serving.liveness"):
            wait_until(lambda: bool(liveness.wedged()), "stuck past the 0.5 s limit")
            assert liveness.wedged()[0].instance == 0 and liveness.wedged()[0].stalled_s > 0.5
        logged = [r.getMessage() for r in caplog.records if r.name.endswith("liveness")]
        assert len(logged) == 1 and logged[0].startswith("liveness fails: model 'm' instance 0")
        assert never.wedged() == []  # 0: liveness never fails
        release.set()  # the forward comes back after all: not stuck any more
        wait_until(lambda: model.stuck_instances() == [], "the instance freed")
        assert liveness.wedged() == []


# ---------------------------------------------------------------------- a real server
def test_a_model_thread_stuck_for_good_makes_the_server_not_live(tmp_path: Path) -> None:
    write_toy_model(tmp_path, "hangs", HANGS, **{**ECHO, "faults": {"watchdog_ms": 300}})
    log = tmp_path / "server.log"
    args = ["--liveness-stall-s", "1", "--shutdown-grace-s", "1"]
    server = BareServer(str(tmp_path), args, log=log).start()
    url = server.url
    try:
        assert httpx.get(f"{url}/v2/health/live").json() == {"live": True}
        assert _infer(url, "hangs", 99.0) == 500  # the watchdog answered the caller
        wait_until(lambda: httpx.get(f"{url}/v2/health/live").status_code == 503,
                   "liveness 503 once the thread is stuck past 1 s", 30)
        reply = httpx.get(f"{url}/v2/health/live").json()
        assert reply["live"] is False
        assert reply["reason"].startswith("model 'hangs' instance 0 has been stuck in a forward")
        [wedged] = reply["wedged"]
        assert (wedged["model"], wedged["version"], wedged["instance"]) == ("hangs", "1", 0)
        assert wedged["stalled_s"] >= 1  # rounded to 0.1 s
        metrics = httpx.get(f"{url}/metrics").text
        assert 'tensorserve_instance_wedged_seconds{instance="0",model="hangs",version="1"}' \
            in metrics
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503
        lines = [line for line in log.read_text().splitlines() if "liveness fails" in line]
        assert len(lines) == 1 and "model 'hangs' instance 0" in lines[0]  # once, not per probe
    finally:
        server.stop(grace=5)


def test_a_hung_worker_process_is_replaced_and_the_server_stays_live(tmp_path: Path) -> None:
    # The watchdog (1.5 s) kills the worker after the liveness limit (0.5 s)
    # has passed: still live, as the instance is replaced, not stuck.
    write_toy_model(tmp_path, "hangs", HANGS, **{**ECHO, "isolation": "process",
                                                 "faults": {"watchdog_ms": 1500}})
    server = ServerProcess(tmp_path, "--liveness-stall-s", "0.5")
    url = server.url
    try:
        sent = time.monotonic()
        assert _infer(url, "hangs", 99.0) == 500
        assert time.monotonic() - sent > 0.5
        live = httpx.get(f"{url}/v2/health/live")
        assert (live.status_code, live.json()) == (200, {"live": True})
        assert "tensorserve_instance_wedged_seconds{" not in httpx.get(f"{url}/metrics").text
        wait_until(lambda: _infer(url, "hangs", 2.0) == 200, "a replaced worker serves", 60)
        assert httpx.get(f"{url}/v2/health/live").status_code == 200
    finally:
        server.stop()

"""One worker template and one spare worker for every process-isolated model
of the process (runtime/shared_workers.py): models fork from the same
template and a crash of any of them swaps in the one spare; a model whose
code fails to load in the template fails alone; a dead template is replaced
for the next model while the others still recover from crashes; a template
spawned ahead of the models (``prestart``) is used by them, or stopped."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tensorserve import ServedModel
from tensorserve.errors import ConfigError
from tensorserve.runtime import shared_workers
from tests.helpers import ECHO, wait_until, write_toy_model

pytestmark = pytest.mark.timeout(180)

# y = 2x (the doubler) or y = 3x (the tripler).
MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * {factor}
"""
BROKEN = """
    raise RuntimeError("this model.py cannot be imported")
"""


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for name, factor in (("doubler", 2), ("tripler", 3)):
        write_toy_model(tmp_path, name, MODEL.format(factor=factor), **ECHO, isolation="process")
    write_toy_model(tmp_path, "broken", BROKEN, **ECHO, isolation="process")
    return tmp_path


def _y(model: ServedModel, value: float) -> float:
    return float(model.infer_sync({"x": np.full((3, 4), value, np.float32)})["y"][0, 0])


def _worker(model: ServedModel) -> int | None:
    return model.executor.workers[0].pid  # type: ignore[attr-defined,no-any-return]


def _kill(model: ServedModel) -> int:
    """SIGKILL the model's idle worker (after a batch: the scheduler watches
    a worker's socket from its first batch on); wait until it is replaced
    (at once, idle too): the new worker's pid."""
    _y(model, 1.0)
    old = _worker(model)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: _worker(model) not in (None, old) and model.health() is None,
               "the worker replaced", 60)
    new = _worker(model)
    assert new is not None
    return new


def _spare(model: ServedModel) -> int | None:
    ready = model.executor.standby.ready  # type: ignore[attr-defined]
    return ready.pid if ready is not None else None


def test_models_share_one_template_and_one_spare_that_any_crash_takes(repository: Path) -> None:
    with (
        ServedModel.from_repository(repository, "doubler") as doubler,
        ServedModel.from_repository(repository, "tripler") as tripler,
    ):
        template = doubler.executor.template  # type: ignore[attr-defined]
        assert tripler.executor.template is template  # type: ignore[attr-defined]
        workers = [_worker(m) for m in (doubler, tripler)]
        assert [psutil.Process(pid).ppid() for pid in workers] == [template.pid] * 2
        wait_until(lambda: _spare(doubler) == _spare(tripler) is not None,
                   "one spare for both forked", 60)
        spare = _spare(doubler)
        assert spare is not None and psutil.Process(spare).ppid() == template.pid
        process = psutil.Process(template.pid)

        assert _kill(tripler) == spare  # a swap
        assert _y(tripler, 2.0) == 6.0  # the spare now runs the tripler
        wait_until(lambda: _spare(doubler) not in (None, spare), "a new spare forked", 60)
        second = _spare(doubler)
        assert _kill(doubler) == second
        assert (_y(doubler, 2.0), _y(tripler, 2.0)) == (4.0, 6.0)
        assert doubler.executor.restarts == 1 and tripler.executor.restarts == 1  # type: ignore[attr-defined]
    # The last model closed: the template, its workers and the spare are gone.
    _, alive = psutil.wait_procs([process], timeout=10)
    assert not alive and template.pid is None


def test_a_model_that_cannot_load_fails_alone_and_the_template_serves_on(repository: Path) -> None:
    with ServedModel.from_repository(repository, "doubler") as doubler:
        template = doubler.executor.template  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match="this model.py cannot be imported"):
            ServedModel.from_repository(repository, "broken")
        assert template.alive
        assert psutil.Process(_kill(doubler)).ppid() == template.pid  # still its fork
        assert _y(doubler, 5.0) == 10.0


def test_a_dead_template_is_replaced_and_its_models_still_recover(repository: Path) -> None:
    with ServedModel.from_repository(repository, "doubler") as doubler:
        old = doubler.executor.template  # type: ignore[attr-defined]
        wait_until(lambda: _spare(doubler) is not None, "the spare forked", 60)
        psutil.Process(old.pid).kill()
        wait_until(lambda: not old.alive, "the template dead", 10)
        with ServedModel.from_repository(repository, "tripler") as tripler:
            new = tripler.executor.template  # type: ignore[attr-defined]
            assert new is not old and new.alive
            assert _y(tripler, 1.0) == 3.0
        spare = _spare(doubler)
        assert _kill(doubler) == spare  # forked before its template died, it takes over
        assert _y(doubler, 1.0) == 2.0
        spawned = _kill(doubler)  # no template to fork from: a worker is spawned afresh
        assert psutil.Process(spawned).ppid() == os.getpid()
        assert _y(doubler, 3.0) == 6.0


def test_a_prestarted_template_is_taken_by_the_first_model_or_stopped(repository: Path) -> None:
    shared_workers.prestart("WARNING")
    unused = shared_workers._HOLDER.current
    assert unused is not None
    shared_workers.end_prestart()  # no model took it
    assert not unused.template.alive and shared_workers._HOLDER.current is None

    shared_workers.prestart("WARNING")
    prestarted = shared_workers._HOLDER.current
    assert prestarted is not None
    try:
        with ServedModel.from_repository(repository, "doubler") as doubler:
            assert doubler.executor.template is prestarted.template  # type: ignore[attr-defined]
            shared_workers.end_prestart()
            assert prestarted.template.alive  # the model holds it
            assert _y(doubler, 1.0) == 2.0
    finally:
        shared_workers.end_prestart()
    assert not prestarted.template.alive  # the last model closed


def test_a_crash_takes_the_ready_spare_without_waiting_for_a_fork_in_progress(
    repository: Path,
) -> None:
    """A refill may wait behind another model's load in the template (seconds);
    a spare that is up and serves the crashed model is taken at once."""
    with ServedModel.from_repository(repository, "doubler") as doubler:
        wait_until(lambda: _spare(doubler) is not None, "the spare forked", 60)
        spare, ready = doubler.executor.shared.spare, _spare(doubler)  # type: ignore[attr-defined]
        loading = threading.Event()
        stuck = threading.Thread(target=loading.wait, args=(60,), daemon=True)
        stuck.start()
        spare._thread = stuck  # a refill held up by a load
        try:
            started = time.monotonic()
            assert _kill(doubler) == ready
            assert time.monotonic() - started < 30, "the swap waited for the stuck fork"
        finally:
            loading.set()
            stuck.join()
            with spare._lock:
                spare._thread = None
            spare.refill()
        wait_until(lambda: _spare(doubler) not in (None, ready), "a new spare forked", 60)

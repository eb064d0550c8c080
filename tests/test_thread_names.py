"""The server's threads carry their Python names into the OS (Linux's comm),
so that top -H, /proc and benchmarks/gpu_fill.py's busiest threads can tell a
model's launch thread from the event loop or a pool's thread."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tensorserve.host import name_native_thread, native_thread_name
from tensorserve.pools import request_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's comm")


def _comm(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


@pytest.mark.parametrize(
    ("python_name", "native"),
    [
        ("tagger-instance-0", "tagger/0"),
        ("tagger-instance-0-collect", "tagger/0c"),
        ("tensorserve-request_0", "ts-request_0"),
        ("a_model_with_a_long_name-instance-3", "a_model_with_a_"),  # 15 bytes
    ],
)
def test_a_python_name_is_cut_to_what_the_os_keeps(python_name: str, native: str) -> None:
    assert native_thread_name(python_name) == native


def test_a_thread_that_names_itself_shows_the_name_in_proc() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        name_native_thread()
        seen["comm"] = _comm(threading.get_native_id())

    thread = threading.Thread(target=run, name="tagger-instance-1-collect")
    thread.start()
    thread.join(10)
    assert seen["comm"] == "tagger/1c"


def test_a_pools_threads_and_a_models_instance_threads_are_named(tmp_path: Path) -> None:
    assert (
        request_pool()
        .submit(lambda: _comm(threading.get_native_id()))
        .result(10)
        .startswith("ts-request")
    )
    from tensorserve import ServedModel

    names: list[str] = []

    def recording(x: object) -> object:
        names.append(_comm(threading.get_native_id()))
        return x * 2  # type: ignore[operator]

    with ServedModel.from_function(
        recording,
        inputs=[{"name": "x", "dtype": "float32", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
        name="dbl",
        max_batch_size=4,
    ) as model:
        out = model.submit_many([{"x": np.ones(3, np.float32)}])[0].result(30)
    assert out["y"].tolist() == [2.0, 2.0, 2.0]
    assert names and names[0].startswith("dbl/")

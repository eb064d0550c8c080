"""Small helpers shared by the tests: native-protocol encoding and temporary
model repositories with toy models."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

# A model folder from config.toml text and model.py (no weights): the
# benchmarks' writer. Prefer ``write_toy_model``; ``write_model`` is for a
# config's text that ``toy_config`` cannot write (invalid TOML).
from tensorserve_bench.repositories import write_model

MSGPACK = {"Content-Type": "application/msgpack"}


def tensor(array: np.ndarray) -> dict[str, Any]:
    return {"dtype": array.dtype.name, "shape": list(array.shape), "data": array.tobytes()}


def from_wire(t: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(t["data"], dtype=t["dtype"]).reshape(t["shape"])


def body(items: list[dict[str, Any]], **extra: Any) -> bytes:
    wire_items = [
        {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in item.items()}
        for item in items
    ]
    return msgpack.packb({"items": wire_items, **extra})


def token_item(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "input_ids": rng.integers(1, 4096, size=length, dtype=np.int64),
        "attention_mask": np.ones(length, dtype=np.int64),
    }


def wait_until(
    condition: Callable[[], bool], what: str, timeout: float = 10.0, poll: float = 0.01
) -> None:
    """The one way a test waits: poll ``condition`` (a public signal: a
    model's ``health()``, its stats, ``Batcher.queue_depth``, a server's
    endpoint) until it holds; fail the test, saying ``what`` never happened,
    after ``timeout`` seconds. Where the test can hold an event (``Gate``),
    wait on that instead; on an event loop, use ``wait_until_async``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(poll)


async def wait_until_async(
    condition: Callable[[], bool], what: str, timeout: float = 10.0, poll: float = 0.005
) -> None:
    """``wait_until`` on an event loop: the loop runs between looks (the
    condition may wait on a task of its own)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(poll)


class Gate:
    """A batch function that blocks until released, so a queue builds up:
    ``entered`` is set when a batch reaches the model (the instance is busy),
    ``seen`` has the first value of every row it ran, in order."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen: list[float] = []
        self.timeout = timeout

    def __call__(self, x: Any) -> Any:
        self.entered.set()
        self.release.wait(self.timeout)
        self.seen.extend(float(row[0]) for row in x)
        return x

    def wait_entered(self) -> None:
        assert self.entered.wait(10), "a batch reached the model within 10 s"


class HangOn:
    """A batch function (y = 2x) whose batch holding ``value`` blocks until
    ``release`` is set: a forward stuck for the watchdog and liveness to see.
    ``entered`` is set when that batch reaches the model."""

    def __init__(self, value: float = 99.0, timeout: float = 30.0) -> None:
        self.value, self.timeout = value, timeout
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, x: Any) -> Any:
        if (x == self.value).any():
            self.entered.set()
            self.release.wait(self.timeout)
        return x * 2


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {value!r}")


def toy_config(
    inputs: Mapping[str, Mapping[str, Any]],
    outputs: Mapping[str, Mapping[str, Any]],
    **fields: Any,
) -> str:
    """The text of a toy model's config.toml. ``inputs`` and ``outputs`` map
    each tensor's name to its fields (``{"x": {"dtype": "float32", "shape":
    [-1, 4]}}``); every other keyword is a top-level field (``max_batch_size``,
    ``device``, ``isolation``, ...), a mapping becoming its table
    (``dynamic_batching={"max_queue_delay_ms": 2.0}``, ``warmup=...``,
    ``parameters=...``). A field given as None is left out, so the schema's
    default applies. Nothing is validated: tests of bad configs write them
    with this too.

    A toy model runs in a model thread unless the test says otherwise: the
    default ``isolation = "auto"`` would start a worker process for each one
    on a machine of 2 CPUs, doubling the suite's time. Tests of process
    isolation pass ``isolation="process"``; tests of the default pass
    ``isolation=None``."""
    fields = {"isolation": "thread", **fields}
    fields = {k: v for k, v in fields.items() if v is not None}
    lines = [f"{k} = {_toml(v)}" for k, v in fields.items() if not isinstance(v, Mapping)]
    for table, values in fields.items():
        if isinstance(values, Mapping):
            lines += [f"[{table}]", *(f"{k} = {_toml(v)}" for k, v in values.items())]
    for kind, specs in (("input", inputs), ("output", outputs)):
        for name, spec in specs.items():
            lines += [f"[[{kind}]]", f"name = {_toml(name)}"]
            lines += [f"{k} = {_toml(v)}" for k, v in spec.items()]
    return "\n".join(lines) + "\n"


def write_toy_model(repo: Path, name: str, model_py: str, version: int = 1, **config: Any) -> Path:
    """A toy model in a temporary repository: ``model.py`` (dedented) and the
    config.toml that ``toy_config(**config)`` writes."""
    return write_model(repo, name, toy_config(**config), model_py, version)


# y = f(x), x and y float32 of shape [-1, 4], batches of up to 8 (with POISON_MODEL).
ECHO: dict[str, Any] = {
    "max_batch_size": 8,
    "dynamic_batching": {"max_queue_delay_ms": 2.0},
    "inputs": {"x": {"dtype": "float32", "shape": [-1, 4]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1, 4]}},
}

# Raises for any batch holding the value 13: a "poison" item.
POISON_MODEL = """
    import torch

    class Model(torch.nn.Module):
        def forward(self, x):
            if (x == 13).any():
                raise RuntimeError("poison value 13 in batch")
            return x * 2
"""

# Sleeps as many milliseconds as the batch's largest value of ``ms``: a model
# whose cost the test chooses, per item. SLEEPY_IO: its inputs and outputs.
SLEEPY_MODEL = """
    import time
    import torch

    class Model(torch.nn.Module):
        def forward(self, ms):
            time.sleep(float(ms.max()) / 1000)
            return ms * 2
"""
SLEEPY_IO: dict[str, Any] = {
    "inputs": {"ms": {"dtype": "float32", "shape": [-1]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
    "warmup": {"enabled": False},
}


# A model a test holds from outside its server's process: every batch appends
# its rows' first values to SEEN; a batch holding the value 7 creates
# GATE + ".entered" and then waits (30 s at most) until GATE exists, so the
# instance is busy and the callers behind it queue up. x, y: float32 [-1, 4].
FILE_GATED_MODEL = """
    import os, time
    import torch

    GATE, SEEN = {gate!r}, {seen!r}

    class Model(torch.nn.Module):
        def forward(self, x):
            with open(SEEN, "a") as log:
                log.write("".join(f"{{float(v)}}\\n" for v in x[:, 0, 0].tolist()))
            if (x == 7).any():
                open(GATE + ".entered", "w").close()
                deadline = time.monotonic() + 30
                while not os.path.exists(GATE) and time.monotonic() < deadline:
                    time.sleep(0.01)
            return x * 2
"""


class FileGate:
    """The files through which a test holds ``FILE_GATED_MODEL``."""

    def __init__(self, folder: Path) -> None:
        self.gate, self.seen = folder / "gate", folder / "seen"
        self.entered = folder / "gate.entered"

    def model(self) -> str:
        return FILE_GATED_MODEL.format(gate=str(self.gate), seen=str(self.seen))

    def wait_entered(self) -> None:
        wait_until(self.entered.exists, "the held batch in the model", timeout=30)

    def open(self) -> None:
        self.gate.touch()

    def close(self) -> None:
        self.gate.unlink(missing_ok=True)
        self.entered.unlink(missing_ok=True)

    def seen_values(self) -> list[float]:
        return [float(v) for v in self.seen.read_text().split()] if self.seen.exists() else []


def build_server_wheel(folder: Path, root: Path, timeout: float = 600) -> Path:
    """The server's wheel, built as the Dockerfile builds it: from a copy of
    what it copies (pyproject.toml, README.md, tensorserve/), so the build
    leaves nothing (build/, *.egg-info) in the checkout."""
    import shutil
    import subprocess
    import sys

    source = folder / "source"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    shutil.copytree(
        root / "tensorserve",
        source / "tensorserve",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    wheels = folder / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(source)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = wheels.glob("tensorserve-*.whl")
    return wheel


# --------------------------------------------- batches sent to a worker that dies
class _RunningProcess:
    """A worker's process that never exits: the tests replace its death report."""

    pid = 123456789
    returncode = None

    def poll(self) -> None:
        return None


def answers_of_a_dead_worker(hello: dict[str, Any], batches: int = 3) -> list[list[Any]]:
    """Each answer ``batches`` one-batch callers got when the worker they were
    sent to died with all of them sent (its socket closed): a list per caller,
    so that a second answer to one caller shows. ``Lost.report`` is the test's."""
    import socket

    from tensorserve.ipc import messages as ipc
    from tensorserve.runtime.worker_process import WorkerProcess

    async def run() -> list[list[Any]]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        worker = WorkerProcess(hello, "model 'm' instance 0")
        worker.process, worker.sock, worker.generation = _RunningProcess(), ours, 1  # type: ignore[assignment]
        answers: list[list[Any]] = [[] for _ in range(batches)]
        all_in = asyncio.Event()

        def on_reply(i: int) -> Any:
            def got(message: ipc.Message | None, error: BaseException | None) -> None:
                answers[i].append(error)
                if all(answers):
                    all_in.set()

            return got

        for i in range(batches):
            worker.dispatch({"x": np.zeros((2, 4), np.float32)}, None, on_reply(i), loop)
        theirs.close()  # the worker died with every batch sent to it
        await asyncio.wait_for(all_in.wait(), 10)
        await asyncio.sleep(0.1)  # a second answer would come in the same callback
        return answers

    return asyncio.run(run())


def front_ends(server: Any) -> list[Any]:
    """The server's front-end processes (psutil.Process; none in one process)."""
    import psutil

    assert server.process is not None
    return [
        child
        for child in psutil.Process(server.process.pid).children()
        if "tensorserve.frontends.process" in " ".join(child.cmdline())
    ]

"""Every request the soak sends: good items (``y = 2x`` is checked), the bad
requests that reach the model (``FAULT_KINDS``) and the bodies the server
must refuse before any model sees them (malformed native and KServe v2
bodies, oversized ones). Generators take a ``random.Random``: a caller's
seed replays its stream."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import numpy as np

from tensorserve_bench.protocols import decode_error, msgpack_body
from tensorserve_bench.soak.model import KILL, MAX_BATCH_SIZE, MEMORY_ELEMENTS, POISON, SLOW

MSGPACK = "application/msgpack"
DTYPES = {"x": "float32"}
# A full batch of good items pads to at most 16 x 32 x 4 = 2048 elements: it fits.
GOOD_ROWS = (4, 32)
assert MAX_BATCH_SIZE * GOOD_ROWS[1] * 4 <= MEMORY_ELEMENTS
# The bad requests that reach the model, and what each tests.
FAULT_KINDS = {
    "poison": "the model raises on the item: its caller's 500, the batch's others re-run",
    "oom_split": "out of memory padded with company, fits alone (800 x 4 = 3200 elements)",
    "oom_alone": "out of memory even alone (2000 x 4 = 8000 elements): 413",
    "deadline": "a 5 ms deadline on an item the model takes 20 ms for: 504",
    "disconnect": "sent, then the caller leaves before the answer",
    "worker_kill": "kills its worker process (process isolation only)",
}
THREAD_KINDS = tuple(kind for kind in FAULT_KINDS if kind != "worker_kill")


def rows(rng: random.Random, count: int) -> np.ndarray:
    """``count`` rows of 4 floats in [20, 100): never a marker value."""
    return (
        np.random.default_rng(rng.getrandbits(64)).uniform(20, 100, (count, 4)).astype(np.float32)
    )


def good_item(rng: random.Random) -> np.ndarray:
    return rows(rng, rng.randint(*GOOD_ROWS))


def good_body(x: np.ndarray, **parameters: Any) -> bytes:
    """The native body of one item ``x`` (``parameters``: ``timeout_ms``, ...)."""
    return msgpack_body([{"x": x}], DTYPES, parameters=parameters or None)


def fault_body(kind: str, rng: random.Random) -> bytes:
    """The body of a bad request of ``kind`` (a key of ``FAULT_KINDS``)."""
    x = rows(rng, 8)
    parameters = None
    if kind == "poison":
        x[0, 0] = POISON
    elif kind == "worker_kill":
        x[0, 0] = KILL
    elif kind == "oom_split":
        x = rows(rng, 800)
    elif kind == "oom_alone":
        x = rows(rng, 2000)
    elif kind == "deadline":
        x[0, 0] = SLOW
        parameters = {"timeout_ms": 5}
    elif kind != "disconnect":
        raise ValueError(f"no bad request of kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    return msgpack_body([{"x": x}], DTYPES, parameters=parameters)


def malformed_native(rng: random.Random) -> bytes:
    """A plausible native body with one thing wrong (or not msgpack at all)."""
    x = [[1.0, 2.0, 3.0, 4.0]]
    not_a_timeout: list[Any] = [True, -1, 0, 2**63, 1e300, float("nan"), float("inf"), "5", [5]]
    not_an_id: list[Any] = [True, 5, [], {}, b"id"]
    typed = {"dtype": "float32", "shape": [1, 4], "data": np.ones((1, 4), np.float32).tobytes()}
    junk: list[Any] = [
        None, True, -1, 2**63, 1e300, float("nan"), float("inf"), "x", [], {}, ["float32"],
        {"float32": 1}, [[1, 2], [3]], b"\x00" * 7,
    ]  # fmt: skip
    variants: list[Any] = [
        {"items": rng.choice(junk)},
        {"items": [rng.choice(junk)]},
        {"items": [{"x": rng.choice(junk)}]},
        {"items": [{"x": {**typed, "dtype": rng.choice(junk)}}]},
        {"items": [{"x": {**typed, "shape": rng.choice(junk)}}]},
        {"items": [{"x": {**typed, "shape": [rng.randint(0, 2**40), 4]}}]},
        {"items": [{"x": {**typed, "data": rng.choice(junk)}}]},
        {"items": [{"x": x, "extra": x}]},
        {"items": [{"x": [[1, 2, 3, 4, 5]]}]},
        {"items": [{"x": x}], "parameters": {"timeout_ms": rng.choice(not_a_timeout)}},
        {"items": [{"x": x}], "id": rng.choice(not_an_id)},
        rng.choice(junk),
    ]
    if rng.random() < 0.1:
        return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    return msgpack.packb(rng.choice(variants))


def malformed_oip(rng: random.Random) -> bytes:
    """A KServe v2 JSON body with one thing wrong."""
    junk: list[Any] = [None, True, -1, 1e300, "FP32 ", [], {}, ["FP32"], {"FP32": 1}, [[1], [2, 3]]]
    good = {"name": "x", "datatype": "FP32", "shape": [1, 1, 4], "data": [1, 2, 3, 4]}
    key = rng.choice(["name", "datatype", "shape", "data"])
    variants: list[Any] = [
        {"inputs": [{**good, key: rng.choice(junk)}]},
        {"inputs": rng.choice(junk)},
        {"inputs": [good], "parameters": {"timeout": rng.choice(junk[1:])}},
        {"inputs": [good], "outputs": [{"name": rng.choice(junk)}]},
    ]
    return json.dumps(rng.choice(variants)).encode()


def status_of(status: int, body: bytes) -> str:
    """``"200"``, or the status and the server's error code: ``"413 out_of_memory"``."""
    code = (decode_error(body) or {}).get("code", "") if status != 200 else ""
    return f"{status} {code}".strip()


def answered_correctly(body: bytes, x: np.ndarray) -> bool:
    """Whether a 200's body holds ``2x``, with ``x``'s own rows and shape."""
    output = msgpack.unpackb(body)["outputs"][0]["y"]
    y = np.frombuffer(output["data"], np.float32).reshape(output["shape"])
    return y.shape == x.shape and np.array_equal(y, x * 2)

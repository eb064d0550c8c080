"""``Client("grpc://...")`` and ``AsyncClient("grpc://...")`` against a real
server: the same calls over HTTP (native msgpack) and gRPC (KServe v2) give
equal results and raise the same error classes; a client-side timeout is
``RequestTimeout`` on both; the server's retry-after is waited for; grpcio
is needed only for grpc:// URLs; the client's copy of the stubs is the
server's."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tensorserve_client import (
    AsyncClient,
    Client,
    InvalidInput,
    ModelControlDisabled,
    ModelNotFound,
    RequestTimeout,
    RetryPolicy,
    ServerBusy,
    TensorServeError,
)

from tests.conftest import ROOT, ServerProcess
from tests.helpers import ECHO, FileGate, wait_until, write_toy_model

NO_RETRY = RetryPolicy(retries=0)


def grpc_url(server: ServerProcess) -> str:
    return f"grpc://{server.grpc_address}"


def token_items(lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"input_ids": rng.integers(1, 4096, n), "attention_mask": np.ones(n, np.int64)}
        for n in lengths
    ]


def assert_same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert sorted(x) == sorted(y) and x.parameters == pytest.approx(y.parameters)
        for name in x:
            assert x[name].shape == y[name].shape and x[name].dtype == y[name].dtype
            np.testing.assert_allclose(x[name], y[name], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def twins(server: ServerProcess) -> Iterator[tuple[Client, Client]]:
    with Client(server.url, retries=NO_RETRY) as http, \
            Client(grpc_url(server), retries=NO_RETRY) as grpc:
        yield http, grpc


# ---------------------------------------------------------------------- equal results
def test_variable_length_items_give_equal_results(twins: tuple[Client, Client]) -> None:
    http, grpc = twins
    # Lengths repeat, so gRPC sends some items as rows of one request.
    items = token_items([3, 11, 7, 3, 11, 1, 3])
    grpc_rows = grpc.infer_batch("tagger", items)
    assert [r["logits"].shape for r in grpc_rows] == [(n, 9) for n in (3, 11, 7, 3, 11, 1, 3)]
    assert_same(http.infer_batch("tagger", items), grpc_rows)
    # Plain lists (cast to the declared int64), a model's parameters and its
    # per-item output parameters.
    listed = [{"input_ids": [7, 8, 9], "attention_mask": [1, 1, 1]},
              {"input_ids": [5, 6], "attention_mask": [1, 1]}]
    raw = {"normalize": False}
    assert_same(http.infer_batch("embedder", listed, parameters=raw),
                grpc.infer_batch("embedder", listed, parameters=raw))
    assert grpc.infer("embedder", listed[0], parameters=raw).parameters["norm"] > 1.0
    assert_same([http.infer("tagger", items[2], timeout=30)],
                [grpc.infer("tagger", items[2], timeout=30)])


def test_server_and_model_calls_agree(twins: tuple[Client, Client]) -> None:
    http, grpc = twins
    assert grpc.ready() and grpc.ready("tagger")
    assert grpc.models() == http.models()
    metadata = grpc.metadata("tagger")
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [
        (t["name"], t["datatype"], t["shape"]) for t in http.metadata("tagger")["inputs"]
    ]
    before = grpc.stats("tagger")["model_stats"][0]["inference_count"]
    grpc.infer_batch("tagger", token_items([4, 4, 9]))
    assert grpc.stats("tagger")["model_stats"][0]["inference_count"] == before + 3


async def test_concurrent_async_callers_get_what_http_gives(server: ServerProcess) -> None:
    sent = [token_items([2 + i, 2 + i, 5 + 3 * i], seed=i) for i in range(8)]
    async with AsyncClient(server.url) as http, AsyncClient(grpc_url(server)) as grpc:
        over_grpc = await asyncio.gather(*(grpc.infer_batch("tagger", items) for items in sent))
        over_http = await asyncio.gather(*(http.infer_batch("tagger", items) for items in sent))
        for a, b in zip(over_http, over_grpc):
            assert_same(a, b)
        stream = [item for items in sent for item in items]
        mapped = [r async for r in grpc.map("tagger", stream, batch_size=5, concurrency=3)]
        assert_same([r for rows in over_http for r in rows], mapped)


# ---------------------------------------------------------------------- errors
ERRORS: dict[str, tuple[type[TensorServeError], Callable[[Client], Any]]] = {
    "unknown model": (ModelNotFound, lambda c: c.infer("nope", {"x": [1.0]})),
    "wrong dtype": (InvalidInput, lambda c: c.infer("tagger", {
        "input_ids": np.arange(1, 4, dtype=np.int32), "attention_mask": np.ones(3, np.int64)})),
    "a float in an int list": (InvalidInput, lambda c: c.infer(
        "tagger", {"input_ids": [1.5, 2.0], "attention_mask": [1, 1]})),
    "a bad parameter": (InvalidInput, lambda c: c.infer(
        "embedder", {"input_ids": [7], "attention_mask": [1]}, parameters={"normalize": "yes"})),
    "a missing input": (InvalidInput, lambda c: c.infer("tagger", {"input_ids": [1, 2]})),
    "model control off": (ModelControlDisabled, lambda c: c.load("tagger")),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_the_same_classes(twins: tuple[Client, Client], case: str) -> None:
    expected, call = ERRORS[case]
    caught = []
    for client in twins:
        with pytest.raises(expected) as error:
            call(client)
        caught.append(error.value)
    http_error, grpc_error = caught
    assert type(grpc_error) is type(http_error)
    assert (grpc_error.code, grpc_error.status) == (http_error.code, http_error.status)


def test_grpc_without_grpcio_is_one_line_saying_what_to_install() -> None:
    script = (
        "import sys; sys.modules['grpc'] = None\n"
        "from tensorserve_client import Client\n"
        "Client('http://127.0.0.1:1').close()  # HTTP needs no grpcio\n"
        "Client('grpc://127.0.0.1:1')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: grpc:// URLs need grpcio and protobuf: "
        "pip install 'tensorserve-client[grpc]'"
    )


def test_the_clients_stubs_are_the_servers() -> None:
    server = ROOT / "tensorserve" / "grpc" / "generated"
    client = ROOT / "clients" / "python" / "tensorserve_client" / "_kserve"
    for name in ("grpc_service_pb2.py", "model_config_pb2.py",
                 "grpc_service_pb2.pyi", "model_config_pb2.pyi"):
        expected = (server / name).read_text().replace(
            "from tensorserve.grpc.generated import", "from tensorserve_client._kserve import")
        assert (client / name).read_text() == expected, f"{name}: run scripts/regenerate_grpc_stubs.py"


# ---------------------------------------------------------------------- a held model
@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, FileGate]]:
    repo = tmp_path_factory.mktemp("client_grpc")
    gate = FileGate(repo)
    write_toy_model(repo, "gated", gate.model(), **{
        **ECHO, "max_batch_size": 1,
        "dynamic_batching": {"max_queue_delay_ms": 1.0, "max_queue_size": 2}})
    server = ServerProcess(repo)
    yield server, gate
    server.stop()


def x(value: float) -> dict[str, np.ndarray]:
    return {"x": np.full((2, 4), value, np.float32)}


@pytest.fixture
def holding(held: tuple[ServerProcess, FileGate]) -> Iterator[tuple[ServerProcess, ThreadPoolExecutor]]:
    """The model held by a batch of 7 (answered when the test ends)."""
    server, gate = held
    with ThreadPoolExecutor(4) as pool, Client(server.url) as client:
        first = pool.submit(client.infer, "gated", x(7))
        gate.wait_entered()
        try:
            yield server, pool
        finally:
            gate.open()
            first.result(timeout=30)
            gate.close()


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_a_client_timeout_is_request_timeout(
    holding: tuple[ServerProcess, ThreadPoolExecutor], scheme: str
) -> None:
    server = holding[0]
    url = server.url if scheme == "http" else grpc_url(server)
    with Client(url, timeout=0.5, retries=NO_RETRY) as client:
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.infer("gated", x(1))
        assert 0.4 < time.monotonic() - started < 5


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_retry_after_is_waited_for(
    holding: tuple[ServerProcess, ThreadPoolExecutor], scheme: str
) -> None:
    server, pool = holding
    url = server.url if scheme == "http" else grpc_url(server)
    with Client(server.url) as filler, \
            Client(url, retries=RetryPolicy(retries=1, backoff=0.0, max_backoff=0.0)) as client:
        queued = [pool.submit(filler.infer, "gated", x(1)) for _ in range(2)]

        def full() -> bool:
            return filler.stats("gated")["batching"]["queue_depth"] == 2

        wait_until(full, "the queue full")
        started = time.monotonic()
        with pytest.raises(ServerBusy) as caught:
            client.infer("gated", x(1))
        waited = time.monotonic() - started
        assert all(not f.done() for f in queued)  # still queued behind the held batch
    assert caught.value.attempts == 2 and caught.value.retry_after is not None
    assert caught.value.retry_after >= 1 and waited >= caught.value.retry_after


def test_the_client_module_layout_keeps_grpc_optional() -> None:
    """Importing the client does not import grpcio (only a grpc:// URL does)."""
    script = "import sys, tensorserve_client; print('grpc' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True, cwd=Path(ROOT))
    assert done.stdout.strip() == "False"

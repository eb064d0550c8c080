"""The gRPC front end when a model cannot take a call now, and when a caller
leaves, against a real server process with raw ``grpc.aio`` stubs:

* a full queue and a model that is not ready end the call UNAVAILABLE with
  ``tensorserve-code`` and ``retry-after`` trailing metadata, as HTTP's 503
  and its Retry-After;
* a call the client cancels withdraws its queued item: the queue depth
  returns to 0, the item never reaches the model, and the disconnect is
  counted in the metrics with protocol="grpc".
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc import aio
from prometheus_client.parser import text_string_to_metric_families

from tensorserve.grpc.generated import grpc_service_pb2 as pb
from tensorserve.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess
from tests.helpers import ECHO, FileGate, wait_until, wait_until_async, write_toy_model

# One row per batch, and room for two in the queue behind the one running.
GATED = {**ECHO, "max_batch_size": 1,
         "dynamic_batching": {"max_queue_delay_ms": 1.0, "max_queue_size": 2}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, FileGate]]:
    repo = tmp_path_factory.mktemp("grpc_overload")
    gate = FileGate(repo)
    write_toy_model(repo, "gated", gate.model(), **GATED)
    server = ServerProcess(repo)
    # Copied in after start-up: listed, but not loaded (UNAVAILABLE).
    shutil.copytree(repo / "gated", repo / "pending")
    yield server, gate
    server.stop()


@pytest.fixture
async def stub(served: tuple[ServerProcess, FileGate]) -> AsyncIterator[pb_grpc.GRPCInferenceServiceStub]:
    async with aio.insecure_channel(served[0].grpc_address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def request(model: str, value: float) -> pb.ModelInferRequest:
    x = np.full((1, 2, 4), value, np.float32)
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    message.raw_input_contents.append(x.tobytes())
    return message


def queue_depth(server: ServerProcess) -> int:
    with urllib.request.urlopen(f"{server.url}/v2/models/gated/stats", timeout=10) as reply:
        return int(json.load(reply)["batching"]["queue_depth"])


def disconnects(server: ServerProcess, protocol: str) -> float:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
        if sample.name == "tensorserve_requests_total"
        and sample.labels.get("code") == "disconnect" and sample.labels.get("protocol") == protocol
    )


async def refused(call: aio.UnaryUnaryCall) -> tuple[grpc.StatusCode, dict[str, str]]:
    with pytest.raises(aio.AioRpcError) as caught:
        await call
    return caught.value.code(), dict(caught.value.trailing_metadata() or ())


async def test_a_full_queue_is_unavailable_with_retry_after(
    served: tuple[ServerProcess, FileGate], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    server, gate = served
    held = stub.ModelInfer(request("gated", 7))
    try:
        await wait_until_async(gate.entered.exists, "the held batch in the model", timeout=30)
        queued = [stub.ModelInfer(request("gated", 1)) for _ in range(2)]
        await wait_until_async(lambda: queue_depth(server) == 2, "the queue full")
        status, trailing = await refused(stub.ModelInfer(request("gated", 1)))
        assert status is grpc.StatusCode.UNAVAILABLE
        assert trailing["tensorserve-code"] == "server_busy"
        assert 1 <= int(trailing["retry-after"]) <= 60  # whole seconds, as HTTP's header
    finally:
        gate.open()
    for call in (held, *queued):  # the calls already queued are answered
        reply = await call
        assert reply.outputs[0].name == "y"
    gate.close()


async def test_a_model_not_ready_is_unavailable_with_retry_after(
    stub: pb_grpc.GRPCInferenceServiceStub,
) -> None:
    # Reading the index finds the folder copied in after start-up: listed, not loaded.
    index = await stub.RepositoryIndex(pb.RepositoryIndexRequest())
    assert {(m.name, m.state) for m in index.models} >= {("pending", "UNAVAILABLE")}
    status, trailing = await refused(stub.ModelInfer(request("pending", 1)))
    assert status is grpc.StatusCode.UNAVAILABLE
    assert trailing["tensorserve-code"] == "model_not_ready"
    assert int(trailing["retry-after"]) >= 1


async def test_a_cancelled_call_withdraws_its_item_and_counts_a_disconnect(
    served: tuple[ServerProcess, FileGate], stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    server, gate = served
    before = disconnects(server, "grpc")
    held = stub.ModelInfer(request("gated", 7))
    try:
        await wait_until_async(gate.entered.exists, "the held batch in the model", timeout=30)
        leaving = stub.ModelInfer(request("gated", 5))  # 5: seen by the model only if run
        await wait_until_async(lambda: queue_depth(server) == 1, "the item queued")
        leaving.cancel()
        await wait_until_async(lambda: queue_depth(server) == 0, "the item withdrawn")
        await wait_until_async(lambda: disconnects(server, "grpc") == before + 1,
                               "the disconnect counted with protocol=grpc")
    finally:
        gate.open()
    await held
    await stub.ModelInfer(request("gated", 3))  # runs after anything still queued would
    assert leaving.cancelled()
    seen = gate.seen_values()
    assert 7.0 in seen and 3.0 in seen and 5.0 not in seen
    gate.close()
    wait_until(lambda: queue_depth(server) == 0, "an empty queue")

"""The error tree against real servers: each class is rebuilt from the
server's answer and carries its message."""

from __future__ import annotations

import numpy as np
import pytest
from tensorserve_bench.server import free_port
from tensorserve_client import (
    AsyncClient,
    BadRequest,
    Client,
    ConnectionError,
    InvalidInput,
    ModelFailure,
    ModelNotFound,
    ModelNotReady,
    RetryPolicy,
    ServerError,
    ServerUnavailable,
    TensorServeError,
)

from tests.client.helpers import FAST, FaultyServer, tokens


def test_unknown_model_or_version_is_model_not_found(client: Client) -> None:
    with pytest.raises(ModelNotFound, match="unknown model 'nope'") as caught:
        client.infer("nope", tokens(3))
    error = caught.value
    assert isinstance(error, BadRequest) and isinstance(error, TensorServeError)
    assert (error.status, error.code, error.attempts) == (404, "model_not_found", 1)
    with pytest.raises(ModelNotFound, match="version '7' is not served"):
        client.infer("tagger", tokens(3), version=7)
    with pytest.raises(ModelNotFound):
        client.ready("nope")


def test_a_bad_item_is_invalid_input_naming_the_feature(client: Client) -> None:
    with pytest.raises(InvalidInput, match=r"item 1, feature 'input_ids': dtype float32") as caught:
        client.infer_batch(
            "tagger",
            [
                tokens(3),
                {"input_ids": np.zeros(3, np.float32), "attention_mask": np.ones(3, np.int64)},
            ],
        )
    assert (caught.value.status, caught.value.code) == (400, "invalid_input")
    with pytest.raises(InvalidInput, match="attention_mask"):
        client.infer("tagger", {"input_ids": np.arange(1, 4)})
    with pytest.raises(BadRequest):  # an axis longer than the model's max_length
        client.infer("tagger", tokens(600))


def test_a_model_that_raises_is_model_failure_and_is_not_retried(
    faulty_server: FaultyServer,
) -> None:
    with Client(faulty_server.url, retries=FAST) as client:
        ok = client.infer("faulty", {"x": np.array([1.0, 2.5], np.float32)})
        np.testing.assert_array_equal(ok["y"], [2.0, 5.0])
        with pytest.raises(ModelFailure, match="negative input is not allowed") as caught:
            client.infer("faulty", {"x": np.array([1.0, -1.0], np.float32)})
    error = caught.value
    assert isinstance(error, ServerError)
    assert (error.status, error.code, error.attempts) == (500, "model_failure", 1)
    assert "faulty" in str(error)


def test_a_model_that_is_not_ready_is_503_and_retried(faulty_server: FaultyServer) -> None:
    policy = RetryPolicy(retries=2, backoff=0.001, max_backoff=0.01)
    with Client(faulty_server.url, retries=policy) as client:
        states = {m["name"]: m["state"] for m in client.models()}
        assert states == {"faulty": "READY", "pending": "UNAVAILABLE"}
        assert client.ready("faulty") and not client.ready("pending")
        with pytest.raises(ModelNotReady, match="'pending' is not ready") as caught:
            client.infer("pending", {"x": [1.0]})
    assert isinstance(caught.value, ServerUnavailable)
    assert (caught.value.status, caught.value.attempts) == (503, 3)


async def test_the_async_twin_raises_the_same_classes(faulty_server: FaultyServer) -> None:
    async with AsyncClient(faulty_server.url, retries=FAST) as client:
        with pytest.raises(ModelFailure, match="negative input"):
            await client.infer("faulty", {"x": [-3.0]})
        with pytest.raises(InvalidInput, match="feature 'x'"):
            await client.infer("faulty", {"x": [[1.0], [2.0]]})


def test_no_server_is_a_retried_connection_error_and_not_ready() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, retries=RetryPolicy(retries=2, backoff=0.001)) as client:
        with pytest.raises(ConnectionError, match=f"POST {url}/v2/models/m/infer") as caught:
            client.infer("m", {"x": [1.0]})
        assert caught.value.attempts == 3 and caught.value.status is None
        assert client.ready() is False

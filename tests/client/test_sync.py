"""``Client`` against the real server process with the bundled models."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from tensorserve_client import Client, InvalidInput

from tests.client.helpers import Answer, ScriptedServer, tokens


def test_infer_returns_one_numpy_array_per_output(client: Client) -> None:
    out = client.infer("tagger", tokens(13))
    assert list(out) == ["logits"]
    assert out["logits"].shape == (13, 9) and out["logits"].dtype == np.float32
    assert np.isfinite(out["logits"]).all()


def test_lists_are_cast_by_the_server_and_give_the_same_numbers(client: Client) -> None:
    item = tokens(9, seed=3)
    typed = client.infer("embedder", item)
    plain = client.infer("embedder", {k: v.tolist() for k, v in item.items()})
    np.testing.assert_allclose(plain["embedding"], typed["embedding"], rtol=1e-5, atol=1e-6)


def test_infer_batch_keeps_the_items_order(client: Client) -> None:
    lengths = [3, 11, 7, 1, 20, 5]
    items = [tokens(n, seed=i) for i, n in enumerate(lengths)]
    rows = client.infer_batch("tagger", items)
    assert [r["logits"].shape for r in rows] == [(n, 9) for n in lengths]
    for item, row in zip(items, rows):
        np.testing.assert_allclose(
            row["logits"], client.infer("tagger", item)["logits"], rtol=1e-4, atol=1e-4
        )
    assert client.infer_batch("tagger", []) == []


def test_map_streams_thousands_of_items_in_order(client: Client) -> None:
    templates = [tokens(1 + (i * 7) % 61, seed=i) for i in range(101)]
    reference = client.infer_batch("tagger", templates)
    count = 3000
    pulled = 0
    produced = 0
    window = []

    def items() -> Iterator[dict[str, np.ndarray]]:
        nonlocal pulled
        for i in range(count):
            pulled += 1
            window.append(pulled - produced)
            yield templates[i % len(templates)]

    batch_size, concurrency = 40, 3
    for i, result in enumerate(
        client.map("tagger", items(), batch_size=batch_size, concurrency=concurrency)
    ):
        produced += 1
        expected = reference[i % len(templates)]["logits"]
        assert result["logits"].shape == expected.shape, i
        np.testing.assert_allclose(result["logits"], expected, rtol=1e-4, atol=1e-4)
    assert produced == count
    # Bounded: never more than `concurrency` batches read ahead of the consumer.
    assert max(window) <= concurrency * batch_size


def test_map_checks_its_arguments_before_reading_anything(client: Client) -> None:
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        client.map("tagger", [], batch_size=0)
    with pytest.raises(ValueError, match="concurrency must be a whole number >= 1"):
        client.map("tagger", [], concurrency=0)


def test_map_stops_at_the_first_error_after_yielding_what_came_before(client: Client) -> None:
    items = [tokens(4, seed=i) for i in range(30)]
    items[17] = {"input_ids": np.arange(4, dtype=np.int32), "attention_mask": np.ones(4, np.int64)}
    got = []
    with pytest.raises(InvalidInput, match=r"'input_ids': dtype int32 .* \(map items 15-19\)$"):
        got.extend(client.map("tagger", items, batch_size=5, concurrency=2))
    assert len(got) == 15  # the three batches before the bad one

    items[17] = {"input_ids": "oops", "attention_mask": np.ones(4, np.int64)}
    with pytest.raises(TypeError, match="item 17, feature 'input_ids'"):  # its index in the stream
        list(client.map("tagger", items, batch_size=5))


def test_map_draws_a_progress_bar(client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    results = list(client.map("embedder", [tokens(3)] * 50, batch_size=8, progress=True))
    assert len(results) == 50
    assert "50/50" in capsys.readouterr().err


def test_server_and_model_endpoints(client: Client) -> None:
    assert client.ready() is True and client.ready("tagger") is True
    names = [m["name"] for m in client.models()]
    assert {"tagger", "embedder", "image_filter"} <= set(names)
    meta = client.metadata("tagger")
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"]
    before = client.stats("embedder")["batching"]["total_items"]
    client.infer_batch("embedder", [tokens(5)] * 3)
    assert client.stats("embedder")["batching"]["total_items"] == before + 3


def test_one_client_is_shared_by_threads_over_one_loop_thread(server_url: str) -> None:
    with Client(server_url) as client:
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            try:
                for n in range(1, 6):
                    assert client.infer("tagger", tokens(n, seed))["logits"].shape == (n, 9)
            except Exception as exc:  # noqa: BLE001 - surfaced by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        loops = [t for t in threading.enumerate() if t.name == "tensorserve-client"]
        assert len(loops) == 1  # this client's; one loop for its lifetime, not one per call
    assert not [t for t in threading.enumerate() if t.name == "tensorserve-client"]


def test_sequential_calls_reuse_one_connection(scripted: ScriptedServer) -> None:
    with Client(scripted.url) as client:
        for _ in range(5):
            client.infer("m", {"x": [1.0, 2.0]})
    assert len({port for _, port in scripted.seen}) == 1


def test_a_closed_client_says_so(server_url: str) -> None:
    client = Client(server_url)
    client.close()
    client.close()  # idempotent
    with pytest.raises(RuntimeError, match="the client is closed"):
        client.ready()


def test_closing_a_client_cancels_calls_other_threads_are_waiting_on(
    scripted: ScriptedServer,
) -> None:
    scripted.answer(Answer(delay=5.0))
    client = Client(scripted.url)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.infer("m", {"x": [1.0]})
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome.append(exc)

    waiter = threading.Thread(target=call)
    waiter.start()
    scripted.wait_for_requests(1)  # the request reached the server
    client.close()
    waiter.join(2)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], concurrent.futures.CancelledError)

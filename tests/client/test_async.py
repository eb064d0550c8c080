"""``AsyncClient`` against the real server process: the same calls, awaited."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from tensorserve_client import AsyncClient, Client, ModelNotFound

from tests.client.helpers import FAST, ScriptedServer, tokens


async def test_infer_and_infer_batch_match_the_sync_twin(server_url: str) -> None:
    items = [tokens(n, seed=n) for n in (6, 2, 15)]
    async with AsyncClient(server_url, retries=FAST) as client:
        one = await client.infer("tagger", items[0])
        rows = await client.infer_batch("tagger", items)
    with Client(server_url) as sync:
        expected = sync.infer_batch("tagger", items)
    assert one["logits"].shape == (6, 9)
    assert [r["logits"].shape for r in rows] == [(6, 9), (2, 9), (15, 9)]
    for got, want in zip(rows, expected):
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)


async def test_concurrent_calls_on_one_client_each_get_their_own_answer(server_url: str) -> None:
    async with AsyncClient(server_url) as client:
        lengths = list(range(1, 41))
        outs = await asyncio.gather(*(client.infer("tagger", tokens(n)) for n in lengths))
    assert [o["logits"].shape[0] for o in outs] == lengths


async def test_map_over_an_async_iterable_yields_in_input_order(server_url: str) -> None:
    templates = [tokens(1 + i % 23, seed=i) for i in range(37)]

    async def items() -> AsyncIterator[dict[str, np.ndarray]]:
        for i in range(2000):
            if i % 100 == 0:
                await asyncio.sleep(0)  # a real producer awaits now and then
            yield templates[i % len(templates)]

    async with AsyncClient(server_url) as client:
        reference = await client.infer_batch("tagger", templates)
        count = 0
        async for result in client.map("tagger", items(), batch_size=32, concurrency=3):
            want = reference[count % len(templates)]["logits"]
            np.testing.assert_allclose(result["logits"], want, rtol=1e-4, atol=1e-4)
            count += 1
    assert count == 2000


async def test_map_stopped_early_cancels_what_is_in_flight(server_url: str) -> None:
    async with AsyncClient(server_url) as client:
        first = []
        async with contextlib.aclosing(
            client.map("embedder", ([tokens(4)] * 1000), batch_size=10, concurrency=3)
        ) as results:
            async for result in results:
                first.append(result)
                if len(first) == 25:
                    break
        assert len(first) == 25
        assert await client.ready("embedder")  # the pool is still usable


async def test_endpoints_and_errors(server_url: str) -> None:
    async with AsyncClient(server_url) as client:
        assert await client.ready() and await client.ready("embedder")
        assert "embedder" in [m["name"] for m in await client.models()]
        assert (await client.metadata("embedder"))["outputs"][0]["name"] == "embedding"
        assert "avg_batch_size" in (await client.stats("embedder"))["batching"]
        with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
            await client.infer("nope", tokens(3))


async def test_sequential_calls_reuse_one_connection(scripted: ScriptedServer) -> None:
    async with AsyncClient(scripted.url) as client:
        for _ in range(5):
            await client.infer("m", {"x": [1.0, 2.0]})
    assert len({port for _, port in scripted.seen}) == 1


def test_a_client_belongs_to_the_loop_it_first_ran_on(server_url: str) -> None:
    client = AsyncClient(server_url)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(client.ready())
        with pytest.raises(RuntimeError, match="belongs to the event loop it first ran on"):
            asyncio.run(client.ready())
        with pytest.raises(RuntimeError, match="on the event loop it ran on"):
            asyncio.run(client.aclose())
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()

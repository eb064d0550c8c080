"""Bulk calls that survive failures: ``map`` and ``infer_batch`` with
``return_errors=True`` put each failed item's error in its place, the other
items get their results, in input order, and a summary counts both."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from tensorserve_client import AsyncClient, Client, InvalidInput, ModelFailure

from tests.client.helpers import FAST, FaultyServer


def _items(values: list[float]) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(3, v, np.float32)} for v in values]


VALUES = [1.0, 2.0, -1.0, 4.0, 5.0, 6.0, -7.0, 8.0, 9.0]


def _check(results: list[object]) -> None:
    assert len(results) == len(VALUES)
    for value, result in zip(VALUES, results):
        if value < 0:
            assert isinstance(result, ModelFailure)
            assert "negative input is not allowed" in result.message
        else:
            assert result["y"].tolist() == [2 * value] * 3  # type: ignore[index]


def test_map_yields_each_failed_items_error_in_its_place(faulty_server: FaultyServer) -> None:
    with Client(faulty_server.url, retries=FAST) as client:
        results = client.map("faulty", _items(VALUES), batch_size=4, return_errors=True)
        _check(list(results))
    assert results.summary.succeeded == 7
    assert dict(results.summary.failed) == {"model_failure": 2}
    assert str(results.summary) == "7 succeeded, 2 failed (model_failure: 2)"


def test_map_without_return_errors_still_stops_at_the_first(faulty_server: FaultyServer) -> None:
    with Client(faulty_server.url, retries=FAST) as client:
        with pytest.raises(ModelFailure, match=r"\(map items 0-3\)"):
            list(client.map("faulty", _items(VALUES), batch_size=4))


def test_infer_batch_returns_errors_in_place_and_bad_input_fails_alone(
    faulty_server: FaultyServer,
) -> None:
    items = _items([1.0, 2.0]) + [{"x": np.ones((2, 2), np.float32)}] + _items([3.0])
    with Client(faulty_server.url, retries=FAST) as client:
        results = client.infer_batch("faulty", items, return_errors=True)
        with pytest.raises(InvalidInput):
            client.infer_batch("faulty", items)
    assert [r["y"].tolist() for r in (results[0], results[1], results[3])] == [  # type: ignore[index]
        [2.0] * 3, [4.0] * 3, [6.0] * 3]
    assert isinstance(results[2], InvalidInput)
    assert results[2].message.endswith("got shape [2, 2] (item 2 of the call)")


async def test_async_map_and_infer_batch_return_errors_too(faulty_server: FaultyServer) -> None:
    async with AsyncClient(faulty_server.url, retries=FAST) as client:
        results = client.map("faulty", _items(VALUES), batch_size=4, concurrency=2,
                             return_errors=True)
        async with contextlib.aclosing(results):
            _check([r async for r in results])
        assert results.summary.succeeded == 7 and results.summary.failed["model_failure"] == 2
        _check(await client.infer_batch("faulty", _items(VALUES), return_errors=True))


def test_the_progress_bar_shows_the_failures(faulty_server: FaultyServer) -> None:
    pytest.importorskip("tqdm")
    with Client(faulty_server.url, retries=FAST) as client:
        results = client.map("faulty", _items(VALUES), batch_size=4, return_errors=True,
                             progress=True)
        _check(list(results))
    assert results.summary.succeeded == 7

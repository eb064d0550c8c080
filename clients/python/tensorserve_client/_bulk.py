"""The pure parts of ``map``: argument checks, cutting a stream of items
into requests that know where they sit in the stream, and the progress bar.

What is not here is the ordered window of in-flight requests itself: it waits
on ``concurrent.futures`` in ``Client.map`` and on asyncio tasks in
``AsyncClient.map``, and is a dozen lines in each.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Generic, Protocol, TypeVar

from tensorserve_client import _protocol
from tensorserve_client._protocol import Call, Features, InferOptions, Outcome, Result
from tensorserve_client.errors import TensorServeError

T = TypeVar("T")


def check_map_args(batch_size: int, concurrency: int) -> None:
    for name, value in (("batch_size", batch_size), ("concurrency", concurrency)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def chunked(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(iterable)
    while chunk := list(islice(iterator, size)):
        yield chunk


async def achunked(iterable: Iterable[T] | AsyncIterable[T], size: int) -> AsyncIterator[list[T]]:
    """Batches of a sync or async iterable."""
    if not isinstance(iterable, AsyncIterable):
        for chunk in chunked(iterable, size):
            yield chunk
        return
    chunk = []
    async for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class Bar(Protocol):
    def update(self, n: int) -> Any: ...
    def set_postfix_str(self, text: str) -> Any: ...
    def close(self) -> Any: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


# Errors about an item (the server refused or failed on what it was sent):
# worth sending each item of a failed request alone. Others (overload after
# the retries, a timeout, no connection) would fail each item the same way.
ITEM_STATUSES = frozenset({400, 413, 422, 500})


def about_items(error: TensorServeError) -> bool:
    return error.status in ITEM_STATUSES


@dataclass
class BulkSummary:
    """What a bulk call did, item by item: ``succeeded``, and ``failed`` by
    error code (``"http_503"`` where the answer had no code)."""

    succeeded: int = 0
    failed: Counter[str] = field(default_factory=Counter)

    def add(self, results: list[Any]) -> None:
        for result in results:
            if isinstance(result, TensorServeError):
                self.failed[result.code or f"http_{result.status}"] += 1
            else:
                self.succeeded += 1

    def __str__(self) -> str:
        failed = sum(self.failed.values())
        detail = ", ".join(f"{code}: {n}" for code, n in self.failed.most_common())
        return f"{self.succeeded} succeeded, {failed} failed" + (f" ({detail})" if detail else "")


class MapResults(Generic[T]):
    """``Client.map``'s iterator: the results in input order, and ``summary``
    (a ``BulkSummary``, complete once the iterator is exhausted)."""

    def __init__(self, results: Iterator[T], summary: BulkSummary) -> None:
        self._results = results
        self.summary = summary

    def __iter__(self) -> MapResults[T]:
        return self

    def __next__(self) -> T:
        return next(self._results)

    def close(self) -> None:
        self._results.close()  # type: ignore[attr-defined]


class AsyncMapResults(Generic[T]):
    """``AsyncClient.map``'s iterator, with ``summary`` as ``MapResults``."""

    def __init__(self, results: AsyncIterator[T], summary: BulkSummary) -> None:
        self._results = results
        self.summary = summary

    def __aiter__(self) -> AsyncMapResults[T]:
        return self

    async def __anext__(self) -> T:
        return await self._results.__anext__()

    async def aclose(self) -> None:
        await self._results.aclose()  # type: ignore[attr-defined]


def progress_bar(enabled: bool, iterable: object, desc: str) -> Callable[[], Bar]:
    """A factory for the bar, checked now (tqdm missing: ImportError before any
    request) and made when the first result is awaited (a map never iterated
    draws nothing)."""
    if not enabled:
        return _NoBar
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise ImportError(
            "progress=True needs tqdm: pip install 'tensorserve-client[progress]' (or tqdm)"
        ) from None
    try:
        total: int | None = len(iterable)  # type: ignore[arg-type]
    except TypeError:  # a generator: the bar counts without a total
        total = None
    return lambda: tqdm(total=total, desc=desc, unit="item")


@dataclass(frozen=True)
class Batch:
    """One request of a map, and where its items sit in the stream."""

    call: Call[list[Result]]
    first: int  # the stream index of its first item
    size: int
    items: list[Features]  # kept to send each alone if the request fails
    model: str
    options: InferOptions

    def alone(self) -> list[Call[list[Result]]]:
        """One request per item, for a request that failed because of one."""
        return [
            _protocol.infer(self.model, [item], first_index=self.first + i, **self.options)
            for i, item in enumerate(self.items)
        ]

    def finish(self, outcome: Outcome, bar: Bar) -> list[Result]:
        """The batch's results; an error says which items of the stream it concerns
        (the server numbers items within its request)."""
        try:
            results = self.call.complete(outcome)
        except TensorServeError as error:
            error.message = f"{error.message} (map items {self.first}-{self.first + self.size - 1})"
            error.args = (error.message,)
            raise
        bar.update(len(results))
        return results


def _batch(model: str, chunk: list[Features], first: int, options: InferOptions) -> Batch:
    call = _protocol.infer(model, chunk, first_index=first, **options)
    return Batch(call, first, len(chunk), chunk, model, options)


def locate(error: TensorServeError, index: int) -> TensorServeError:
    """An item sent alone: the server calls it item 0; say where it sits."""
    error.message = f"{error.message} (item {index} of the call)"
    error.args = (error.message,)
    return error


def finish(
    batch: Batch, outcome: Outcome, bar: Bar, summary: BulkSummary, return_errors: bool
) -> list[Any] | TensorServeError:
    """A map's batch: its results, counted; or, with ``return_errors``, the
    error to resolve item by item (``Client._alone``), then ``record_alone``."""
    try:
        return record(batch.finish(outcome, bar), summary, bar)
    except TensorServeError as error:
        if not return_errors:
            raise
        return error


def record_alone(results: list[Any], summary: BulkSummary, bar: Bar) -> list[Any]:
    bar.update(len(results))
    return record(results, summary, bar)


def record(results: list[Any], summary: BulkSummary, bar: Bar) -> list[Any]:
    """Count a batch's results, and show the failures on the bar."""
    summary.add(results)
    if summary.failed:
        bar.set_postfix_str(f"failed={sum(summary.failed.values())}")
    return results


def batches(
    model: str, iterable: Iterable[Features], size: int, options: InferOptions
) -> Iterator[Batch]:
    first = 0
    for chunk in chunked(iterable, size):
        yield _batch(model, chunk, first, options)
        first += len(chunk)


async def abatches(
    model: str,
    iterable: Iterable[Features] | AsyncIterable[Features],
    size: int,
    options: InferOptions,
) -> AsyncIterator[Batch]:
    first = 0
    async for chunk in achunked(iterable, size):
        yield _batch(model, chunk, first, options)
        first += len(chunk)

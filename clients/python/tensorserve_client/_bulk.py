"""The pure parts of ``map``: argument checks, cutting a stream of items
into requests that know where they sit in the stream, and the progress bar.

What is not here is the ordered window of in-flight requests itself: it waits
on ``concurrent.futures`` in ``Client.map`` and on asyncio tasks in
``AsyncClient.map``, and is a dozen lines in each.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol, TypeVar

from tensorserve_client import _protocol
from tensorserve_client._protocol import Call, Features, Outcome, Result
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
    def close(self) -> Any: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


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


def _batch(model: str, chunk: list[Features], first: int, options: dict[str, Any]) -> Batch:
    call = _protocol.infer(model, chunk, first_index=first, **options)
    return Batch(call, first, len(chunk))


def batches(
    model: str, iterable: Iterable[Features], size: int, options: dict[str, Any]
) -> Iterator[Batch]:
    first = 0
    for chunk in chunked(iterable, size):
        yield _batch(model, chunk, first, options)
        first += len(chunk)


async def abatches(
    model: str,
    iterable: Iterable[Features] | AsyncIterable[Features],
    size: int,
    options: dict[str, Any],
) -> AsyncIterator[Batch]:
    first = 0
    async for chunk in achunked(iterable, size):
        yield _batch(model, chunk, first, options)
        first += len(chunk)

"""``AsyncClient``: the asyncio twin of ``Client``. Same calls (``_protocol``),
same transport, driven on the caller's event loop."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from tensorserve_client import _bulk, _protocol
from tensorserve_client._protocol import Call, Features, Outcome, Result
from tensorserve_client._retry import RetryPolicy
from tensorserve_client._transport import open_transport
from tensorserve_client.errors import TensorServeError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

T = TypeVar("T")


class AsyncClient:
    """An asyncio tensorserve client with a keep-alive connection pool.

    Same arguments and methods as ``Client``; methods are coroutines, and
    ``map`` is an async iterator. The pool is opened on first use and belongs
    to that event loop. Use ``async with``, or ``await client.aclose()``.
    """

    def __init__(
        self,
        url: str = "http://localhost:8000",
        *,
        timeout: float | None = 60.0,
        retries: int | RetryPolicy = 3,
        headers: Mapping[str, str] | None = None,
        max_connections: int = 100,
    ) -> None:
        self._transport = open_transport(
            url, timeout=timeout, retries=retries, headers=headers, max_connections=max_connections
        )

    @property
    def url(self) -> str:
        return self._transport.url

    async def _call(self, call: Call[T]) -> T:
        return call.complete(await self._transport.exchange(call))

    async def infer(
        self,
        model: str,
        features: Features,
        *,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        return_torch: bool = False,
    ) -> Result:
        """Run one item (see ``Client.infer``)."""
        return await self._call(
            _protocol.infer_one(
                model,
                features,
                version=version,
                parameters=parameters,
                timeout=timeout,
                return_torch=return_torch,
            )
        )

    async def infer_batch(
        self,
        model: str,
        items: Iterable[Features],
        *,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        return_torch: bool = False,
        return_errors: bool = False,
    ) -> list[Result | TensorServeError]:
        """Run many items in one request, results in order (see ``Client.infer_batch``)."""
        options: _protocol.InferOptions = {
            "version": version,
            "parameters": parameters,
            "timeout": timeout,
            "return_torch": return_torch,
        }
        items = list(items)
        batch = _bulk.Batch(
            _protocol.infer(model, items, **options), 0, len(items), items, model, options
        )
        outcome = await self._transport.exchange(batch.call)
        try:
            return list(batch.call.complete(outcome))
        except TensorServeError as error:
            if not return_errors:
                raise
            return await self._alone(batch, error)

    def map(
        self,
        model: str,
        iterable: Iterable[Features] | AsyncIterable[Features],
        *,
        batch_size: int = 32,
        concurrency: int = 4,
        progress: bool = False,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        return_torch: bool = False,
        return_errors: bool = False,
    ) -> _bulk.AsyncMapResults[Result | TensorServeError]:
        """``async for result in client.map(model, items)``: results in input order.

        As ``Client.map`` (``return_errors``, ``summary`` included); ``iterable``
        may also be an async iterable. If you may
        stop early, wrap it in ``contextlib.aclosing`` so in-flight requests are
        cancelled at once rather than when the iterator is garbage-collected.
        """
        _bulk.check_map_args(batch_size, concurrency)
        make_bar = _bulk.progress_bar(progress, iterable, model)
        options: _protocol.InferOptions = {
            "version": version,
            "parameters": parameters,
            "timeout": timeout,
            "return_torch": return_torch,
        }
        summary = _bulk.BulkSummary()
        results = self._map(
            model, iterable, batch_size, concurrency, make_bar, options, summary, return_errors
        )
        return _bulk.AsyncMapResults(results, summary)

    async def _map(
        self,
        model: str,
        iterable: Iterable[Features] | AsyncIterable[Features],
        batch_size: int,
        concurrency: int,
        make_bar: Callable[[], _bulk.Bar],
        options: _protocol.InferOptions,
        summary: _bulk.BulkSummary,
        return_errors: bool,
    ) -> AsyncIterator[Result | TensorServeError]:
        pending: deque[tuple[_bulk.Batch, asyncio.Task[Outcome]]] = deque()
        bar = make_bar()
        try:
            async for batch in _bulk.abatches(model, iterable, batch_size, options):
                pending.append((batch, asyncio.ensure_future(self._transport.exchange(batch.call))))
                if len(pending) >= concurrency:
                    batch, task = pending.popleft()
                    for result in await self._finish(
                        batch, await task, bar, summary, return_errors
                    ):
                        yield result
            while pending:
                batch, task = pending.popleft()
                for result in await self._finish(batch, await task, bar, summary, return_errors):
                    yield result
        finally:
            for _, task in pending:
                task.cancel()
            bar.close()

    async def _finish(
        self,
        batch: _bulk.Batch,
        outcome: Outcome,
        bar: _bulk.Bar,
        summary: _bulk.BulkSummary,
        return_errors: bool,
    ) -> list[Result | TensorServeError]:
        results = _bulk.finish(batch, outcome, bar, summary, return_errors)
        if isinstance(results, TensorServeError):
            return _bulk.record_alone(await self._alone(batch, results), summary, bar)
        return results

    async def _alone(
        self, batch: _bulk.Batch, error: TensorServeError
    ) -> list[Result | TensorServeError]:
        """As ``Client._alone``, the items' requests sent concurrently."""
        if batch.size == 1 or not _bulk.about_items(error):
            return [error] * batch.size

        async def one(index: int, call: Call[list[Result]]) -> Result | TensorServeError:
            try:
                return (await self._call(call))[0]
            except TensorServeError as alone:
                return _bulk.locate(alone, index)

        calls = enumerate(batch.alone(), batch.first)
        return list(await asyncio.gather(*(one(index, call) for index, call in calls)))

    async def ready(self, model: str | None = None, *, version: str | int | None = None) -> bool:
        """Whether the server or one model can take requests now (see ``Client.ready``)."""
        return await self._call(_protocol.ready(model, version))

    async def models(self) -> list[dict[str, Any]]:
        """The repository index: ``[{"name", "state", "version"?, "reason"?}]``."""
        return await self._call(_protocol.models())

    async def metadata(self, model: str, *, version: str | int | None = None) -> dict[str, Any]:
        """The model's inputs and outputs (KServe v2 metadata)."""
        return await self._call(_protocol.metadata(model, version))

    async def stats(self, model: str, *, version: str | int | None = None) -> dict[str, Any]:
        """The model's batching statistics."""
        return await self._call(_protocol.stats(model, version))

    async def load(self, model: str) -> dict[str, Any]:
        """Load or reload a model (see ``Client.load``)."""
        return await self._call(_protocol.repository_action("load", model))

    async def unload(self, model: str) -> dict[str, Any]:
        """Unload a model once its queued requests have finished (see ``Client.load``)."""
        return await self._call(_protocol.repository_action("unload", model))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._transport.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r})"

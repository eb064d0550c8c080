"""``Client``: the blocking twin. Sends through the same ``Transport`` as
``AsyncClient``, driven on one private event loop that runs on a background
thread for the client's lifetime — never a loop per call. The loop only moves
bytes: encoding happens before a call is handed to it and decoding after its
answer is handed back, on the caller's thread. Safe to share between threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from tensorserve_client import _bulk, _protocol
from tensorserve_client._protocol import Call, Features, Outcome, Result
from tensorserve_client._retry import RetryPolicy
from tensorserve_client._transport import Transport, open_transport
from tensorserve_client.errors import TensorServeError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

T = TypeVar("T")


class _LoopThread:
    """An event loop on a daemon thread; coroutines are handed to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pid = os.getpid()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="tensorserve-client", daemon=True
        )
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if os.getpid() != self.pid:
            coroutine.close()
            raise RuntimeError(
                "a Client cannot be used in a forked child process; create a new one there"
            )
        if self.loop.is_closed():
            coroutine.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:  # KeyboardInterrupt included: stop the request too
            future.cancel()
            raise

    def stop(self, last: Coroutine[Any, Any, Any]) -> None:
        """Cancel what is in flight (callers on other threads get CancelledError
        rather than waiting forever), run ``last`` (the pool's clean-up), then
        stop and close the loop."""
        if self.loop.is_closed():
            last.close()
            return
        try:
            self.run(_cancel_in_flight())
            self.run(last)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


async def _cancel_in_flight() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _shutdown(loop_thread: _LoopThread, transport: Transport) -> None:
    # Also the finalizer of a Client that was never closed: must not refer to it.
    if os.getpid() == loop_thread.pid:
        loop_thread.stop(transport.aclose())


class Client:
    """A blocking tensorserve client with a keep-alive connection pool.

    ``url``: ``http://host:port`` (msgpack over HTTP), or ``grpc://host:port``
    (KServe v2 gRPC; needs ``pip install 'tensorserve-client[grpc]'``): the
    same methods, results and errors either way. ``timeout``: seconds one
    attempt may take (None: no limit; over gRPC, the call's deadline).
    ``retries``: how many times a "not now" answer (no connection, 503, 429,
    gRPC UNAVAILABLE) is retried, or a ``RetryPolicy``. ``headers`` are sent
    with every request (over gRPC as metadata). Use it as a context manager,
    or call ``close()``.
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
        self._loop = _LoopThread()
        self._finalizer = weakref.finalize(self, _shutdown, self._loop, self._transport)

    @property
    def url(self) -> str:
        return self._transport.url

    def _call(self, call: Call[T]) -> T:
        return call.complete(self._loop.run(self._transport.exchange(call)))

    # ----------------------------------------------------------------- inference
    def infer(
        self,
        model: str,
        features: Features,
        *,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        return_torch: bool = False,
    ) -> Result:
        """Run one item: ``{feature: array}`` in, ``{output: np.ndarray}`` out.

        Features may be numpy arrays, torch tensors or nested lists (cast by the
        server to the declared dtype). ``timeout``: the item's deadline in seconds,
        enforced by the server (``DeadlineExceeded``); retries stop there too.
        ``return_torch=True`` returns torch tensors instead of numpy arrays.
        """
        return self._call(
            _protocol.infer_one(
                model,
                features,
                version=version,
                parameters=parameters,
                timeout=timeout,
                return_torch=return_torch,
            )
        )

    def infer_batch(
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
        """Run many items in one request; results come back in the items' order.

        ``return_errors=True``: an item that fails does not fail the others;
        its ``TensorServeError`` takes its place in the list (a request that
        failed because of an item is sent again one item at a time)."""
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
        outcome = self._loop.run(self._transport.exchange(batch.call))
        try:
            return list(batch.call.complete(outcome))
        except TensorServeError as error:
            if not return_errors:
                raise
            return self._alone(batch, error)

    def map(
        self,
        model: str,
        iterable: Iterable[Features],
        *,
        batch_size: int = 32,
        concurrency: int = 4,
        progress: bool = False,
        version: str | int | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        return_torch: bool = False,
        return_errors: bool = False,
    ) -> _bulk.MapResults[Result | TensorServeError]:
        """Stream any number of items through the server; yields results in input order.

        Items are read lazily, ``batch_size`` per request, with at most
        ``concurrency`` requests in flight, so memory stays bounded however long
        ``iterable`` is. The first error stops the map and is raised, naming the
        items of the stream it concerns; requests still in flight are cancelled.
        With ``return_errors=True`` the map goes on: each failed item's
        ``TensorServeError`` is yielded in its place (a request that failed
        because of an item is sent again one item at a time, so only that
        item fails). Retryable errors are retried per request either way.
        The iterator's ``summary`` counts what succeeded and what failed, by
        error code; ``progress=True`` draws a tqdm bar that shows the failures.
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
        return _bulk.MapResults(results, summary)

    def _map(
        self,
        model: str,
        iterable: Iterable[Features],
        batch_size: int,
        concurrency: int,
        make_bar: Callable[[], _bulk.Bar],
        options: _protocol.InferOptions,
        summary: _bulk.BulkSummary,
        return_errors: bool,
    ) -> Iterator[Result | TensorServeError]:
        pending: deque[tuple[_bulk.Batch, concurrent.futures.Future[Outcome]]] = deque()
        bar = make_bar()
        try:
            for batch in _bulk.batches(model, iterable, batch_size, options):
                pending.append((batch, self._loop.submit(self._transport.exchange(batch.call))))
                if len(pending) >= concurrency:
                    batch, future = pending.popleft()
                    yield from self._finish(batch, future.result(), bar, summary, return_errors)
            while pending:
                batch, future = pending.popleft()
                yield from self._finish(batch, future.result(), bar, summary, return_errors)
        finally:
            for _, future in pending:
                future.cancel()
            bar.close()

    def _finish(
        self,
        batch: _bulk.Batch,
        outcome: Outcome,
        bar: _bulk.Bar,
        summary: _bulk.BulkSummary,
        return_errors: bool,
    ) -> list[Result | TensorServeError]:
        """A batch's results; with ``return_errors``, an error in each failed item's place."""
        results = _bulk.finish(batch, outcome, bar, summary, return_errors)
        if isinstance(results, TensorServeError):
            return _bulk.record_alone(self._alone(batch, results), summary, bar)
        return results

    def _alone(
        self, batch: _bulk.Batch, error: TensorServeError
    ) -> list[Result | TensorServeError]:
        """Each item's result or error, for a request that failed: sent again
        one item at a time where the failure was about an item."""
        if batch.size == 1 or not _bulk.about_items(error):
            return [error] * batch.size
        results: list[Result | TensorServeError] = []
        for index, call in enumerate(batch.alone(), batch.first):
            try:
                results.append(self._call(call)[0])  # one item per call
            except TensorServeError as alone:
                results.append(_bulk.locate(alone, index))
        return results

    # ----------------------------------------------------------------- server and models
    def ready(self, model: str | None = None, *, version: str | int | None = None) -> bool:
        """Whether the server (every model) or one model can take requests now.

        False while loading or failed, and when the server cannot be reached;
        never retried. An unknown model raises ``ModelNotFound``.
        """
        return self._call(_protocol.ready(model, version))

    def models(self) -> list[dict[str, Any]]:
        """The repository index: ``[{"name", "state", "version"?, "reason"?}]``."""
        return self._call(_protocol.models())

    def metadata(self, model: str, *, version: str | int | None = None) -> dict[str, Any]:
        """The model's inputs and outputs (KServe v2 metadata)."""
        return self._call(_protocol.metadata(model, version))

    def stats(self, model: str, *, version: str | int | None = None) -> dict[str, Any]:
        """The model's batching statistics (``stats["batching"]["avg_batch_size"]``...)."""
        return self._call(_protocol.stats(model, version))

    def load(self, model: str) -> dict[str, Any]:
        """Load a model of the server's repository, or reload it (its newest
        version); returns its index entry. Needs a server started with
        ``--model-control-mode explicit`` (else ``ModelControlDisabled``); a model
        that fails to load raises ``InvalidInput`` with the reason."""
        return self._call(_protocol.repository_action("load", model))

    def unload(self, model: str) -> dict[str, Any]:
        """Unload a model once its queued requests have finished (see ``load``)."""
        return self._call(_protocol.repository_action("unload", model))

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Close the connection pool and stop the client's loop thread."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

"""The two kinds of process of the many-front-ends prototype
(benchmarks/frontends_prototype.py); not part of the package.

    python benchmarks/prototype_frontend_worker.py batcher  REPO MODEL SOCKET READY_FILE
    python benchmarks/prototype_frontend_worker.py frontend REPO MODEL SOCKET READY_FILE PORT

``batcher``: one ServedModel (isolation "thread") behind a Unix socket, one
connection per front end. ``frontend``: an aiohttp app on a socket bound with
SO_REUSEPORT (the kernel spreads connections over every front end on the
port) that decodes and validates KServe v2 JSON with tensorserve's own codec,
forwards the items' arrays to the batcher and encodes its reply.

A frame, either way: 8 bytes (header length, payload length; network order),
a msgpack header, then the arrays' raw bytes back to back, C order:
    request  {"id", "timeout", "priority", "parameters", "arrays": [[[name, dtype, shape]...] per item]}
    reply    {"id", "arrays": ...}   or   {"id", "error": [code, message]}
A Unix socket costs a copy into and out of the kernel each way, and a
send per loop iteration (``Outbox``); the design this stands for would put
the arrays in a shared-memory ring and send only the header. Prototype
limits: no back-pressure (writes are never drained), numpy dtypes only (no
bfloat16), no per-row output parameters. Each process touches READY_FILE once it serves, and stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import math
import signal
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from tensorserve import errors
from tensorserve.errors import ModelNotReady, TensorServeError

Arrays = dict[str, np.ndarray]
PREFIX = struct.Struct("!II")
# The codes a reply may carry, back to their classes, so the front end answers
# with the status the one-process server would give (tensorserve/http/errors.py).
ERRORS: dict[str, type[TensorServeError]] = {
    cls.code: cls
    for cls in (errors.InvalidInput, errors.ModelNotFound, ModelNotReady, errors.ServerBusy,
                errors.RequestTooLarge, errors.DeadlineExceeded, errors.ModelFailure,
                errors.OutOfMemory)
}  # fmt: skip


# ---------------------------------------------------------------------- frames
class Outbox:
    """Frames written in one loop iteration leave in one ``writelines`` at its
    end: one send for a whole batch's replies (they are settled together),
    not one syscall per frame. Owned by one event loop; frames never
    interleave because each is appended whole."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.chunks: list[bytes | memoryview] = []

    def send(self, chunks: list[bytes | memoryview]) -> None:
        if not self.chunks:
            asyncio.get_running_loop().call_soon(self._flush)
        self.chunks += chunks

    def _flush(self) -> None:
        chunks, self.chunks = self.chunks, []
        if not self.writer.is_closing():  # the peer may have gone
            self.writer.writelines(chunks)


def write_frame(
    outbox: Outbox, header: dict[str, Any], items: Sequence[Mapping[str, np.ndarray]]
) -> None:
    """``header`` with the items' array specs, then their bytes (views, no copies)."""
    specs, chunks = [], []
    for item in items:
        row = []
        for name, array in item.items():
            array = np.ascontiguousarray(array)
            row.append([name, array.dtype.str, list(array.shape)])
            chunks.append(array.reshape(-1).view(np.uint8).data)  # a view, no copy
        specs.append(row)
    head = msgpack.packb({**header, "arrays": specs})
    outbox.send([PREFIX.pack(len(head), sum(c.nbytes for c in chunks)), head, *chunks])


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], memoryview]:
    head_length, payload_length = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    frame = memoryview(await reader.readexactly(head_length + payload_length))
    return msgpack.unpackb(frame[:head_length]), frame[head_length:]


def unpack_items(specs: list[list[list[Any]]], payload: memoryview) -> list[Arrays]:
    """The arrays of a frame: views of its payload, no copies (read-only; the
    collator copies them into the padded batch anyway)."""
    items, offset = [], 0
    for row in specs:
        item = {}
        for name, dtype, shape in row:
            dt, count = np.dtype(dtype), math.prod(shape)
            item[name] = np.frombuffer(payload, dt, count, offset).reshape(shape)
            offset += count * dt.itemsize
        items.append(item)
    return items


# ---------------------------------------------------------------------- the batcher process
async def batcher_main(repository: str, model_name: str, path: str, ready: Path) -> None:
    from tensorserve import ServedModel

    async def answer(model: ServedModel, header: dict[str, Any], payload: memoryview,
                     outbox: Outbox) -> None:  # fmt: skip
        reply: dict[str, Any] = {"id": header["id"]}
        try:
            results = await model.infer_many(
                unpack_items(header["arrays"], payload), timeout=header["timeout"],
                priority=header["priority"], parameters=header["parameters"],
            )  # fmt: skip
        except TensorServeError as exc:  # the caller's error, passed through by code
            results, reply["error"] = [], [exc.code, exc.message]
        except Exception as exc:  # noqa: BLE001 - a 500, never a caller left waiting
            results, reply["error"] = [], [TensorServeError.code, f"batcher: {exc!r}"]
        write_frame(outbox, reply, results)

    async with ServedModel.from_repository(repository, model_name, isolation="thread") as model:

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            tasks: set[asyncio.Task[None]] = set()  # held: a task nobody holds may be collected
            outbox = Outbox(writer)
            try:
                while True:
                    header, payload = await read_frame(reader)
                    task = asyncio.ensure_future(answer(model, header, payload, outbox))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # the front end closed its connection
            finally:
                for task in tasks:
                    task.cancel()
                writer.close()

        server = await asyncio.start_unix_server(serve, path=path)
        await until_terminated(ready)
        server.close()


# ---------------------------------------------------------------------- a front-end process
class BatcherLink:
    """A front end's one connection to the batcher, requests multiplexed by
    id. Owned by the front end's event loop: handlers write, one task reads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.outbox = reader, writer, Outbox(writer)
        self.pending: dict[int, asyncio.Future[list[Arrays]]] = {}
        self.next_id = 0
        self.reading = asyncio.ensure_future(self._read())

    async def infer(self, items: list[Arrays], header: dict[str, Any]) -> list[Arrays]:
        if self.reading.done():
            raise ModelNotReady("the batcher process went away")
        self.next_id += 1
        request_id, future = self.next_id, asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        try:
            write_frame(self.outbox, {"id": request_id, **header}, items)
            return await future
        finally:
            self.pending.pop(request_id, None)  # answered, or its caller left

    async def _read(self) -> None:
        try:
            while True:
                header, payload = await read_frame(self.reader)
                future = self.pending.pop(header["id"], None)
                if future is None or future.done():
                    continue  # its caller left
                if "error" in header:
                    code, message = header["error"]
                    future.set_exception(ERRORS.get(code, TensorServeError)(message))
                else:
                    future.set_result(unpack_items(header["arrays"], payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            for future in self.pending.values():  # every waiting caller hears of it
                if not future.done():
                    future.set_exception(ModelNotReady("the batcher process went away"))
            self.pending.clear()


async def frontend_main(
    repository: str, model_name: str, path: str, ready: Path, port: int
) -> None:
    from aiohttp import web

    from tensorserve.http.errors import STATUS
    from tensorserve.repository.loader import discover, read_config
    from tensorserve.settings import Settings
    from tensorserve.wire import oip
    from tensorserve.wire.request import effective_timeout
    from tensorserve.wire.validate import validate_item

    source = discover(Path(repository))[model_name]
    config, version, settings = read_config(source), str(source.latest), Settings()
    link = BatcherLink(*await asyncio.open_unix_connection(path))

    async def infer(request: web.Request) -> web.Response:
        decoded = oip.decode_request(
            await request.read(), request.headers, config, settings.max_items_per_request
        )
        # Validated here, so a bad item is this front end's 400 and never a frame.
        items = [validate_item(item, config.input, i) for i, item in enumerate(decoded.items)]
        timeout = effective_timeout(
            decoded.timeout, config.default_timeout_ms, settings.default_timeout_ms,
            settings.max_timeout_ms,
        )  # fmt: skip
        results = await link.infer(items, {
            "timeout": timeout, "priority": decoded.parameters.get("priority"),
            "parameters": decoded.parameters,
        })  # fmt: skip
        encoded = oip.encode_response(decoded, results, model_name, version, config)
        return web.Response(
            body=encoded.body, content_type=encoded.content_type, headers=encoded.headers
        )

    @web.middleware
    async def error_statuses(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except TensorServeError as exc:
            body = {"error": exc.message, "code": exc.code}
            return web.json_response(body, status=STATUS.get(exc.code, 500))

    app = web.Application(middlewares=[error_statuses])
    app.router.add_post(f"/v2/models/{model_name}/infer", infer)
    # SO_REUSEPORT: every front end binds its own listening socket to the one
    # port and the kernel hashes each new connection to one of them.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.SockSite(runner, listener, backlog=1024).start()
    try:
        await until_terminated(ready)
    finally:
        await runner.cleanup()
        link.writer.close()


# ---------------------------------------------------------------------- both
async def until_terminated(ready: Path) -> None:
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    ready.touch()
    await stop.wait()


def main(argv: list[str]) -> None:
    kind, repository, model, path, ready, *rest = argv
    if kind == "batcher":
        coroutine = batcher_main(repository, model, path, Path(ready))
    else:
        coroutine = frontend_main(repository, model, path, Path(ready), int(rest[0]))
    try:
        import uvloop  # as the server does, when installed
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


if __name__ == "__main__":
    main(sys.argv[1:])

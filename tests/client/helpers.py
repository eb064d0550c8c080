"""Helpers for the client tests: items, toy models, and a scripted aiohttp
server on its own thread that answers what a test tells it to."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from aiohttp import web
from tensorserve_client import RetryPolicy

# Retries without waiting, for tests that count attempts.
FAST = RetryPolicy(retries=3, backoff=0.001, max_backoff=0.01)

# The faulty model's config.toml, as keywords of tests.helpers.write_toy_model.
FAULTY: dict[str, Any] = {
    "max_batch_size": 8,
    "device": "cpu",
    "dynamic_batching": {"max_queue_delay_ms": 1.0},
    "inputs": {"x": {"dtype": "float32", "shape": [-1]}},
    "outputs": {"y": {"dtype": "float32", "shape": [-1]}},
}

FAULTY_MODEL = '''
import torch


class Model(torch.nn.Module):
    """y = 2x, but any negative input makes the whole forward raise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x < 0).any()):
            raise ValueError("negative input is not allowed")
        return x * 2
'''




@dataclass
class FaultyServer:
    """A real server on a temporary repository (see the ``faulty_server`` fixture)."""

    url: str
    repository: Path


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/msgpack"
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False  # close the connection without answering


def outputs_body(*results: dict[str, np.ndarray]) -> bytes:
    """A native-protocol infer answer holding ``results``."""
    return msgpack.packb(
        {
            "model_name": "m",
            "model_version": "1",
            "outputs": [
                {
                    name: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}
                    for name, a in result.items()
                }
                for result in results
            ],
        }
    )


def error_body(message: str, code: str) -> bytes:
    return msgpack.packb({"error": message, "code": code})


OK = Answer(body=outputs_body({"y": np.array([1.0, 2.0], dtype=np.float32)}))


class ScriptedServer:
    """aiohttp on a background thread. Each request gets the next scripted
    ``Answer`` (then ``OK`` once the script runs out); ``seen`` records when
    each request arrived and from which client port, and ``wait_for_requests``
    blocks until enough have."""

    def __init__(self) -> None:
        self.script: deque[Answer] = deque()
        self.seen: list[tuple[float, int]] = []
        self._arrived = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._runner = self._run(self._start())
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        with self._arrived:
            self.seen.append((time.monotonic(), peer[1] if peer else -1))
            self._arrived.notify_all()
        answer = self.script.popleft() if self.script else OK
        if answer.delay:
            await asyncio.sleep(answer.delay)
        if answer.drop:
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("dropped on purpose")
        return web.Response(
            status=answer.status,
            body=answer.body,
            content_type=answer.content_type,
            headers=answer.headers,
        )

    def answer(self, *answers: Answer) -> None:
        self.script.extend(answers)

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> None:
        """Block until ``count`` requests have arrived (fail after ``timeout`` s)."""
        with self._arrived:
            arrived = self._arrived.wait_for(lambda: len(self.seen) >= count, timeout)
        assert arrived, f"{len(self.seen)} of {count} requests arrived within {timeout} s"

    def close(self) -> None:
        self._run(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def tokens(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """An item of ``n`` tokens for the tagger/embedder whose ids depend on ``seed``."""
    ids = (np.arange(n, dtype=np.int64) * 31 + seed * 7) % 4000 + 1
    return {"input_ids": ids, "attention_mask": np.ones(n, dtype=np.int64)}

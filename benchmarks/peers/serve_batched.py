#!/usr/bin/env python3
"""Peer: the ``batched`` package (in-process dynamic batching) behind aiohttp.

A minimal aiohttp server that speaks tensorserve's msgpack protocol (so the
client side is byte-for-byte the same as for tensorserve):

* ``POST /v2/models/tagger/infer`` (``application/msgpack``)
  ``{"items": [{"input_ids": T, "attention_mask": T}]}`` with
  ``T = {"dtype", "shape", "data": <little-endian bytes>}`` ->
  ``{"model_name", "outputs": [{"logits": T}]}``
* ``GET /v2/health/ready`` -> 200

Each item is awaited through ``batched.aio.inference.dynamically(batch_size=32,
timeout_ms=<delay>, pad_tokens={"input_ids": 0, "attention_mask": 0})``, which
right-pads the queued items to the batch maximum and calls the ``async``
batch function below. ``--forward`` chooses where the forward pass runs, the
two ways a user writes it: ``loop`` (on the event loop, blocking it while
the model runs: the simplest, and on 2 cores the faster) or ``thread`` (in a
single worker thread, so the event loop keeps reading requests meanwhile).
``batched`` hands back each item's *padded* row, which the handler slices to
the item's own length.

Run inside ``.venvs/batched``::

    python serve_batched.py --model-dir DIR --port 8000 [--forward thread] [--threads 0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import msgpack
import numpy as np
from aiohttp import web
from batched.aio.inference import dynamically
from common import BatchStats, load_tagger, run_batch


def _decode(t: dict) -> np.ndarray:
    a = np.frombuffer(t["data"], dtype=np.dtype(t["dtype"]).newbyteorder("<"))
    return a.reshape(t["shape"]).astype(np.int64, copy=False)


def build_app(model_dir: str, threads: int, max_batch: int, max_delay_ms: float,
              stats_file: str | None, forward: str = "loop") -> web.Application:
    model = load_tagger(model_dir, threads=threads)
    stats = BatchStats(stats_file)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    @dynamically(batch_size=max_batch, timeout_ms=max_delay_ms,
                 pad_tokens={"input_ids": 0, "attention_mask": 0})
    async def infer(features: dict[str, np.ndarray]) -> np.ndarray:
        ids, mask = features["input_ids"], features["attention_mask"]
        stats.record(ids.shape[0])
        if forward == "loop":
            return run_batch(model, ids, mask)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(executor, run_batch, model, ids, mask)

    async def one(item: dict) -> np.ndarray:
        ids = _decode(item["input_ids"])
        mask = _decode(item["attention_mask"]) if "attention_mask" in item else np.ones_like(ids)
        out = await infer({"input_ids": ids[None], "attention_mask": mask[None]})
        return np.ascontiguousarray(out[0, : ids.shape[0]])  # un-pad

    async def handle_infer(request: web.Request) -> web.Response:
        try:
            msg = msgpack.unpackb(await request.read(), raw=False)
            outs = await asyncio.gather(*(one(it) for it in msg["items"]))
        except (KeyError, ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        body = msgpack.packb({"model_name": "tagger", "outputs": [
            {"logits": {"dtype": "float32", "shape": list(o.shape),
                        "data": o.astype("<f4", copy=False).tobytes()}} for o in outs]})
        return web.Response(body=body, content_type="application/msgpack")

    async def handle_ready(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def on_cleanup(app: web.Application) -> None:
        stats.flush()
        executor.shutdown(wait=False)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v2/models/tagger/infer", handle_infer)
    app.router.add_get("/v2/health/ready", handle_ready)
    app.on_cleanup.append(on_cleanup)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--stats-file", default=None)
    ap.add_argument("--forward", choices=["loop", "thread"], default="loop",
                    help="run the forward pass on the event loop or in a worker thread")
    args = ap.parse_args()
    app = build_app(args.model_dir, args.threads, args.max_batch, args.max_delay_ms,
                    args.stats_file, args.forward)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()

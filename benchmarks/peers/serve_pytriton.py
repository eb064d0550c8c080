#!/usr/bin/env python3
"""Peer: NVIDIA Triton Inference Server driven by PyTriton (``nvidia-pytriton``).

Triton's dynamic batcher only merges requests whose input shapes are equal, so
with true lengths most batches hold one item (unless two requests of the same
length meet in the queue); with client-side padding to 128 every request has
shape [1, 128] and batches fill up.  The inference callable uses PyTriton's
``@batch`` decorator (concatenate along dim 0), runs the shared tagger and
returns [B, T, 9]; un-padding a client-padded item happens in the client.

Run inside ``.venvs/pytriton``::

    python serve_pytriton.py --model-dir DIR --port 8000 --grpc-port 8001 --metrics-port 8002

Set-up fact: Triton's Python-backend stub embeds libpython; it must find *this*
interpreter's libpython3.11, otherwise the model fails to load with
``AttributeError: ... '_recursion_count'``.  This script puts
``sysconfig.get_config_var("LIBDIR")`` on ``LD_LIBRARY_PATH`` (re-exec'ing
itself once) before starting Triton.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import sysconfig
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _ensure_libpython_on_ld_path() -> None:
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir in paths:
        return
    os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *paths])
    os.execv(sys.executable, [sys.executable, *sys.argv])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stats-file", default=None)
    args = ap.parse_args()
    _ensure_libpython_on_ld_path()

    import numpy as np
    from common import BatchStats, load_tagger, run_batch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = load_tagger(args.model_dir, threads=args.threads)
    stats = BatchStats(args.stats_file)

    @batch
    def infer(input_ids: np.ndarray, attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        stats.record(input_ids.shape[0])
        return {"logits": run_batch(model, input_ids, attention_mask)}

    config = TritonConfig(http_address="127.0.0.1", http_port=args.port,
                          grpc_address="127.0.0.1", grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, exit_timeout_secs=5)
    triton = Triton(config=config)
    triton.bind(
        model_name="tagger",
        infer_func=infer,
        inputs=[Tensor(name="input_ids", dtype=np.int64, shape=(-1,)),
                Tensor(name="attention_mask", dtype=np.int64, shape=(-1,))],
        outputs=[Tensor(name="logits", dtype=np.float32, shape=(-1, 9))],
        config=ModelConfig(
            max_batch_size=args.max_batch,
            batcher=DynamicBatcher(max_queue_delay_microseconds=int(args.max_delay_ms * 1000)),
        ),
        strict=False,
    )

    def _stop(signum, frame):  # SIGTERM -> same clean path as Ctrl-C
        threading.Thread(target=triton.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    try:
        triton.serve()
    finally:
        triton.stop()
        stats.flush()


if __name__ == "__main__":
    main()

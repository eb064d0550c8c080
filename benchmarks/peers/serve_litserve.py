#!/usr/bin/env python3
"""Peer: Lightning LitServe with request batching.

``LitAPI(max_batch_size=32, batch_timeout=<delay>)``: LitServe collects up to
``max_batch_size`` decoded requests (or until ``batch_timeout``) and hands the
list to :meth:`TaggerAPI.batch`, which right-pads them to the batch maximum and
builds the attention mask; :meth:`unbatch` slices every row back to its own
length.  One inference worker process, one API-server process (LitServe's
default layout on a CPU box), ``log_level=warning`` (no per-request log).

Protocol: ``POST /predict`` JSON ``{"input_ids": [...], "attention_mask": [...]}``
-> ``{"logits": [[9 floats] * L]}``.  Ready: ``GET /health`` -> 200.

Set-up fact: LitServe's SIGTERM handling stops the API server but can leave the
inference worker process(es) running; ``run.py`` therefore starts every peer
in its own session and kills the whole process tree by PID.

Run inside ``.venvs/litserve``::

    python serve_litserve.py --model-dir DIR --port 8000
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import litserve as ls
import numpy as np


class TaggerAPI(ls.LitAPI):
    def __init__(self, model_dir: str, threads: int, stats_file: str | None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_dir = model_dir
        self.threads = threads
        self.stats_file = stats_file

    def setup(self, device) -> None:
        from common import BatchStats, load_tagger

        self.model = load_tagger(self.model_dir, threads=self.threads)
        path = self.stats_file.format(pid=os.getpid()) if self.stats_file else None
        self.stats = BatchStats(path)

    def decode_request(self, request):
        ids = np.asarray(request["input_ids"], dtype=np.int64)
        mask = request.get("attention_mask")
        mask = np.ones_like(ids) if mask is None else np.asarray(mask, dtype=np.int64)
        return ids, mask

    def batch(self, inputs):
        lengths = [int(ids.shape[0]) for ids, _ in inputs]
        t = max(lengths)
        ids = np.zeros((len(inputs), t), dtype=np.int64)
        mask = np.zeros((len(inputs), t), dtype=np.int64)
        for i, (x, m) in enumerate(inputs):
            ids[i, : lengths[i]] = x
            mask[i, : lengths[i]] = m
        return ids, mask, lengths

    def predict(self, batch):
        from common import run_batch

        ids, mask, lengths = batch
        self.stats.record(ids.shape[0])
        return run_batch(self.model, ids, mask), lengths

    def unbatch(self, output):
        logits, lengths = output
        return [logits[i, :n] for i, n in enumerate(lengths)]

    def encode_response(self, output):
        return {"logits": output.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stats-file", default=None,
                    help="may contain {pid}; one file per inference worker")
    args = ap.parse_args()
    stats_file = str(Path(args.stats_file).resolve()) if args.stats_file else None
    api = TaggerAPI(str(Path(args.model_dir).resolve()), args.threads, stats_file,
                    max_batch_size=args.max_batch, batch_timeout=args.max_delay_ms / 1000.0)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning",
               generate_client_file=False)


if __name__ == "__main__":
    main()

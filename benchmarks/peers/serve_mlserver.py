#!/usr/bin/env python3
"""Peer: Seldon MLServer (1.7) with adaptive batching.

``python serve_mlserver.py --model-dir DIR --port 8080 ...`` (inside
``.venvs/mlserver``) writes ``settings.json`` + ``model-settings.json`` into a
scratch folder and execs ``mlserver start`` on it.  The model runtime is
:class:`TaggerRuntime` below (``implementation = serve_mlserver.TaggerRuntime``;
this folder is put on ``PYTHONPATH``).

Adaptive batching (``max_batch_size`` / ``max_batch_time``) merges requests by
concatenating their flattened ``data`` lists and summing the batch dimension of
the *first* request's shape: requests of different lengths produce a merged
tensor whose data does not fit its shape, so with true lengths any batch that
mixes lengths fails (HTTP 500) - only client padding to one length works.

Inference runs in MLServer's default parallel worker pool (``parallel_workers``
= 1, i.e. one separate inference process); ``debug`` is off so uvicorn writes no
access log.  Set-up fact: MLServer 1.7 does not start with uvloop >= 0.22
(``setup.sh`` pins ``uvloop<0.22``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

try:
    from mlserver import MLModel
    from mlserver.codecs import NumpyCodec
    from mlserver.types import InferenceRequest, InferenceResponse
except ImportError:  # allows `--help` / linting outside the mlserver venv
    MLModel = object  # type: ignore[assignment,misc]


class TaggerRuntime(MLModel):  # type: ignore[misc,valid-type]
    async def load(self) -> bool:
        from common import BatchStats, load_tagger

        extra = dict(self.settings.parameters.extra or {})
        self._model = load_tagger(extra["model_dir"], threads=int(extra.get("threads", 2)))
        stats_file = extra.get("stats_file")
        self._stats = BatchStats(stats_file.format(pid=os.getpid()) if stats_file else None)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        from common import run_batch

        tensors = {inp.name: NumpyCodec.decode_input(inp) for inp in payload.inputs}
        ids = tensors["input_ids"].astype("int64", copy=False)
        mask = tensors["attention_mask"].astype("int64", copy=False)
        if ids.ndim == 1:
            ids, mask = ids[None], mask[None]
        self._stats.record(ids.shape[0])
        logits = run_batch(self._model, ids, mask)
        return InferenceResponse(model_name=self.name,
                                 outputs=[NumpyCodec.encode_output("logits", logits)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--grpc-port", type=int, default=8081)
    ap.add_argument("--metrics-port", type=int, default=8082)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel-workers", type=int, default=1)
    ap.add_argument("--stats-file", default=None,
                    help="may contain {pid}; one file per inference process")
    ap.add_argument("--workdir", default=None, help="where to write the settings files")
    args = ap.parse_args()

    if args.workdir:
        work = Path(args.workdir).resolve()
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="peer-mlserver-"))
    (work / "settings.json").write_text(json.dumps({
        "debug": False,
        "host": "127.0.0.1",
        "http_port": args.port,
        "grpc_port": args.grpc_port,
        "metrics_port": args.metrics_port,
        "parallel_workers": args.parallel_workers,
    }))
    model_folder = work / "tagger"
    model_folder.mkdir()
    (model_folder / "model-settings.json").write_text(json.dumps({
        "name": "tagger",
        "implementation": "serve_mlserver.TaggerRuntime",
        "max_batch_size": args.max_batch,
        "max_batch_time": args.max_delay_ms / 1000.0,
        "parameters": {"extra": {
            "model_dir": str(Path(args.model_dir).resolve()),
            "threads": args.threads,
            "stats_file": str(Path(args.stats_file).resolve()) if args.stats_file else None,
        }},
    }))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    mlserver = shutil.which("mlserver", path=str(Path(sys.executable).parent)) or "mlserver"
    os.chdir(work)
    os.execve(mlserver, [mlserver, "start", str(work)], env)


if __name__ == "__main__":
    main()

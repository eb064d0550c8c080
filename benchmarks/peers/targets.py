"""The peers as targets of tensorserve's own load generator.

Every server of the comparison, tensorserve included, is measured by
``tensorserve_bench.loadgen.run_point`` through ``PeerTarget``: an
``HttpTarget`` (so the same raw HTTP client and the same ``send``) whose
requests are spelled in the peer's protocol (``protocols.py``). The window
rules are therefore those of ``tensorserve bench`` and of
``benchmarks/serving.py``: requests started inside the window count, the
window includes its drain, and the batch counters are read after each drain.

Counters come from tensorserve's ``GET /v2/models/tagger/stats`` or from the
JSON files the other peers' processes write (``common.BatchStats``); the
server tree's CPU seconds come from its ``ChildServer``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from protocols import PROTOCOLS, VOCAB_SIZE
from tensorserve_bench.items import FeatureSpec, Item
from tensorserve_bench.rawhttp import RawHttpPool
from tensorserve_bench.server import ChildServer
from tensorserve_bench.targets import Counters, HttpTarget

# The tagger's inputs, as every peer serves it (token ids and their mask).
TAGGER_SPECS = [
    FeatureSpec("input_ids", "int64", (-1,)),
    FeatureSpec("attention_mask", "int64", (-1,)),
]


def read_stats_files(pattern: str) -> dict[str, Any] | None:
    """One peer stats file, or the sum of several (a glob: one per worker process)."""
    paths = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    docs = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
    if not docs:
        return None
    hist: dict[str, int] = {}
    for doc in docs:
        for size, count in doc.get("hist", {}).items():
            hist[size] = hist.get(size, 0) + count
    return {
        "batches": sum(d.get("batches", 0) for d in docs),
        "items": sum(d.get("items", 0) for d in docs),
        "hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "files": len(docs),
    }


def counters_from_stats_files(pattern: str, settle: float = 0.25, limit: float = 3.0) -> Counters:
    """The peers' counters once they stop moving: each process flushes its file
    every 0.1 s, so the last batches of a drained window show up a little
    after it. Reads until two reads ``settle`` seconds apart agree."""
    deadline = time.monotonic() + limit
    last = read_stats_files(pattern)
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = read_stats_files(pattern)
        if now == last:
            break
        last = now
    if last is None:
        return Counters(padding_efficiency=None)
    return Counters(
        batches=int(last["batches"]),
        batch_items=int(last["items"]),
        padding_efficiency=None,  # the peers do not count padded elements
        histogram={str(k): int(v) for k, v in last["hist"].items()},  # exact batch sizes
    )


class PeerTarget(HttpTarget):
    """One peer server, one item per request, in the peer's protocol.

    ``pad_to``: the client pads every request to this many tokens (how
    Triton and MLServer are made to batch variable lengths). ``stats_file``:
    the peer's counters files (a glob); None reads tensorserve's stats
    endpoint. ``server``: the peer's process, for its CPU seconds.
    """

    kind = "http (peer)"

    def __init__(
        self,
        url: str,
        protocol: str,
        *,
        pad_to: int | None = None,
        stats_file: str | None = None,
        server: ChildServer | None = None,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(url, "tagger", timeout=timeout)
        self.peer_protocol = PROTOCOLS[protocol]  # self.protocol: tensorserve's own, unused
        self.content_type = self.peer_protocol.content_type
        self.infer_path = self.peer_protocol.path
        self.pad_to = pad_to
        self.stats_file = stats_file
        self.server = server
        self.specs = list(TAGGER_SPECS)
        self.parameters = {"vocab_size": VOCAB_SIZE}

    async def discover(self) -> None:
        pass  # every peer serves the same tagger: its inputs are known

    def encode_body(self, items: Sequence[Item]) -> tuple[bytes, Mapping[str, str]]:
        if len(items) != 1:
            raise ValueError("the peer protocols carry one item per request")
        body, headers = self.peer_protocol.encode(items[0]["input_ids"], self.pad_to)
        # identity: no peer may spend CPU gzip-ing responses the others send raw
        return body, {"Accept-Encoding": "identity", **headers}

    async def counters(self) -> Counters:
        if self.stats_file is None:
            counters = await super().counters()
        else:
            counters = await asyncio.to_thread(counters_from_stats_files, self.stats_file)
        if self.server is not None:
            counters = dataclasses.replace(counters, server_cpu_s=self.server.usage().cpu_s)
        return counters

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.url,
            "protocol": self.peer_protocol.name,
            "pad_to": self.pad_to,
        }

    async def check(self, reference: Any, items: Sequence[Any], tolerance: float) -> dict[str, Any]:
        """Correctness: a fixed request alone, then the rest as a concurrent
        burst (so padding really happens), each answer decoded and compared
        with the model run alone on that item."""
        import numpy as np

        assert self._raw is not None, "open() first"
        raw: RawHttpPool = self._raw

        async def one(ids: np.ndarray) -> tuple[float | None, str | None]:
            body, headers = self.encode_body([{"input_ids": ids}])
            request = raw.request(self.infer_path, body, self.content_type, headers)
            try:
                response = await asyncio.wait_for(raw.exchange(request), self.timeout)
                if response.status != 200:
                    return None, f"HTTP {response.status}: {response.body[:160]!r}"
                out = self.peer_protocol.decode(response.body, response.headers, int(ids.shape[0]))
            except Exception as exc:  # noqa: BLE001 - any failure is that request's
                return None, f"{type(exc).__name__}: {exc}"[:200]
            want = reference.logits(ids)
            if out.shape != want.shape:
                return None, f"shape {out.shape} != {want.shape}"
            return float(np.max(np.abs(out - want))), None

        single = await one(items[0])
        outcomes = [single, *await asyncio.gather(*(one(ids) for ids in items[1:]))]
        diffs = [d for d, _ in outcomes if d is not None]
        errors = [e for _, e in outcomes if e is not None]
        return {
            "single_max_abs_diff": single[0],
            "single_error": single[1],
            "max_abs_diff": max(diffs) if diffs else None,
            "n": len(items),
            "failed": len(errors),
            "errors": errors[:3],
            "ok": bool(diffs) and max(diffs) <= tolerance and not errors,
        }

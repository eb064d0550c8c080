"""The peer comparison's pieces that run without the peers installed: how a
peer's counters are read, and how its requests are spelled for the shared
load generator (benchmarks/peers/targets.py)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"


@pytest.fixture(scope="module")
def peers() -> Iterator[ModuleType]:
    """benchmarks/peers/targets.py, imported as run.py imports it."""
    sys.path.insert(0, str(PEERS))
    try:
        import targets

        yield targets
    finally:
        sys.path.remove(str(PEERS))
        for name in ("targets", "protocols"):  # top-level names: leave none behind
            sys.modules.pop(name, None)


def test_counters_sum_the_worker_files_once_they_stop_moving(peers, tmp_path: Path) -> None:
    (tmp_path / "w-1.json").write_text(json.dumps({"batches": 2, "items": 10, "hist": {"5": 2}}))
    late = tmp_path / "w-2.json"
    late.write_text(json.dumps({"batches": 1, "items": 3, "hist": {"3": 1}}))
    # A worker flushes its last batch a moment after the drain.
    flush = threading.Timer(
        0.1, late.write_text, [json.dumps({"batches": 2, "items": 8, "hist": {"3": 1, "5": 1}})]
    )
    flush.start()
    counters = peers.counters_from_stats_files(str(tmp_path / "w-*.json"), settle=0.15)
    flush.join()
    assert (counters.batches, counters.batch_items) == (4, 18)
    assert counters.histogram == {"3": 1, "5": 3}
    assert counters.padding_efficiency is None  # the peers do not count padded elements


async def test_a_peer_request_is_its_protocol_one_item_and_no_compression(peers) -> None:
    target = peers.PeerTarget("http://127.0.0.1:9", "kserve-binary", pad_to=16)
    await target.open()  # no discovery: the tagger's inputs are known
    try:
        item = {"input_ids": np.arange(1, 6), "attention_mask": np.ones(5, np.int64)}
        request = target.encode([item])
        head, _, body = request.partition(b"\r\n\r\n")
        assert head.startswith(b"POST /v2/models/tagger/infer HTTP/1.1")
        assert b"\r\nAccept-Encoding: identity" in head
        header_length = int(head.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
        header = json.loads(body[:header_length])
        assert header["inputs"][0]["shape"] == [1, 16]  # padded by the client
        assert len(body) == header_length + 2 * 16 * 8
        with pytest.raises(ValueError, match="one item per request"):
            target.encode([item, item])
    finally:
        await target.aclose()

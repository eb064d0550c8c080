"""Client-side cost of the native protocol per item: encoding a request and
decoding its answer, for a 512-token item (input_ids + attention_mask, int64)
whose answer is the tagger's logits (512 x 9 float32).

No server and no network: this is the CPU the Python client spends per item
on top of the HTTP exchange, to compare with the server's own per-item
overhead. Where tensorserve itself is importable, the server's codec for the
same bytes (decode_request + encode_response) is measured too.

    python benchmarks/client_codec.py            # prints a table
    # -> benchmarks/results/client_codec.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from tensorserve_client import _protocol
from tensorserve_client._protocol import Response

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = 512
LABELS = 9


def per_call_us(fn: Callable[[], Any], min_time: float = 0.1, repeats: int = 7) -> float:
    """The best of ``repeats`` mean times per call, in microseconds (the minimum:
    on a shared machine, noise only ever adds time)."""
    loops = 1
    while True:  # grow the loop until one repeat takes min_time
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            break
        loops *= 2
    samples = [elapsed / loops]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(loops):
            fn()
        samples.append((time.perf_counter() - t0) / loops)
    return min(samples) * 1e6


def item(kind: str) -> dict[str, Any]:
    ids = (np.arange(TOKENS, dtype=np.int64) * 31) % 4000 + 1
    mask = np.ones(TOKENS, dtype=np.int64)
    if kind == "lists":
        return {"input_ids": ids.tolist(), "attention_mask": mask.tolist()}
    if kind == "torch":
        import torch

        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    return {"input_ids": ids, "attention_mask": mask}


def answer_body(batch: int) -> bytes:
    logits = np.random.default_rng(0).standard_normal((TOKENS, LABELS), dtype=np.float32)
    wire = {"dtype": "float32", "shape": [TOKENS, LABELS], "data": logits.tobytes()}
    return msgpack.packb(
        {"model_name": "tagger", "model_version": "1", "outputs": [{"logits": wire}] * batch}
    )


def client_case(kind: str, batch: int, return_torch: bool = False) -> dict[str, float]:
    items = [item(kind)] * batch
    body = answer_body(batch)
    call = _protocol.infer("tagger", items, return_torch=return_torch)
    assert call.body is not None
    response = Response(200, _protocol.MSGPACK, body)
    assert len(call.complete(response)) == batch
    encode = per_call_us(lambda: _protocol.infer("tagger", items, return_torch=return_torch))
    decode = per_call_us(lambda: call.complete(response))
    return {
        "encode_us_per_item": encode / batch,
        "decode_us_per_item": decode / batch,
        "total_us_per_item": (encode + decode) / batch,
        "request_bytes_per_item": len(call.body) / batch,
        "response_bytes_per_item": len(body) / batch,
    }


def server_case(batch: int) -> dict[str, float] | None:
    """The server's codec on the same bytes, when tensorserve is importable."""
    try:
        from tensorserve.repository.config import load_config
        from tensorserve.wire import native
    except ImportError:
        return None
    config = load_config(RESULTS.parent.parent / "model_repository" / "tagger" / "config.toml")
    call = _protocol.infer("tagger", [item("numpy")] * batch)
    assert call.body is not None
    logits = np.random.default_rng(0).standard_normal((TOKENS, LABELS), dtype=np.float32)
    outputs = [{"logits": logits}] * batch
    body = call.body
    decode = per_call_us(lambda: native.decode_request(body, {}, config, 4096))
    request = native.decode_request(body, {}, config, 4096)
    encode = per_call_us(lambda: native.encode_response(request, outputs, "tagger", "1", config))
    return {
        "encode_us_per_item": encode / batch,  # the server encodes the answer
        "decode_us_per_item": decode / batch,  # and decodes the request
        "total_us_per_item": (encode + decode) / batch,
        "request_bytes_per_item": len(body) / batch,
        "response_bytes_per_item": len(answer_body(batch)) / batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batch", type=int, default=32, help="items per request for the batched rows"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "client_codec.json")
    args = parser.parse_args()

    cases: dict[str, dict[str, float] | None] = {
        "numpy, 1 item/request": client_case("numpy", 1),
        f"numpy, {args.batch} items/request": client_case("numpy", args.batch),
        "plain lists, 1 item/request": client_case("lists", 1),
    }
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        cases["torch in, numpy out, 1 item/request"] = client_case("torch", 1)
        cases["numpy in, torch out, 1 item/request"] = client_case("numpy", 1, return_torch=True)
    cases["server codec, 1 item/request"] = server_case(1)
    cases[f"server codec, {args.batch} items/request"] = server_case(args.batch)
    rows = {name: row for name, row in cases.items() if row is not None}

    print(
        f"Client codec cost per {TOKENS}-token item (tagger logits {TOKENS}x{LABELS} float32 back)"
    )
    print(f"{'case':<40} {'encode':>9} {'decode':>9} {'total':>9} {'req KiB':>8} {'resp KiB':>9}")
    for name, row in rows.items():
        print(
            f"{name:<40} {row['encode_us_per_item']:>7.1f}us {row['decode_us_per_item']:>7.1f}us "
            f"{row['total_us_per_item']:>7.1f}us {row['request_bytes_per_item'] / 1024:>8.1f} "
            f"{row['response_bytes_per_item'] / 1024:>9.1f}"
        )
    print("(server codec rows: encode = the answer, decode = the request)")
    report = {
        "tokens": TOKENS,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "machine": platform.machine(),
        "platform": sys.platform,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()

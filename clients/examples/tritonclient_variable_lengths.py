"""Variable-length requests to tensorserve with NVIDIA's own ``tritonclient``.

With Triton, a client batching sentences of different lengths must pad them
itself to one ``[k, T_max]`` tensor (and send an attention mask), because a
Triton batch is one dense tensor. With tensorserve, send each sentence, or
each group of same-length sentences, as its own ``[k, T]`` request, as many at
once as you like: the server pads rows of *different* requests together into
one batch and hands every request back its own un-padded ``[k, T, ...]``
outputs.

    pip install "tritonclient[http]"
    python clients/examples/tritonclient_variable_lengths.py --url localhost:8000
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np
import tritonclient.http as httpclient


def sentence_group(rng: np.random.Generator, rows: int, length: int) -> list[httpclient.InferInput]:
    """``rows`` token sequences of one ``length``: the inputs of one request."""
    ids = rng.integers(1, 4096, size=(rows, length), dtype=np.int64)
    mask = np.ones_like(ids)
    return [
        httpclient.InferInput("input_ids", [rows, length], "INT64").set_data_from_numpy(ids),
        httpclient.InferInput("attention_mask", [rows, length], "INT64").set_data_from_numpy(mask),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="host:port of tensorserve")
    parser.add_argument(
        "--model", default="tagger", help="a token model (input_ids, attention_mask)"
    )
    parser.add_argument("--requests", type=int, default=12, help="concurrent requests to send")
    args = parser.parse_args(argv)
    url = args.url.removeprefix("http://")  # tritonclient wants host:port

    rng = np.random.default_rng(0)
    with httpclient.InferenceServerClient(url, concurrency=args.requests) as client:
        server = client.get_server_metadata()
        print(f"{server['name']} {server['version']}: {', '.join(server['extensions'])}")
        metadata = client.get_model_metadata(args.model)
        for tensor in metadata["inputs"] + metadata["outputs"]:
            print(f"  {tensor['name']}: {tensor['datatype']} {tensor['shape']}")  # -1: any size

        # One request: 3 rows of length 12 form a dense [3, 12] tensor.
        result = client.infer(args.model, sentence_group(rng, 3, 12))
        logits = result.as_numpy("logits")
        print(f"one request of [3, 12] -> logits {list(logits.shape)}")

        # Many requests at once, each with its own length: no client-side padding.
        shapes = [
            (int(rng.integers(1, 4)), int(rng.integers(3, 100))) for _ in range(args.requests)
        ]
        pending = [
            client.async_infer(args.model, sentence_group(rng, rows, length), request_id=str(i))
            for i, (rows, length) in enumerate(shapes)
        ]
        for (rows, length), request in zip(shapes, pending):
            result = request.get_result()
            logits = result.as_numpy("logits")
            assert logits.shape[:2] == (rows, length), (logits.shape, rows, length)
            print(
                f"request {result.get_response()['id']:>2}: [{rows}, {length:>2}] -> "
                f"logits {list(logits.shape)}"
            )

        batching = client.get_inference_statistics(args.model)["model_stats"][0]["batching"]
        print(
            f"server side: {batching['total_items']} rows in {batching['total_batches']} batches, "
            f"padding efficiency {batching['padding_efficiency']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

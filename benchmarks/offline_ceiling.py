#!/usr/bin/env python3
"""What a bundled model does with no server at all: its items/s run offline,
the same items as the front-end benchmark (one per request there, lengths
uniform 8..128), padded by tensorserve's own collator and run by its own
executor on this thread, with every CPU for torch's intra-op threads.

    python benchmarks/offline_ceiling.py [--model tagger] [--repository model_repository]
    # prints one JSON object: items/s for length-sorted batches of 8 (the
    # issue's "offline ceiling") and for FIFO batches of 32

benchmarks/frontend.py runs it from each source tree beside the tagger's
HTTP runs, so the ratio server / offline comes from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tensorserve_bench.items import ItemFactory, specs_from_config
from tensorserve_bench.lengths import uniform

from tensorserve.serving.model import ServedModel

ITEMS = 2048


def items_per_s(model: ServedModel, items: list[dict], batch: int, sort: bool, seconds: float) -> float:
    order = sorted(items, key=lambda i: next(iter(i.values())).shape[0]) if sort else items
    batches = [order[k : k + batch] for k in range(0, len(order), batch)]
    executor, collator = model.executor, model.batcher.collator
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for chunk in batches:
            padded = collator.pad(model.validate(chunk))
            executor.collect(executor.launch(padded.features, 0))
            done += len(chunk)
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--model", default="tagger")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    model = ServedModel.from_repository(args.repository, args.model, isolation="thread")
    torch.set_num_threads(threads)  # this thread runs the batches: every CPU for torch
    factory = ItemFactory(specs_from_config(model.config.model_dump()), uniform(8, 128), seed=0)
    items, _ = factory.make(ITEMS)
    items_per_s(model, items[:64], 8, True, 0.5)  # warm up
    print(json.dumps({
        "model": args.model, "torch_threads": threads,
        "sorted_8_items_s": items_per_s(model, items, 8, True, args.seconds),
        "fifo_32_items_s": items_per_s(model, items, 32, False, args.seconds),
    }))


if __name__ == "__main__":
    main()

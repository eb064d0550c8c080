"""Instructions the scheduler process of ``--frontends N`` executes per
front-end request, counted by callgrind: a figure a busy 2-core VM cannot
blur, for changes too small for wall-clock A/Bs (``frontends_ab.py``,
``scheduler_ceiling.py``: +-10-20% between pairs there).

The work is the scheduler process's own, without sockets, threads or a
model: messages of one-item requests (a run of ``--run`` and the rest alone,
16 a message, as a front end sends them: ``protocol.in_runs``) admitted by
the hub's ``Intake`` into a real ``Batcher`` and scheduler, each batch "run"
by an instance that answers on the next loop iteration, every reply
delivered to a stub front end. Each tree runs twice (``--messages``, few
and many) under ``valgrind --tool=callgrind``; the difference over the
difference in requests is the count per request, without start-up.

    python benchmarks/scheduler_instructions.py --tree /tmp/base .   # ~20 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PER_MESSAGE = 16


def workload(messages: int, run: int) -> None:
    import numpy as np

    from tensorserve.batching.admission import BatcherOptions
    from tensorserve.batching.batcher import Batcher
    from tensorserve.batching.collate import Collator
    from tensorserve.frontends.intake import Intake
    from tensorserve.frontends.protocol import in_runs
    from tensorserve.repository.config import parse_config

    config = {
        "max_batch_size": 64,
        "input": [{"name": "x", "dtype": "float32", "shape": [-1], "pad_value": 0.0}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1], "unpad_like": "x"}],
    }

    @dataclass
    class Outputs:
        batched: dict[str, Any]
        per_item: None = None
        parameters: None = None
        seconds: None = None

    class Instance:
        overlaps, instance_count, pin_memory, restarts, restart_seconds = True, 1, False, 0, None

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

        def attach(self, loop: Any, lost: Any) -> None: ...
        def detach(self) -> None: ...
        def abort(self, launched: Any, because: str) -> bool:
            return True

        def repair(self, instance: int) -> None: ...
        def health(self) -> None: ...
        def free_memory_bytes(self) -> None: ...
        def close(self) -> None: ...

        def dispatch(self, features: Any, instance: int, parameters: Any, done: Any) -> int:
            self.loop.call_soon(done, Outputs({"y": np.asarray(features["x"])}), None)
            return 1

    class Plane:  # what Intake reads of the data plane
        tracer = None

        def __init__(self, served: Any) -> None:
            self.registry = self
            self.served = served
            self.settings = None

        def ready_model(self, name: str, version: str) -> Any:
            return self.served

    class Generations:
        def current(self, name: str, served: Any, generation: int) -> bool:
            return True

    class FrontEnd:  # hub.Connection's part that replies
        def __init__(self) -> None:
            self.requests: dict[int, Any] = {}
            self.answered = 0

        def _answer(self, rids: Any) -> None:
            self.answered += sum(self.requests.pop(rid, None) is not None for rid in rids)

        def reply(self, rid: int, results: Any) -> None:
            self._answer([rid])

        def reply_rows(self, rids: Any, rows: Any) -> None:
            self._answer(rids)

        def reply_many(self, replies: Any) -> None:
            self._answer([rid for rid, _ in replies])

        def fail(self, rid: int, exc: BaseException, **_: Any) -> None:
            raise SystemExit(f"request {rid} failed: {exc!r}")

    class Served:
        def __init__(self, batcher: Batcher) -> None:
            self.batcher = batcher

    async def main() -> None:
        loop = asyncio.get_running_loop()
        collator = Collator(parse_config(config, "flat"))
        options = BatcherOptions(max_batch_size=64, max_queue_delay_ms=0.0)
        batcher = Batcher(Instance(loop), collator, options, name="flat").start(loop)
        intake = Intake(Plane(Served(batcher)), loop, Generations(), lambda: None)  # type: ignore[arg-type]
        front_end = FrontEnd()
        lengths = np.random.default_rng(0).integers(8, 128, messages * PER_MESSAGE)
        rid = 0
        for _ in range(messages):
            entries, arrays = [], []
            for k in range(PER_MESSAGE):  # a run, then requests with a deadline each
                timeout = None if k < run else 30.0 + k
                entries.append([rid, "flat", "1", 1, timeout, 0, None, ["x"], 1, None, f"id-{rid}"])
                arrays.append(np.ones(int(lengths[rid]), np.float32))
                rid += 1
            intake.admit(front_end, in_runs(entries), arrays)  # type: ignore[arg-type]
            for _ in range(4):
                await asyncio.sleep(0)
        while front_end.answered < rid:
            await asyncio.sleep(0)

    asyncio.run(main())


def instructions(tree: Path, messages: int, run: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
             sys.executable, __file__, "--workload", str(messages), str(run)],
            env={**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONHASHSEED": "0"},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    found = re.search(r"Collected : (\d+)", result.stderr)
    assert found is not None, result.stderr[-2000:]
    return int(found.group(1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", nargs="+", type=Path, default=[Path(".")])
    parser.add_argument("--messages", nargs=2, type=int, default=[30, 130], metavar=("FEW", "MANY"))
    parser.add_argument("--run", type=int, default=13, help="requests in each message's run")
    parser.add_argument("--workload", nargs=2, type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workload:
        workload(*args.workload)
        return
    few, many = args.messages
    per_request = {}
    for tree in args.tree:
        counts = [instructions(tree, n, args.run) for n in (few, many)]
        per_request[tree] = (counts[1] - counts[0]) / ((many - few) * PER_MESSAGE)
        print(f"{tree}: {per_request[tree]:,.0f} instructions per request "
              f"(run of {args.run} in {PER_MESSAGE}; {counts})", flush=True)  # fmt: skip
    first = per_request[args.tree[0]]
    for tree in args.tree[1:]:
        print(f"{tree} / {args.tree[0]}: {per_request[tree] / first:.3f}")


if __name__ == "__main__":
    main()

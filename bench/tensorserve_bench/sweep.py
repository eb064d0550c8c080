"""A whole benchmark: for each variant (a model configuration), open a
target, build the same seeded pool of requests, and measure every load level.

    result = await run_bench(
        lambda variant: InProcessTarget("model_repository", "tagger", overrides=variant.overrides),
        variants=[Variant("fifo", {"policy": "fifo"}), Variant("length_aware", {"policy": "length_aware"})],
        lengths=uniform(8, 128), concurrency=[1, 32], duration=5,
    )
    result.save("results.json")
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tensorserve_bench.items import ItemFactory, length_summary, vocab_limit
from tensorserve_bench.lengths import LengthDistribution
from tensorserve_bench.loadgen import PointResult, PreparedRequest, Progress, run_point
from tensorserve_bench.results import machine_info, write_json
from tensorserve_bench.targets import Target

SCHEMA = 1


@dataclass(frozen=True)
class Variant:
    """A named set of model config overrides (``{"policy": "fifo"}``)."""

    name: str = "default"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResult:
    """Everything one run measured, as written to the JSON result."""

    settings: dict[str, Any]
    targets: list[dict[str, Any]]
    lengths: dict[str, Any]
    points: list[PointResult]
    machine: dict[str, Any] = field(default_factory=lambda: machine_info())
    created: str = field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    )
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["points"] = [p.to_dict() for p in self.points]
        return data

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        data = json.loads(Path(path).read_text())
        data["points"] = [PointResult.from_dict(p) for p in data["points"]]
        return cls(**data)


def build_pool(
    target: Target,
    lengths: LengthDistribution,
    *,
    items_per_request: int = 1,
    pool_items: int = 1024,
    seed: int = 0,
    max_id: int = 1000,
) -> tuple[list[PreparedRequest], dict[str, Any]]:
    """Pre-encoded requests for an opened ``target`` and a summary of their lengths.

    The same seed gives the same items for every target and variant.
    """
    if items_per_request < 1:
        raise ValueError("items_per_request must be >= 1")
    factory = ItemFactory(
        target.specs, lengths, seed=seed, id_range=(1, vocab_limit(target.parameters, max_id))
    )
    requests = max(1, -(-pool_items // items_per_request))
    items, drawn = factory.make(requests * items_per_request)
    pool = [
        PreparedRequest(target.encode(items[i : i + items_per_request]), items_per_request)
        for i in range(0, len(items), items_per_request)
    ]
    summary = {"distribution": lengths.describe(), **length_summary(drawn)}
    return pool, summary


async def run_bench(
    make_target: Callable[[Variant], Target],
    *,
    lengths: LengthDistribution,
    variants: Sequence[Variant] = (Variant(),),
    mode: str = "closed",
    concurrency: Sequence[int] = (1, 8, 32, 64),
    rates: Sequence[float] = (),
    duration: float = 10.0,
    warmup: float = 2.0,
    items_per_request: int = 1,
    pool_items: int = 1024,
    seed: int = 0,
    max_id: int = 1000,
    max_outstanding: int = 1024,
    progress: Progress | None = None,
    on_point: Callable[[PointResult], None] | None = None,
) -> BenchResult:
    """Every variant at every load level: ``concurrency`` for the closed loop,
    ``rates`` (requests/s) for the open loop."""
    levels: list[tuple[int, float | None]]
    if mode == "closed":
        levels = [(int(c), None) for c in concurrency]
    elif mode == "open":
        if not rates:
            raise ValueError("open loop needs at least one rate")
        levels = [(1, float(r)) for r in rates]
    else:
        raise ValueError(f"mode must be 'closed' or 'open', not {mode!r}")
    points: list[PointResult] = []
    described: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for variant in variants:
        target = make_target(variant)
        await target.open()
        try:
            described.append({"variant": variant.name, **target.describe()})
            pool, summary = build_pool(
                target,
                lengths,
                items_per_request=items_per_request,
                pool_items=pool_items,
                seed=seed,
                max_id=max_id,
            )
            for workers, rate in levels:
                point = await run_point(
                    target,
                    pool,
                    mode=mode,
                    concurrency=workers,
                    rate=rate,
                    duration=duration,
                    warmup=warmup,
                    variant=variant.name,
                    seed=seed,
                    max_outstanding=max_outstanding,
                    progress=progress,
                )
                points.append(point)
                if on_point is not None:
                    on_point(point)
        finally:
            await target.aclose()
    settings = {
        "mode": mode,
        "concurrency": list(concurrency) if mode == "closed" else None,
        "rates": list(rates) if mode == "open" else None,
        "duration_s": duration,
        "warmup_s": warmup,
        "items_per_request": items_per_request,
        "pool_items": pool_items,
        "seed": seed,
        "max_id": max_id,
        "variants": [asdict(v) for v in variants],
    }
    return BenchResult(settings=settings, targets=described, lengths=summary, points=points)

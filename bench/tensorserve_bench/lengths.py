"""Where the benchmark's variable-axis lengths come from.

    "8:128"          uniform integers in [8, 128], both ends included
    "64"             every item has length 64
    "lengths.txt"    sampled from the file's values (one length per line;
                     blank lines and ``#`` comments are skipped), so a file
                     of real traffic lengths reproduces its distribution

Pure and seeded: the same spec and seed give the same lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthDistribution:
    """Integers ``low..high`` (uniform), or draws from ``values`` when given."""

    low: int
    high: int
    values: tuple[int, ...] | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"lengths must satisfy 1 <= low <= high, got {self.low}:{self.high}")

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.values is not None:
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=count)
        return rng.integers(self.low, self.high, size=count, endpoint=True, dtype=np.int64)

    def describe(self) -> str:
        if self.values is not None:
            return f"{self.source} ({len(self.values)} lengths, {self.low}..{self.high})"
        return f"uniform {self.low}..{self.high}" if self.low != self.high else f"fixed {self.low}"


def uniform(low: int, high: int) -> LengthDistribution:
    return LengthDistribution(low, high, source=f"{low}:{high}")


def from_values(values: list[int], source: str = "values") -> LengthDistribution:
    if not values:
        raise ValueError(f"{source}: no lengths")
    bad = [v for v in values if v < 1]
    if bad:
        raise ValueError(f"{source}: lengths must be >= 1, got {bad[0]}")
    return LengthDistribution(min(values), max(values), tuple(values), source)


def read_lengths_file(path: str | Path) -> LengthDistribution:
    """One positive integer per line; ``#`` starts a comment."""
    values = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            values.append(int(text))
        except ValueError:
            raise ValueError(f"{path}:{number}: expected an integer length, got {text!r}") from None
    return from_values(values, str(path))


def parse_lengths(spec: str) -> LengthDistribution:
    """``LOW:HIGH``, a single length, or the path of a lengths file."""
    text = spec.strip()
    if ":" in text and all(part.strip().isdigit() for part in text.split(":", 1)):
        low, high = (int(part) for part in text.split(":", 1))
        return uniform(low, high)
    if text.isdigit():
        return uniform(int(text), int(text))
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--lengths {spec!r}: not LOW:HIGH, a length, or an existing file")
    return read_lengths_file(path)

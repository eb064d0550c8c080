from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tensorserve_bench.lengths import parse_lengths, read_lengths_file, uniform


def test_uniform_spec_covers_both_ends() -> None:
    dist = parse_lengths("8:12")
    drawn = dist.sample(np.random.default_rng(0), 2000)
    assert set(drawn.tolist()) == {8, 9, 10, 11, 12}


def test_single_number_is_a_fixed_length() -> None:
    assert set(parse_lengths("64").sample(np.random.default_rng(0), 50).tolist()) == {64}


def test_file_lengths_are_sampled_from_its_values(tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("# real traffic\n17\n\n33  # long\n17\n")
    dist = parse_lengths(str(path))
    assert (dist.low, dist.high) == (17, 33)
    drawn = dist.sample(np.random.default_rng(1), 1000).tolist()
    assert set(drawn) == {17, 33}
    assert 0.55 < drawn.count(17) / len(drawn) < 0.78  # 17 appears twice in the file


def test_same_seed_same_lengths() -> None:
    dist = uniform(1, 1000)
    a = dist.sample(np.random.default_rng(7), 20)
    b = dist.sample(np.random.default_rng(7), 20)
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("spec", ["0:10", "10:5", "no-such-file.txt"])
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_lengths(spec)


def test_bad_line_is_reported_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "lengths.txt"
    path.write_text("12\ntwelve\n")
    with pytest.raises(ValueError, match=r"lengths.txt:2"):
        read_lengths_file(path)

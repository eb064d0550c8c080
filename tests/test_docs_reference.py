"""docs/configuration.md's reference is the code's: every server setting and
every config.toml field, with its default, bounds and description, as
scripts/config_reference.py writes them. A field added, renamed or changed
without regenerating the page fails here."""

from __future__ import annotations

import importlib.util
import re

from tensorserve.repository.config import DynamicBatching, InputSpec, InstanceGroup, ModelConfig
from tensorserve.settings import Settings
from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
assert spec is not None and spec.loader is not None
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)

PAGE = (ROOT / "docs" / "configuration.md").read_text()


def test_the_page_holds_the_generated_reference() -> None:
    assert reference.page_with(PAGE, reference.reference()) == PAGE, (
        "docs/configuration.md is stale: run python scripts/config_reference.py --write"
    )


def test_every_setting_and_field_is_on_the_page() -> None:
    for name in Settings.model_fields:
        assert f"`TENSORSERVE_{name.upper()}`" in PAGE, name
    for model in (ModelConfig, DynamicBatching, InstanceGroup, InputSpec):
        for name in model.model_fields:
            assert f"| `{name}` |" in PAGE, f"{model.__name__}.{name}"


def test_bounds_and_defaults_are_shown() -> None:
    row = next(line for line in PAGE.splitlines() if line.startswith("| `port` |"))
    assert "`8000`" in row and ">= 0, <= 65,535" in row
    row = next(line for line in PAGE.splitlines() if line.startswith("| `max_batch_size` | int |"))
    assert "`32`" in row and "<= 65,536" in row
    assert re.search(r"\| `count` \| int \| `1` \| >= 1, <= 16 \|", PAGE)

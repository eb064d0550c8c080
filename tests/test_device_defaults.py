"""What a config's batching left to the server becomes on each device
(``repository/device_defaults.for_device``, issue 34 item 3): the device is
passed in, so both kinds are tested here without a GPU."""

from __future__ import annotations

from typing import Any

import pytest

from tensorserve import ServedModel
from tensorserve.batching.budget import LearntBudget
from tensorserve.batching.policy import budget_report, make_policy
from tensorserve.repository.config import DEFAULT_MAX_LENGTH, ModelConfig, load_config, parse_config
from tensorserve.repository.device_defaults import for_device, full_batch_volume
from tests.conftest import REPOSITORY, ROOT

EXAMPLES = ROOT / "examples" / "model_repository"
BUNDLED = sorted(path.parent.name for path in REPOSITORY.glob("*/config.toml"))


def bundled(name: str) -> ModelConfig:
    """A model of the default repository, or of the examples' (tagger_onnx)."""
    folder = REPOSITORY / name if (REPOSITORY / name).is_dir() else EXAMPLES / name
    return load_config(folder / "config.toml")


def tokens(max_batch_size: int = 32, max_length: int | None = 512, **fields: Any) -> ModelConfig:
    batching = {k: fields.pop(k) for k in ("max_batch_tokens", "pad_to_multiple_of") if k in fields}
    return parse_config({
        "max_batch_size": max_batch_size,
        "input": [{"name": "ids", "dtype": "int64", "shape": [-1], "max_length": max_length},
                  {"name": "mask", "dtype": "int64", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
        "dynamic_batching": batching,
        **fields,
    }, "test")


def resolved(config: ModelConfig, device: str) -> tuple[Any, Any]:
    batching = for_device(config, device).dynamic_batching
    return batching.max_batch_tokens, batching.pad_to_multiple_of


# ---------------------------------------------------------------------- on a CPU
@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_model_ships_auto_and_on_a_cpu_keeps_todays_learnt_budget(name: str) -> None:
    """On the CPU nothing changes: "auto" is the learnt budget (what every
    bundled model but the tagger had; the tagger's hand-set 1024 served no
    better than it, docs/performance.md), no rounding of lengths."""
    config = bundled(name)
    assert config.dynamic_batching.max_batch_tokens == "auto"
    assert for_device(config, "cpu") == config
    assert resolved(config, "cpu") == ("auto", None)
    assert isinstance(make_policy("length_aware", "auto").budget, LearntBudget)


def test_on_a_cpu_what_a_config_sets_is_kept() -> None:
    assert resolved(tokens(max_batch_tokens=1024, pad_to_multiple_of=16), "cpu") == (1024, 16)
    assert resolved(tokens(max_batch_tokens=0), "cpu") == (0, None)


# ---------------------------------------------------------------------- on a GPU
def test_on_a_gpu_auto_is_a_budget_of_full_batches_and_lengths_round_to_8() -> None:
    tagger = bundled("tagger")
    assert resolved(tagger, "cuda") == (32 * 512, 8)
    # The budget never cuts a batch of max_batch_size items of full length.
    assert full_batch_volume(tagger) == tagger.max_batch_size * tagger.input[0].max_length


@pytest.mark.parametrize(
    "name, budget",
    [("attention_tagger", 32 * 512), ("embedder", 32 * 512), ("tagger_onnx", 32 * 512),
     ("gru_tagger", 32 * DEFAULT_MAX_LENGTH),  # no max_length: the server's limit
     ("image_filter", 1 << 26)],  # 16 x 65536 x 65536: held to max_batch_elements
)
def test_each_bundled_model_gets_a_gpu_budget_from_its_own_shapes(name: str, budget: int) -> None:
    assert resolved(bundled(name), "cuda") == (budget, 8)


def test_torch_compiles_cuda_graphs_get_coarser_length_buckets() -> None:
    """64-token buckets under max-autotune: a tagger of max_length 512 is
    captured at 8 lengths per batch size, not at up to 512. The server's own
    graphs (auto, reduce-overhead) round up to their power-of-two buckets
    themselves (runtime/graph_buckets.py): 8, as without graphs."""
    assert resolved(tokens(compile="max-autotune"), "cuda") == (32 * 512, 64)
    for mode in ("default", "reduce-overhead", "auto", "off"):
        assert resolved(tokens(compile=mode), "cuda") == (32 * 512, 8)


def test_on_a_gpu_what_a_config_sets_is_kept_too() -> None:
    assert resolved(tokens(max_batch_tokens=1024), "cuda") == (1024, 8)
    assert resolved(tokens(max_batch_tokens=0), "cuda") == (0, 8)  # 0: no budget, as asked
    assert resolved(tokens(pad_to_multiple_of=1, compile="max-autotune"), "cuda") == (16384, 1)
    assert resolved(tokens(pad_to_multiple_of=32), "cuda") == (16384, 32)


def test_a_model_without_variable_axes_gets_its_batch_size_as_the_budget() -> None:
    config = parse_config({
        "max_batch_size": 64,
        "input": [{"name": "x", "dtype": "float32", "shape": [4]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [4]}],
    }, "test")
    assert resolved(config, "cuda") == (64, 8)
    assert full_batch_volume(config.model_copy(update={"max_batch_size": 0})) == 1


def test_the_resolution_is_pure_and_leaves_the_rest_of_the_config_alone() -> None:
    config = tokens(compile="max-autotune")
    gpu = for_device(config, "cuda")
    assert config.dynamic_batching.max_batch_tokens == "auto"  # the argument is untouched
    assert for_device(config, "cuda") == gpu  # the same answer every time
    assert for_device(gpu, "cuda") == gpu  # and resolving twice changes nothing
    assert gpu.model_dump(exclude={"dynamic_batching"}) == config.model_dump(exclude={"dynamic_batching"})
    assert gpu.dynamic_batching.model_dump(exclude={"max_batch_tokens", "pad_to_multiple_of"}) == (
        config.dynamic_batching.model_dump(exclude={"max_batch_tokens", "pad_to_multiple_of"}))


# ---------------------------------------------------------------------- where it is applied
def test_a_served_model_batches_with_its_devices_resolution() -> None:
    """ServedModel resolves the config for the device it runs on: on this
    CPU the tagger learns its budget and pads to its longest item."""
    with ServedModel.from_repository(REPOSITORY, "tagger", isolation="thread") as tagger:
        assert tagger.device.type == "cpu"
        assert budget_report(tagger.batcher.options.policy)["mode"] == "learnt"
        assert tagger.batcher.collator.pad_to_multiple_of is None


def test_a_model_resolved_to_a_gpu_batches_with_the_gpus_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device type ServedModel resolved is the one passed: told its device
    is a GPU (the batch function still runs here, on the CPU), the batcher
    takes full batches and rounds lengths up to 8."""
    import numpy as np
    import torch

    import tensorserve.serving.model as served_model

    monkeypatch.setattr(served_model, "resolve_device", lambda name: torch.device("cuda"))
    model = ServedModel.from_function(
        lambda ids, mask: ids.to(torch.float32) * 2,
        inputs=[{"name": "ids", "dtype": "int64", "shape": [-1], "max_length": 64},
                {"name": "mask", "dtype": "int64", "shape": [-1]}],
        outputs=[{"name": "y", "dtype": "float32", "shape": [-1]}],
        max_batch_size=4,
    )
    with model:
        assert budget_report(model.batcher.options.policy) == {"mode": "fixed", "max_batch_tokens": 4 * 64}
        assert model.batcher.collator.pad_to_multiple_of == 8
        out = model.infer_sync({"ids": np.arange(5), "mask": np.ones(5, np.int64)})
    np.testing.assert_array_equal(out["y"], [0.0, 2.0, 4.0, 6.0, 8.0])  # un-padded from 8


# ---------------------------------------------------------------------- isolation on each device
ALL_MODELS = BUNDLED + sorted(path.parent.name for path in EXAMPLES.glob("*/config.toml"))


@pytest.mark.parametrize("name", ALL_MODELS)
def test_no_bundled_model_pins_a_worker_process_that_a_gpu_would_serialise(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every bundled model that runs where the server puts it leaves isolation
    to auto: a worker process on a CPU of 2 cores or more, a thread on a GPU
    (one per placement there), and a thread on one CPU."""
    import torch

    from tensorserve.runtime import placement
    from tensorserve.runtime.placement import place, resolve_isolation

    config = bundled(name)
    if config.device == "cpu":
        return  # never on a GPU: its own choice holds (the tokenizer's thread)
    assert config.isolation == "auto", f"{name}: {config.isolation}"
    monkeypatch.setattr(placement, "resolve_device", lambda d: torch.device("cpu" if d == "auto" else d))
    on_cpu = place(config, gpu_count=0)
    assert resolve_isolation(config, on_cpu, cpus=2).isolation == "process"
    assert resolve_isolation(config, on_cpu, cpus=1).isolation == "thread"
    for gpus in (1, 4):
        assert resolve_isolation(config, place(config, gpu_count=gpus), cpus=16).isolation == "thread"

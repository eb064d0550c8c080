"""Instance groups (Triton's ``instance_group``): which devices, how many
instances on each. The placement is pure and tested for any GPU count; the
serving path is tested on the CPU with two instances that must run at once."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorserve import ServedModel
from tensorserve.errors import ConfigError
from tensorserve.repository.config import parse_config
from tensorserve.runtime.placement import (
    PlacedExecutor,
    Placement,
    place,
    resolve_placement,
)
from tests.helpers import toy_config, write_model

SPEC = {
    "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
}


def config(**fields: object):  # type: ignore[no-untyped-def]
    return parse_config({**SPEC, **fields}, "toy/config.toml")


def test_two_instances_on_each_of_two_gpus() -> None:
    groups = [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}]
    assert place(config(instance_group=groups), gpu_count=2) == [
        Placement("cuda:0", 2),
        Placement("cuda:1", 2),
    ]


def test_gpus_unset_means_every_visible_gpu() -> None:
    cfg = config(instance_group=[{"kind": "KIND_GPU"}])
    assert [p.device for p in place(cfg, gpu_count=4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_kind_auto_is_every_gpu_or_the_cpu() -> None:
    cfg = config(instance_group=[{"count": 3}])
    assert place(cfg, gpu_count=2) == [Placement("cuda:0", 3), Placement("cuda:1", 3)]
    assert place(cfg, gpu_count=0) == [Placement("cpu", 3)]


@pytest.mark.parametrize("gpu_count", [0, 1, 4])
def test_device_auto_without_groups_is_an_implicit_kind_auto_group(gpu_count: int) -> None:
    """Triton's default: instance_count instances on every visible GPU, else
    on the CPU (where the placement stays "auto", so the server warns)."""
    placements = place(config(instance_count=2), gpu_count=gpu_count)
    if gpu_count == 0:
        assert placements == [Placement("auto", 2)]
    else:
        assert placements == [Placement(f"cuda:{g}", 2) for g in range(gpu_count)]


@pytest.mark.parametrize("gpu_count", [0, 1, 4])
@pytest.mark.parametrize("device", ["cpu", "cuda:1"])
def test_an_explicit_device_keeps_its_one_placement(device: str, gpu_count: int) -> None:
    assert place(config(device=device, instance_count=3), gpu_count=gpu_count) == [
        Placement(device, 3)
    ]


@pytest.mark.parametrize("gpu_count", [0, 1, 4])
def test_a_bare_cuda_is_every_visible_gpu(gpu_count: int) -> None:
    """Triton's KIND_GPU default; with no GPU it stays "cuda", which fails to
    load saying why CUDA is missing (resolve_device)."""
    placements = place(config(device="cuda", instance_count=3), gpu_count=gpu_count)
    if gpu_count == 0:
        assert placements == [Placement("cuda", 3)]
    else:
        assert placements == [Placement(f"cuda:{g}", 3) for g in range(gpu_count)]


@pytest.mark.parametrize("gpu_count", [1, 4])
def test_groups_still_limit_the_gpus_and_the_count(gpu_count: int) -> None:
    one = config(instance_group=[{"count": 2, "gpus": [0]}])
    assert place(one, gpu_count=gpu_count) == [Placement("cuda:0", 2)]
    every = config(instance_group=[{"count": 3}])
    assert place(every, gpu_count=gpu_count) == [
        Placement(f"cuda:{g}", 3) for g in range(gpu_count)
    ]
    assert place(config(instance_group=[{"kind": "KIND_CPU"}]), gpu_count=gpu_count) == [
        Placement("cpu", 1)
    ]


def test_the_servers_device_decides_before_the_implicit_group() -> None:
    """--device cpu pins a model left to auto to the CPU, --device cuda:1 to
    that GPU (with_default_device); --device cuda (the GPU image's) and auto
    leave every GPU to it."""
    auto = config(instance_count=2)
    assert place(auto.with_default_device("cpu"), gpu_count=4) == [Placement("cpu", 2)]
    assert place(auto.with_default_device("cuda:1"), gpu_count=4) == [Placement("cuda:1", 2)]
    every = [Placement(f"cuda:{g}", 2) for g in range(4)]
    assert place(auto.with_default_device("cuda"), gpu_count=4) == every
    assert place(auto.with_default_device("auto"), gpu_count=4) == every


@pytest.mark.parametrize(("gpu_count", "device"), [(0, "auto"), (1, "cuda:0")])
def test_auto_on_one_device_comes_back_as_that_device(gpu_count: int, device: str) -> None:
    resolved, placements = resolve_placement(config(instance_count=2), gpu_count=gpu_count)
    assert placements == [Placement(device, 2)]
    assert (resolved.device, resolved.instance_count) == (device, 2)
    resolved, placements = resolve_placement(config(instance_count=2), gpu_count=3)
    assert len(placements) == 3 and resolved.device == "auto"  # PlacedExecutor's or workers'


def test_groups_naming_the_same_device_add_up_and_keep_their_order() -> None:
    cfg = config(
        instance_group=[
            {"count": 1, "kind": "KIND_GPU", "gpus": [1]},
            {"count": 2, "kind": "KIND_CPU"},
            {"count": 2, "kind": "KIND_GPU", "gpus": [1, 0]},
        ]
    )
    assert place(cfg, gpu_count=2) == [
        Placement("cuda:1", 3),
        Placement("cpu", 2),
        Placement("cuda:0", 2),
    ]


def test_a_gpu_that_does_not_exist_is_a_config_error() -> None:
    cfg = config(instance_group=[{"kind": "KIND_GPU", "gpus": [0, 3]}])
    with pytest.raises(ConfigError, match=r"instance_group\[0\]: gpus \[3\] do not exist"):
        place(cfg, gpu_count=2)
    with pytest.raises(ConfigError, match="KIND_GPU needs a GPU"):
        place(config(instance_group=[{"kind": "KIND_GPU"}]), gpu_count=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"instance_group": [{"kind": "KIND_CPU", "gpus": [0]}]}, "not KIND_CPU"),
        ({"instance_group": [{"kind": "KIND_GPU", "gpus": [0, 0]}]}, "distinct"),
        ({"instance_group": [{"count": 0}]}, "instance_group[0].count"),
        ({"instance_group": [{"kind": "KIND_TPU"}]}, "instance_group[0].kind"),
        ({"instance_group": [{"count": 1}], "device": "cpu"}, "leave device and instance_count"),
        ({"instance_group": [{"count": 1}], "instance_count": 2}, "leave device"),
    ],
)
def test_bad_instance_groups_are_reported_by_field(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(**fields)


def test_a_server_wide_device_or_instance_count_replaces_the_groups() -> None:
    cfg = config(instance_group=[{"count": 2, "kind": "KIND_GPU"}])
    overridden = cfg.with_overrides(device="cpu")
    assert overridden.instance_group == [] and overridden.device == "cpu"
    assert cfg.with_overrides(max_batch_size=4).instance_group == cfg.instance_group


def test_one_device_becomes_the_plain_device_and_count() -> None:
    resolved, placements = resolve_placement(
        config(instance_group=[{"count": 1, "kind": "KIND_CPU"}, {"count": 1, "kind": "KIND_CPU"}])
    )
    assert placements == [Placement("cpu", 2)]
    assert (resolved.device, resolved.instance_count, resolved.instance_group) == ("cpu", 2, [])


# Two instances must be inside forward at the same moment, or both time out.
MEET_MODEL = """
import threading
import torch

MEETING = threading.Barrier(2, timeout=20)

class Model(torch.nn.Module):
    def forward(self, x):
        MEETING.wait()
        return x * 2
"""


def test_two_cpu_instances_from_instance_groups_run_at_once(tmp_path: Path) -> None:
    text = toy_config(
        {"x": {"dtype": "float32", "shape": [-1]}},
        {"y": {"dtype": "float32", "shape": [-1]}},
        max_batch_size=1,
        warmup={"enabled": False},
    )
    text += '[[instance_group]]\ncount = 2\nkind = "KIND_CPU"\n'
    write_model(tmp_path, "meet", text, MEET_MODEL)
    with ServedModel.from_repository(tmp_path, "meet") as model:
        assert model.executor.instance_count == 2
        assert model.config.device == "cpu"
        with ThreadPoolExecutor(2) as pool:
            rows = list(
                pool.map(
                    lambda v: model.infer_sync({"x": np.full(3, v, np.float32)}, timeout=30), [1, 2]
                )
            )
    assert [r["y"].tolist() for r in rows] == [[2, 2, 2], [4, 4, 4]]


MEETING = threading.Barrier(2, timeout=20)


class Meet(torch.nn.Module):
    """Records which copy of the model ran; two copies must meet in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0), requires_grad=False)
        self.copy_id = "original"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        MEETING.wait()
        SEEN.append((self.copy_id, threading.get_ident()))
        return x * self.scale


SEEN: list[tuple[str, int]] = []


def test_placed_executor_runs_one_model_copy_per_device() -> None:
    # Two "devices" that happen to be the CPU: the routing, the copies and
    # the batcher over a PlacedExecutor, as they run over two GPUs.
    SEEN.clear()
    module = Meet()
    cfg = config(max_batch_size=1, warmup={"enabled": False})
    executor = PlacedExecutor(module, cfg, [Placement("cpu", 1), Placement("cpu", 1)], 1)
    assert isinstance(executor, PlacedExecutor) and executor.instance_count == 2
    first, second = executor.models
    assert first is module and second is not module  # a deep copy, weights included
    second.copy_id = "copy"
    assert torch.equal(second.scale, module.scale)
    assert executor.devices() == [torch.device("cpu"), torch.device("cpu")]
    with ServedModel("meet", cfg, None, executor=executor) as model, ThreadPoolExecutor(2) as pool:
        rows = list(
            pool.map(
                lambda v: model.infer_sync({"x": np.full(2, v, np.float32)}, timeout=30), [1, 3]
            )
        )
    assert [r["y"].tolist() for r in rows] == [[2, 2], [6, 6]]
    assert sorted(copy for copy, _ in SEEN) == ["copy", "original"]  # each copy ran one batch
    assert len({thread for _, thread in SEEN}) == 2


def test_a_placed_executor_is_labelled_with_its_models_name() -> None:
    from tensorserve.runtime.kinds import ExecutorRequest, build_executor

    cfg = config(max_batch_size=1, warmup={"enabled": False})
    placements = [Placement("cpu", 1), Placement("cpu", 1)]
    request = ExecutorRequest("tagger", cfg, placements, 1, fn=lambda x: x)
    executor = build_executor("thread", request).executor
    assert isinstance(executor, PlacedExecutor)
    assert executor.label == "tagger"  # its logs and errors say model 'tagger', not 'model'


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_instances_on_two_gpus() -> None:  # pragma: no cover - GPU machines only
    cfg = config(
        max_batch_size=4, instance_group=[{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]
    )
    with ServedModel.from_function(
        lambda x: x * 2,
        inputs=SPEC["input"],
        outputs=SPEC["output"],
        instance_group=[{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}],
        device="auto",
    ) as model:
        assert model.executor.devices() == [torch.device("cuda:0"), torch.device("cuda:1")]
        assert model.infer_sync({"x": np.ones(3, np.float32)})["y"].tolist() == [2, 2, 2]
    assert cfg.instance_group[0].gpus == [0, 1]


def test_the_triton_config_reports_the_instance_groups() -> None:
    from tensorserve.wire.triton import model_config

    groups = [{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1]}, {"count": 1, "kind": "KIND_CPU"}]
    reported = model_config("m", config(instance_group=groups))["instance_group"]
    assert reported == [{**groups[0]}, {**groups[1], "gpus": None}]
    plain = model_config("m", config(device="cpu", instance_count=3))["instance_group"]
    assert plain == [{"count": 3, "kind": "KIND_CPU"}]

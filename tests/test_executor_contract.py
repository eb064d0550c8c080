"""Every executor implements the whole contract the batcher declares
(batching/executor.py), so nothing finds a method with ``getattr``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tensorserve.batching.executor import Executor, LoopExecutor, ThreadedExecutor
from tensorserve.runtime.executor import ThreadExecutor
from tensorserve.runtime.isolated import ProcessExecutor

PACKAGE = Path(__file__).resolve().parent.parent / "tensorserve"


def members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    for base in protocol.__mro__[1:]:
        if base is not object and getattr(base, "_is_protocol", False):
            names |= members(base)
    return names


def test_the_contract_names_what_the_scheduler_and_the_server_call() -> None:
    assert {"abort", "repair", "health", "restarts", "restart_seconds", "close", "pin_memory",
            "overlaps", "instance_count", "free_memory_bytes"} <= members(Executor)
    assert {"launch", "collect", "start_instance"} <= members(ThreadedExecutor)
    assert {"attach", "dispatch", "detach"} <= members(LoopExecutor)


@pytest.mark.parametrize(
    ("executor", "protocol"),
    [(ThreadExecutor, ThreadedExecutor), (ProcessExecutor, LoopExecutor)],
)
def test_every_executor_implements_every_member(executor: type, protocol: type) -> None:
    source = ast.parse(Path(__import__(executor.__module__, fromlist=["_"]).__file__).read_text())
    cls = next(n for n in source.body if isinstance(n, ast.ClassDef) and n.name == executor.__name__)
    defined = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    # Attributes set in __init__ (self.x = ...) count as implemented.
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    defined |= {
        t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
        for t in node.targets if isinstance(t, ast.Attribute)
    }
    defined |= {  # and annotated ones (self.x: T = ...)
        node.target.attr for node in ast.walk(init)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute)
    }
    missing = members(protocol) - defined
    assert not missing, f"{executor.__name__} lacks {sorted(missing)}"


def test_nothing_finds_an_executor_method_with_getattr() -> None:
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and "executor" in ast.unparse(node.args[0])):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders


def test_every_isolation_a_config_may_name_has_an_executor_kind() -> None:
    from typing import get_args

    from tensorserve.repository.config import ModelConfig
    from tensorserve.runtime.kinds import KINDS

    named = set(get_args(ModelConfig.model_fields["isolation"].annotation)) - {"auto"}
    assert named == set(KINDS)  # "auto" is resolved to one of them before a kind is built


def test_an_unknown_executor_kind_is_refused_naming_the_known_ones() -> None:
    from tensorserve.errors import ConfigError
    from tensorserve.repository.config import ModelConfig
    from tensorserve.runtime.kinds import ExecutorRequest, build_executor
    from tensorserve.runtime.placement import resolve_placement

    config, placements = resolve_placement(ModelConfig.model_validate({
        "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    }))
    with pytest.raises(ConfigError, match="no executor of kind 'onnx'; known: thread, process"):
        build_executor("onnx", ExecutorRequest("m", config, placements, 1, fn=lambda x: x))


def test_every_batch_runs_in_inference_mode_on_its_instance_thread_and_off_it() -> None:
    """The instance's thread enters inference mode once, for good
    (``DeviceContext.enter_thread``), not per batch; a launch on a thread
    that never entered it still runs the forward in inference mode."""
    import threading

    import torch

    from tensorserve.repository.config import ModelConfig

    seen: list[bool] = []

    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.is_inference_mode_enabled())
            return x * 2

    config = ModelConfig.model_validate({
        "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
        "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
    })  # fmt: skip
    executor = ThreadExecutor(Model(), config, torch.device("cpu"))

    def on_instance_thread() -> None:
        executor.start_instance(0)
        for _ in range(2):
            out = executor.collect(executor.launch({"x": torch.ones(2, 3)}, 0))
            assert out.batched is not None and out.batched["y"].tolist() == [[2.0] * 3] * 2
        assert torch.is_inference_mode_enabled()  # still on, between batches too

    thread = threading.Thread(target=on_instance_thread)
    thread.start()
    thread.join()
    executor.collect(executor.launch({"x": torch.ones(1, 3)}, 0))  # a thread that never entered
    # A later thread that never entered it (often given the ended one's id): still on.
    later = threading.Thread(target=lambda: executor.collect(executor.launch({"x": torch.ones(1, 3)}, 0)))
    later.start()
    later.join()
    assert seen == [True, True, True, True]
    assert not torch.is_inference_mode_enabled()  # this thread's mode was never left on

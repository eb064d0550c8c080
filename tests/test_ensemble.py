"""Ensembles (issue #39, item 3): the load-time checks of the step graph
(pure, exact sentences), the runner over in-process step models (a graph,
not a chain; a failing step fails only its callers, named; deadlines,
cancellation and parameters carry through), then the registry and every
protocol of an in-process app over a toy repository.

The step models are built so that a mistake shows: ``double`` and ``plus``
compute values a wrong row, a dropped step or a step run twice would
change, and the graph test's two middle steps can only finish if they run
at the same time.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorserve import ServedModel
from tensorserve.ensemble import Candidate, Ensemble, plan_ensemble
from tensorserve.errors import ConfigError, DeadlineExceeded, InvalidInput, ModelFailure
from tensorserve.http.app import create_app
from tensorserve.repository.config import ModelConfig, parse_config
from tensorserve.settings import Settings
from tests.helpers import MSGPACK, Gate, body, from_wire, tensor, toy_config, wait_until_async

# -- the graph's checks (pure) --------------------------------------------------

TOKENIZER = {
    "input": [{"name": "TEXT", "dtype": "bytes", "shape": [1]}],
    "output": [
        {"name": "ids", "dtype": "int64", "shape": [-1], "ragged": True},
        {"name": "mask", "dtype": "int64", "shape": [-1], "ragged": True},
    ],
}
TAGGER = {
    "input": [
        {"name": "ids", "dtype": "int64", "shape": [-1]},
        {"name": "mask", "dtype": "int64", "shape": [-1]},
    ],
    "output": [{"name": "logits", "dtype": "float32", "shape": [-1, 3]}],
}


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str], **more: Any) -> dict:
    return {"model_name": model, "input_map": inputs, "output_map": outputs, **more}


def _ensemble(steps: list[dict], output_shape: list[int] | None = None) -> dict[str, Any]:
    return {
        "platform": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "TEXT", "dtype": "bytes", "shape": [1]}],
        "output": [{"name": "LOGITS", "dtype": "float32", "shape": output_shape or [-1, 3]}],
        "ensemble_scheduling": {"step": steps},
    }


GOOD_STEPS = [
    _step("tok", {"TEXT": "TEXT"}, {"ids": "i", "mask": "m"}),
    _step("tag", {"ids": "i", "mask": "m"}, {"logits": "LOGITS"}),
]


def _candidates(**replace: dict[str, Any]) -> dict[str, Candidate]:
    configs = {"tok": TOKENIZER, "tag": TAGGER, **replace}
    return {name: Candidate(parse_config(c, name), (1,)) for name, c in configs.items()}


def _plan(data: dict[str, Any], **replace: dict[str, Any]) -> Any:
    return plan_ensemble("e", parse_config(data, "e/config.toml"), _candidates(**replace))


def test_a_good_ensemble_plans_its_steps_in_graph_order() -> None:
    plan = _plan(_ensemble(list(reversed(GOOD_STEPS))))  # listed out of order: still a graph
    assert [s.model for s in plan.runnable({"TEXT"}, [])] == ["tok"]
    assert [s.model for s in plan.runnable({"TEXT", "i", "m"}, [2])] == ["tag"]
    assert plan.producers == {"TEXT": 0, "i": 2, "m": 2, "LOGITS": 1}


def test_one_model_in_two_steps_gets_one_label_per_step() -> None:
    steps = [
        _step("tok", {"TEXT": "TEXT"}, {"ids": "i", "mask": "m"}),
        _step("tag", {"ids": "i", "mask": "m"}, {"logits": "LOGITS"}),
        _step("tag", {"ids": "i", "mask": "m"}, {"logits": "spare"}),
    ]
    assert [s.label for s in _plan(_ensemble(steps)).steps] == ["tok", "tag#2", "tag#3"]


BAD_GRAPHS = [
    (
        [GOOD_STEPS[0], _step("tagz", {"ids": "i", "mask": "m"}, {"logits": "LOGITS"})],
        {},
        "e: step 2 ('tagz'): there is no model 'tagz' in the repository",
    ),
    (
        [GOOD_STEPS[0], _step("tag", {"ids": "idz", "mask": "m"}, {"logits": "LOGITS"})],
        {},
        "e: step 2 ('tag'): input_map takes tensor 'idz', which no step produces and which "
        "is not an input of the ensemble",
    ),
    (
        [GOOD_STEPS[0], _step("tag", {"ids": "i", "mask": "m"}, {"scores": "LOGITS"})],
        {},
        "e: step 2 ('tag'): output_map names 'scores', which is not an output of 'tag' "
        "(its outputs: logits)",
    ),
    (
        [GOOD_STEPS[0], _step("tag", {"ids": "i", "masks": "m"}, {"logits": "LOGITS"})],
        {},
        "e: step 2 ('tag'): input_map names 'masks', which is not an input of 'tag' "
        "(its inputs: ids, mask)",
    ),
    (
        [GOOD_STEPS[0], _step("tag", {"ids": "i"}, {"logits": "LOGITS"})],
        {},
        "e: step 2 ('tag'): input 'mask' of 'tag' is not in its input_map",
    ),
    (
        GOOD_STEPS,
        {"tag": {**TAGGER, "input": [{**TAGGER["input"][0], "dtype": "int32"}, TAGGER["input"][1]]}},
        "e: step 2 ('tag') input 'ids' takes int32 of shape [-1], but tensor 'i' (made by "
        "step 1) is int64 of shape [-1]",
    ),
    (
        [_step("tag", {"ids": "TEXT", "mask": "TEXT"}, {"logits": "LOGITS"})],
        {},
        "e: step 1 ('tag') input 'ids' takes int64 of shape [-1], but tensor 'TEXT' (an input "
        "of the ensemble) is bytes of shape [1]",
    ),
    (
        [*GOOD_STEPS[:1], _step("tag", {"ids": "i", "mask": "m"}, {"logits": "LOGITS"})],
        {"tag": {**TAGGER, "output": [{"name": "logits", "dtype": "float32", "shape": [-1]}]}},
        "e: output 'LOGITS' of the ensemble takes float32 of shape [-1, 3], but tensor "
        "'LOGITS' (made by step 2) is float32 of shape [-1]",
    ),
    (
        [GOOD_STEPS[0], _step("tag", {"ids": "i", "mask": "m"}, {"logits": "i"})],
        {},
        "e: step 2 ('tag'): output_map makes tensor 'i', which step 1 already makes",
    ),
    (
        [GOOD_STEPS[0]],
        {},
        "e: output 'LOGITS' of the ensemble is produced by no step",
    ),
    (
        [
            _step("tok", {"TEXT": "TEXT"}, {"ids": "i", "mask": "m"}),
            _step("tag", {"ids": "i", "mask": "back"}, {"logits": "LOGITS"}),
            _step("echo", {"ids": "LOGITS_IDS"}, {"ids": "back"}),
            _step("echo", {"ids": "back"}, {"ids": "LOGITS_IDS"}),
        ],
        {"echo": {"input": [TAGGER["input"][0]], "output": [{**TAGGER["input"][0]}]}},
        "e: the steps form a cycle: step 3 ('echo') -> step 4 ('echo') -> step 3 ('echo')",
    ),
    (
        [_step("tok", {"TEXT": "TEXT"}, {"ids": "i", "mask": "m"}, model_version=2), GOOD_STEPS[1]],
        {},
        "e: step 1 ('tok'): model 'tok' has no version 2 (it has 1)",
    ),
    (
        [GOOD_STEPS[0], _step("e", {"ids": "i", "mask": "m"}, {"logits": "LOGITS"})],
        {},
        "e: step 2 ('e'): an ensemble cannot run itself",
    ),
]


@pytest.mark.parametrize(("steps", "replace", "message"), BAD_GRAPHS)
def test_a_graph_that_cannot_run_is_refused_with_one_sentence(
    steps: list[dict], replace: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _plan(_ensemble(steps), **replace)
    assert str(caught.value) == message


def test_a_nested_ensemble_is_refused() -> None:
    inner = _ensemble(GOOD_STEPS)
    steps = [_step("inner", {"TEXT": "TEXT"}, {"LOGITS": "LOGITS"})]
    with pytest.raises(ConfigError, match=r"^e: step 1 \('inner'\): 'inner' is an ensemble; "):
        _plan(_ensemble(steps), inner=inner)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {**_ensemble(GOOD_STEPS), "ensemble_scheduling": None},
            "e/config.toml: platform = 'ensemble' and [[ensemble_scheduling.step]] go together",
        ),
        (
            {**TAGGER, "ensemble_scheduling": {"step": GOOD_STEPS}},
            "e/config.toml: platform = 'ensemble' and [[ensemble_scheduling.step]] go together",
        ),
        (
            _ensemble([{**GOOD_STEPS[0], "model": "tok"}]),
            "e/config.toml: ensemble_scheduling.step[0].model: Extra inputs are not permitted",
        ),
        (
            _ensemble([{**GOOD_STEPS[0], "input_map": {}}]),
            "e/config.toml: ensemble_scheduling.step[0].input_map: Dictionary should have at "
            "least 1 item after validation, not 0",
        ),
    ],
)
def test_a_bad_ensemble_config_is_a_sentence(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "e/config.toml")
    assert str(caught.value) == message


# -- the runner over in-process step models ----------------------------------------

FLOATS = {"dtype": "float32", "shape": [-1]}


def _function(fn: Any, inputs: list[str], outputs: list[str], **config: Any) -> ServedModel:
    return ServedModel.from_function(
        fn,
        inputs=[{"name": n, **FLOATS} for n in inputs],
        outputs=[{"name": n, **FLOATS} for n in outputs],
        **{"max_batch_size": 8, "max_queue_delay_ms": 1, **config},
    )


def _runner(steps: list[dict], models: dict[str, ServedModel], name: str = "e") -> Ensemble:
    data = {
        "platform": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "X", **FLOATS}],
        "output": [{"name": "OUT", **FLOATS}],
        "ensemble_scheduling": {"step": steps},
    }
    config: ModelConfig = parse_config(data, name)
    plan = plan_ensemble(name, config, {n: Candidate(m.config, (1,)) for n, m in models.items()})
    return Ensemble(name, config, plan, lambda model, version: models[model])


@pytest.fixture
def models() -> Iterator[dict[str, ServedModel]]:
    built: dict[str, ServedModel] = {}
    yield built
    for model in built.values():
        model.close()


def _x(*values: float) -> dict[str, np.ndarray]:
    return {"X": np.array(values, dtype=np.float32)}


async def test_steps_run_as_a_graph_each_caller_getting_its_own_rows(
    models: dict[str, ServedModel],
) -> None:
    """left and right both wait on X: each waits (in its model thread) for
    the other to have started, which only a graph runner allows."""
    started = {"left": threading.Event(), "right": threading.Event()}

    def side(me: str, other: str, factor: float) -> Any:
        def run(x: Any) -> Any:
            started[me].set()
            assert started[other].wait(10), f"{other} ran alongside {me}"
            return x * factor

        return run

    models["left"] = _function(side("left", "right", 2.0), ["x"], ["y"]).start()
    models["right"] = _function(side("right", "left", 10.0), ["x"], ["y"]).start()
    models["plus"] = _function(lambda a, b: a + b, ["a", "b"], ["s"]).start()
    ensemble = _runner(
        [
            _step("plus", {"a": "L", "b": "R"}, {"s": "OUT"}),
            _step("left", {"x": "X"}, {"y": "L"}),
            _step("right", {"x": "X"}, {"y": "R"}),
        ],
        models,
    )
    first, second = await asyncio.gather(
        ensemble.infer_many([_x(1, 2), _x(3)], timeout=20),
        ensemble.infer_many([_x(4, 5, 6)], timeout=20),
    )
    assert [r["OUT"].tolist() for r in first] == [[12.0, 24.0], [36.0]]
    assert [r["OUT"].tolist() for r in second] == [[48.0, 60.0, 72.0]]
    report = {s["step"]: s for s in ensemble.stats.report()["steps"]}
    assert {k: (s["calls"], s["items"], s["failures"]) for k, s in report.items()} == {
        "plus": (2, 3, 0),
        "left": (2, 3, 0),
        "right": (2, 3, 0),
    }


def _poison(x: Any) -> Any:
    if (x == 13).any():
        raise RuntimeError("poison value 13 in batch")
    return x + 1


async def test_a_failing_step_fails_only_its_callers_and_names_the_step(
    models: dict[str, ServedModel],
) -> None:
    gate = Gate()
    models["hold"] = _function(gate, ["x"], ["y"]).start()
    models["poison"] = _function(_poison, ["x"], ["y"]).start()
    ensemble = _runner(
        [
            _step("hold", {"x": "X"}, {"y": "H"}),
            _step("poison", {"x": "H"}, {"y": "OUT"}),
        ],
        models,
    )
    # Held in step 1 together, both callers reach step 2 in one batch.
    calls = [
        asyncio.ensure_future(ensemble.infer_many([_x(value, 1)], timeout=20))
        for value in (13, 2)
    ]
    await asyncio.to_thread(gate.wait_entered)
    gate.release.set()
    poisoned, healthy = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(poisoned, ModelFailure)
    assert poisoned.message.startswith("ensemble 'e' step 2 ('poison'): ")
    assert "poison value 13 in batch" in poisoned.message
    assert isinstance(healthy, list) and healthy[0]["OUT"].tolist() == [3.0, 2.0]
    report = {s["step"]: s for s in ensemble.stats.report()["steps"]}
    assert (report["poison"]["calls"], report["poison"]["failures"]) == (2, 1)
    assert ensemble.stats.triton_counts().fail == 1


async def test_an_intermediate_tensor_out_of_bounds_is_that_callers_400_naming_the_step(
    models: dict[str, ServedModel],
) -> None:
    models["double"] = _function(lambda x: x * 2, ["x"], ["y"]).start()
    models["bounded"] = ServedModel.from_function(
        lambda x: x,
        inputs=[{"name": "x", **FLOATS, "max_value": 10.0}],
        outputs=[{"name": "y", **FLOATS}],
        max_batch_size=8,
    ).start()
    ensemble = _runner(
        [_step("double", {"x": "X"}, {"y": "D"}), _step("bounded", {"x": "D"}, {"y": "OUT"})],
        models,
    )
    with pytest.raises(InvalidInput) as caught:
        await ensemble.infer_many([_x(1, 6)], timeout=10)
    assert caught.value.message.startswith("ensemble 'e' step 2 ('bounded'): ")
    assert "'x'" in caught.value.message and "10" in caught.value.message


async def test_a_bad_item_is_refused_before_any_step_runs(models: dict[str, ServedModel]) -> None:
    models["double"] = _function(lambda x: x * 2, ["x"], ["OUT"]).start()
    ensemble = _runner([_step("double", {"x": "X"}, {"OUT": "OUT"})], models)
    with pytest.raises(InvalidInput, match="'X'"):
        await ensemble.infer_many([{"X": np.array([1, 2], dtype=np.int64)}], timeout=10)
    assert ensemble.stats.report()["steps"][0]["calls"] == 0


async def test_the_deadline_is_one_for_all_steps(models: dict[str, ServedModel]) -> None:
    gate = Gate()
    models["hold"] = _function(gate, ["x"], ["OUT"]).start()
    ensemble = _runner([_step("hold", {"x": "X"}, {"OUT": "OUT"})], models)
    try:
        with pytest.raises(DeadlineExceeded) as caught:
            await ensemble.infer_many([_x(1)], timeout=0.2)
        assert caught.value.message.startswith("ensemble 'e' step 1 ('hold'): ")
    finally:
        gate.release.set()


async def test_a_caller_that_leaves_withdraws_its_queued_step_items(
    models: dict[str, ServedModel],
) -> None:
    gate = Gate()
    models["hold"] = _function(gate, ["x"], ["OUT"], max_batch_size=1).start()
    ensemble = _runner([_step("hold", {"x": "X"}, {"OUT": "OUT"})], models)
    first = asyncio.ensure_future(ensemble.infer_many([_x(1)], timeout=20))
    await asyncio.to_thread(gate.wait_entered)  # the instance is busy: the next one queues
    second = asyncio.ensure_future(ensemble.infer_many([_x(2)], timeout=20))
    batcher = models["hold"].batcher
    await wait_until_async(lambda: batcher.queue_depth == 1, "the second caller queued")
    second.cancel()
    await wait_until_async(lambda: batcher.queue_depth == 0, "its item withdrawn")
    gate.release.set()
    assert (await first)[0]["OUT"].tolist() == [1.0]
    assert gate.seen == [1.0]  # the caller that left never reached the model
    step = ensemble.stats.report()["steps"][0]
    assert (step["calls"], step["failures"]) == (1, 0)  # leaving is no failure of the step
    assert ensemble.stats.triton_counts().fail == 0


async def test_priority_orders_the_step_models_queue(models: dict[str, ServedModel]) -> None:
    gate = Gate()
    models["hold"] = _function(gate, ["x"], ["OUT"], max_batch_size=1, priority_levels=2).start()
    ensemble = _runner([_step("hold", {"x": "X"}, {"OUT": "OUT"})], models)
    batcher = models["hold"].batcher
    first = asyncio.ensure_future(ensemble.infer_many([_x(0)], timeout=20))
    await asyncio.to_thread(gate.wait_entered)
    low = asyncio.ensure_future(ensemble.infer_many([_x(1)], timeout=20, priority=2))
    await wait_until_async(lambda: batcher.queue_depth == 1, "the low-priority caller queued")
    high = asyncio.ensure_future(ensemble.infer_many([_x(2)], timeout=20, priority=1))
    await wait_until_async(lambda: batcher.queue_depth == 2, "the high-priority caller queued")
    gate.release.set()
    await asyncio.gather(first, low, high)
    assert gate.seen == [0.0, 2.0, 1.0]  # the later, higher-priority caller ran first


async def test_request_parameters_reach_every_step(models: dict[str, ServedModel]) -> None:
    models["scale"] = ServedModel.from_function(
        lambda x, factor: x * factor[:, None],
        inputs=[{"name": "x", **FLOATS}],
        outputs=[{"name": "y", **FLOATS}],
        request_parameter=[{"name": "factor", "type": "float", "default": 1.0}],
        max_batch_size=8,
    ).start()
    models["double"] = _function(lambda x: x * 2, ["x"], ["y"]).start()
    ensemble = _runner(
        [_step("scale", {"x": "X"}, {"y": "S"}), _step("double", {"x": "S"}, {"y": "OUT"})],
        models,
    )
    rows = await ensemble.infer_many([_x(1, 2)], timeout=10, parameters={"factor": 3.0})
    assert rows[0]["OUT"].tolist() == [6.0, 12.0]


# -- a repository, the registry, and every protocol of an in-process app --------------

DOUBLE_PY = """
import torch

class Model(torch.nn.Module):
    def forward(self, x):
        return {"y": x * 2}
"""
SHIFT_PY = """
import torch

class Model(torch.nn.Module):
    def forward(self, a, b):
        return {"s": a + b + 0.5}
"""
TOY = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_ms": 1.0}}


def _write(repo: Path, name: str, config: str, model_py: str | None) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True)
    (repo / name / "config.toml").write_text(config)
    if model_py is not None:
        (folder / "model.py").write_text(model_py)


def _ensemble_toml(steps: list[dict]) -> str:
    return toy_config(
        {"X": FLOATS},
        {"OUT": FLOATS},
        platform="ensemble",
        max_batch_size=8,
        isolation=None,
        ensemble_scheduling={"step": steps},
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("ensembles")
    _write(repo, "double", toy_config({"x": FLOATS}, {"y": FLOATS}, **TOY), DOUBLE_PY)
    shift = toy_config({"a": FLOATS, "b": FLOATS}, {"s": FLOATS}, **TOY)
    _write(repo, "shift", shift, SHIFT_PY)
    steps = [
        _step("double", {"x": "X"}, {"y": "D"}),
        _step("shift", {"a": "D", "b": "X"}, {"s": "OUT"}),
    ]
    _write(repo, "pair", _ensemble_toml(steps), None)
    _write(repo, "broken", _ensemble_toml([_step("tripler", {"x": "X"}, {"y": "OUT"})]), None)
    return repo


@pytest.fixture
async def client(aiohttp_client: Any, repository: Path) -> Any:
    settings = Settings(model_repository=repository)
    return await aiohttp_client(create_app(settings, wait_for_models=True))


async def test_the_ensemble_is_listed_described_and_configured_like_a_model(client: Any) -> None:
    index = await (await client.post("/v2/repository/index", json={})).json()
    states = {m["name"]: (m["state"], m.get("reason")) for m in index}
    assert states["pair"] == ("READY", None)
    assert states["broken"] == (
        "UNAVAILABLE",
        "broken: step 1 ('tripler'): there is no model 'tripler' in the repository",
    )
    meta = await (await client.get("/v2/models/pair")).json()
    assert (meta["platform"], meta["inputs"][0]["name"], meta["outputs"][0]["shape"]) == (
        "ensemble",
        "X",
        [-1, -1],
    )
    config = await (await client.get("/v2/models/pair/config")).json()
    assert config["platform"] == "ensemble" and config["backend"] == ""
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["double", "shift"]
    ready = await client.get("/v2/models/pair/ready")
    assert ready.status == 200


async def test_native_and_kserve_json_callers_reach_the_ensemble(client: Any) -> None:
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    response = await client.post(
        "/v2/models/pair/infer", data=body([{"X": tensor(x)}]), headers=MSGPACK
    )
    assert response.status == 200
    native = msgpack.unpackb(await response.read())
    assert from_wire(native["outputs"][0]["OUT"]).tolist() == [3.5, 6.5, 9.5]
    request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    response = await client.post("/v2/models/pair/infer", data=json.dumps(request))
    assert response.status == 200
    assert (await response.json())["outputs"][0]["data"] == [3.5, 6.5, 9.5]


async def test_step_metrics_and_stats_name_each_step(client: Any) -> None:
    x = np.array([1.0], dtype=np.float32)
    await client.post("/v2/models/pair/infer", data=body([{"X": tensor(x)}]), headers=MSGPACK)
    text = await (await client.get("/metrics")).text()
    labels = '{model="pair",step="shift",step_model="shift",version="1"} '
    calls = [r for r in text.splitlines() if r.startswith("tensorserve_ensemble_step_calls_total")]
    assert any(r.endswith(labels + "1.0") for r in calls), calls
    assert f"tensorserve_ensemble_step_seconds_count{labels}1.0" in text
    stats = await (await client.get("/v2/models/pair/stats")).json()
    assert [s["step"] for s in stats["ensemble"]["steps"]] == ["double", "shift"]
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 1


async def test_an_unknown_step_input_name_over_kserve_is_a_400(client: Any) -> None:
    request = {"inputs": [{"name": "Y", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}
    response = await client.post("/v2/models/pair/infer", data=json.dumps(request))
    assert response.status == 400
    assert (await response.json())["code"] == "invalid_input"


async def test_each_step_is_a_span_under_the_request(models: dict[str, ServedModel]) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from tensorserve.tracing.ensemble import EnsembleStepTracer

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("test")
    models["double"] = _function(lambda x: x * 2, ["x"], ["y"]).start()
    models["poison"] = _function(_poison, ["x"], ["y"]).start()
    ensemble = _runner(
        [_step("double", {"x": "X"}, {"y": "D"}), _step("poison", {"x": "D"}, {"y": "OUT"})],
        models,
    )
    ensemble.tracer = EnsembleStepTracer(tracer, "e", 1)
    with tracer.start_as_current_span("request") as request:
        await ensemble.infer_many([_x(1)], timeout=10)
        with pytest.raises(ModelFailure):
            await ensemble.infer_many([_x(6.5)], timeout=10)  # 13 after step 1
    spans = [s for s in exported.get_finished_spans() if s.name != "request"]
    assert [s.name for s in spans] == ["step double", "step poison"] * 2
    assert {s.parent.span_id for s in spans if s.parent} == {request.get_span_context().span_id}
    assert len([s for s in spans if s.parent]) == 4
    assert [s.status.status_code for s in spans][-1] is StatusCode.ERROR
    assert spans[-1].attributes["tensorserve.ensemble.step_model"] == "poison"
    provider.shutdown()


async def test_a_step_model_not_ready_makes_the_ensemble_not_ready_naming_the_step(
    repository: Path,
) -> None:
    from tensorserve.errors import ModelNotReady
    from tensorserve.serving.registry import ModelRegistry

    registry = ModelRegistry(repository)
    await registry.load_all()
    try:
        pair = registry.ready_model("pair")
        assert registry.health(registry.get("pair")) is None
        with pytest.raises(ModelNotReady, match=r"^model 'double' serves version 1, not version 2$"):
            registry.step_model("double", 2)
        with pytest.raises(ModelNotReady, match=r"^model 'pair' is an ensemble, not a model a step"):
            registry.step_model("pair", None)
        await registry.unload("shift")
        why = "step 2 ('shift'): model 'shift' is not ready (UNAVAILABLE)"
        assert registry.health(registry.get("pair")) == why
        assert registry.not_ready()["pair"] == why
        with pytest.raises(ModelNotReady) as caught:
            await pair.infer_many([_x(1)], timeout=10)
        assert caught.value.message == f"ensemble 'pair' {why}"
        await registry.load("shift")  # back: the ensemble finds the new instance
        rows = await pair.infer_many([_x(1)], timeout=10)
        assert rows[0]["OUT"].tolist() == [3.5]
    finally:
        await registry.close()


def test_an_ensemble_alone_is_not_a_served_model(repository: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        ServedModel.from_repository(repository, "pair", isolation="thread")
    assert str(caught.value) == (
        "pair: platform = 'ensemble' runs other models of its repository; serve the "
        "repository (tensorserve serve), not the ensemble alone"
    )

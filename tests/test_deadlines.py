"""Deadlines: a request's own timeout, else its model's ``default_timeout_ms``
(config.toml), else the server's ``default_timeout_ms``; never more than the
server's ``max_timeout_ms`` (a longer one is lowered to it). Both protocols,
against the real app; the model sleeps as many milliseconds as its input
says, so a deadline shows as a 504 naming it."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from tensorserve.cli import add_serve_parser, settings_from_args
from tensorserve.errors import ConfigError, InvalidInput
from tensorserve.http.app import create_app
from tensorserve.repository.config import parse_config
from tensorserve.settings import MAX_TIMEOUT_MS, MAX_TIMEOUT_S, Settings
from tensorserve.wire import native as native_codec
from tensorserve.wire import oip as oip_codec
from tensorserve.wire.request import effective_timeout
from tests.helpers import MSGPACK, SLEEPY_IO, SLEEPY_MODEL, body, tensor, write_toy_model

SLEEPY: dict[str, Any] = {
    "max_batch_size": 4,
    "dynamic_batching": {"max_queue_delay_ms": 0.0},
    **SLEEPY_IO,
}
NAP_MS = 400.0  # how long the model runs in the tests that time out


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("deadlines")
    write_toy_model(repo, "patient", SLEEPY_MODEL, **SLEEPY)  # no default of its own
    write_toy_model(repo, "hasty", SLEEPY_MODEL, **SLEEPY, default_timeout_ms=150)
    return repo


async def start(aiohttp_client: Any, repository: Path, **settings: Any) -> Any:
    app = create_app(Settings(model_repository=repository, **settings), wait_for_models=True)
    return await aiohttp_client(app)


async def native(client: Any, model: str, nap_ms: float, **parameters: Any) -> tuple[int, Any]:
    payload = body([{"ms": [nap_ms]}], parameters=parameters)
    response = await client.post(f"/v2/models/{model}/infer", data=payload, headers=MSGPACK)
    return response.status, msgpack.unpackb(await response.read())


def timed_out(model: str, seconds: float) -> tuple[int, str, str]:
    return 504, f"model {model!r}: no result within {seconds} s", "deadline_exceeded"


def answer(status: int, reply: dict[str, Any]) -> tuple[int, str, str]:
    return status, reply.get("error", ""), reply.get("code", "")


# ---------------------------------------------------------------------- the rule alone
@pytest.mark.parametrize(
    "requested_s, model_ms, server_ms, max_ms, expected_s",
    [
        (None, None, None, 3_600_000, 3600),  # nothing asked: the maximum
        (None, None, 2000, 3_600_000, 2),  # the server's default
        (None, 150, 2000, 3_600_000, 0.15),  # the model's default beats the server's
        (0.05, 150, 2000, 3_600_000, 0.05),  # the request may ask for less
        (5.0, 150, 2000, 3_600_000, 5.0),  # or for more
        (5.0, 150, 2000, 1000, 1.0),  # but never more than the maximum
        (None, 5000, None, 1000, 1.0),  # nor may a model's default
    ],
)
def test_which_deadline_applies(
    requested_s: float | None,
    model_ms: float | None,
    server_ms: float | None,
    max_ms: float,
    expected_s: float,
) -> None:
    assert math.isclose(effective_timeout(requested_s, model_ms, server_ms, max_ms), expected_s)


# ---------------------------------------------------------------------- against the app
async def test_the_models_default_applies_to_a_request_that_sets_none(
    aiohttp_client: Any, repository: Path
) -> None:
    client = await start(aiohttp_client, repository, default_timeout_ms=5000)
    assert answer(*await native(client, "hasty", NAP_MS)) == timed_out("hasty", 0.15)
    # The server's default, for a model without one of its own.
    status, reply = await native(client, "patient", NAP_MS)
    assert status == 200, reply


async def test_a_request_may_lower_or_raise_its_models_default(
    aiohttp_client: Any, repository: Path
) -> None:
    client = await start(aiohttp_client, repository)
    lowered = await native(client, "hasty", NAP_MS, timeout_ms=50)
    assert answer(*lowered) == timed_out("hasty", 0.05)
    status, reply = await native(client, "hasty", NAP_MS, timeout_ms=5000)
    assert status == 200, reply
    assert reply["outputs"][0]["y"]["shape"] == [1]


async def test_the_servers_default_and_maximum(aiohttp_client: Any, repository: Path) -> None:
    client = await start(aiohttp_client, repository, default_timeout_ms=100, max_timeout_ms=200)
    assert answer(*await native(client, "patient", NAP_MS)) == timed_out("patient", 0.1)
    # A longer timeout than the maximum is lowered to it, not refused.
    lowered = await native(client, "patient", NAP_MS, timeout_ms=60_000)
    assert answer(*lowered) == timed_out("patient", 0.2)


async def test_the_oip_timeout_lowers_the_models_default(
    aiohttp_client: Any, repository: Path
) -> None:
    client = await start(aiohttp_client, repository)
    message = {
        "parameters": {"timeout": 50_000},  # microseconds
        "inputs": [{"name": "ms", "datatype": "FP32", "shape": [1, 1], "data": [NAP_MS]}],
    }
    response = await client.post("/v2/models/hasty/infer", data=json.dumps(message))
    assert answer(response.status, json.loads(await response.read())) == timed_out("hasty", 0.05)


# ---------------------------------------------------------------------- bad values
MINIMAL: dict[str, Any] = {
    "input": [{"name": "x", "dtype": "float32", "shape": [-1]}],
    "output": [{"name": "y", "dtype": "float32", "shape": [-1]}],
}


@pytest.mark.parametrize(
    "value, problem",
    [
        (True, "Input should be a valid number"),
        ("250", "Input should be a valid number"),
        (float("nan"), "Input should be less than or equal to 3600000"),
        (float("inf"), "Input should be less than or equal to 3600000"),
        (1e300, "Input should be less than or equal to 3600000"),
        (0, "Input should be greater than 0"),
        (-5, "Input should be greater than 0"),
    ],
)
def test_a_models_default_timeout_is_strict(value: Any, problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config({**MINIMAL, "default_timeout_ms": value}, "m/config.toml")
    assert str(error.value) == f"m/config.toml: default_timeout_ms: {problem}"


def test_a_models_default_timeout_in_bounds() -> None:
    config = parse_config({**MINIMAL, "default_timeout_ms": 250}, "m/config.toml")
    assert config.default_timeout_ms == 250.0


@pytest.mark.parametrize("field", ["default_timeout_ms", "max_timeout_ms"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e300"])
def test_the_servers_timeouts_are_strict(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as error:
        Settings(**{field: value})
    assert [problem["loc"] for problem in error.value.errors()] == [(field,)]


# ---------------------------------------------------------------------- one bound
def from_flags(*argv: str) -> Settings:
    parser = argparse.ArgumentParser(prog="tensorserve")
    serve = add_serve_parser(parser.add_subparsers(dest="command"))
    return settings_from_args(serve.parse_args(argv))


def request_timeout(protocol: str, value: int, config: Any) -> float | None:
    """The timeout the protocol decodes from a request asking for ``value``
    (native: ms; OIP: µs)."""
    if protocol == "native":
        item = {"x": tensor(np.ones(3, np.float32))}
        message = {"items": [item], "parameters": {"timeout_ms": value}}
        return native_codec.decode_request(msgpack.packb(message), {}, config, 8).timeout
    inputs = [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]
    message = {"parameters": {"timeout": value}, "inputs": inputs}
    return oip_codec.decode_request(json.dumps(message).encode(), {}, config, 8).timeout


def test_every_timeout_is_refused_above_the_one_bound_and_accepted_at_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """settings.MAX_TIMEOUT_MS bounds the flags, the environment variables,
    config.toml's default_timeout_ms and both protocols' timeout parameter:
    one hour each, in its own unit."""
    limit, over = str(MAX_TIMEOUT_MS), str(MAX_TIMEOUT_MS + 1)
    refused = f"less than or equal to {MAX_TIMEOUT_MS}"
    for field in ("max_timeout_ms", "default_timeout_ms"):
        flag, variable = "--" + field.replace("_", "-"), "TENSORSERVE_" + field.upper()
        assert getattr(from_flags(flag, limit), field) == MAX_TIMEOUT_MS
        with pytest.raises(ValidationError, match=refused):
            from_flags(flag, over)
        monkeypatch.setenv(variable, limit)
        assert getattr(Settings(), field) == MAX_TIMEOUT_MS
        monkeypatch.setenv(variable, over)
        with pytest.raises(ValidationError, match=refused):
            Settings()
        monkeypatch.delenv(variable)
    config = parse_config({**MINIMAL, "default_timeout_ms": MAX_TIMEOUT_MS}, "m/config.toml")
    with pytest.raises(ConfigError, match=refused):
        parse_config({**MINIMAL, "default_timeout_ms": MAX_TIMEOUT_MS + 1}, "m/config.toml")
    for protocol, per_second in (("native", 1000), ("oip", 1_000_000)):
        most = MAX_TIMEOUT_S * per_second
        assert request_timeout(protocol, most, config) == MAX_TIMEOUT_S
        with pytest.raises(InvalidInput, match=re.escape(f"at most {most} (one hour)")):
            request_timeout(protocol, most + 1, config)

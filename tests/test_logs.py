"""Request ids and log lines: X-Request-ID in and out of every response, in
error bodies and on the log lines of that request (a model failure with its
traceback); 4xx lines rate-limited; the access log; JSON lines."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorserve.http.app import create_app
from tensorserve.dataplane.logs import (
    REQUEST_ID,
    JsonFormatter,
    RateLimit,
    install_request_ids,
    request_id_from,
)
from tensorserve.settings import Settings
from tests.helpers import ECHO, MSGPACK, POISON_MODEL, body, write_toy_model

GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
async def make_client(aiohttp_client: Any, tmp_path: Path) -> Any:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)

    async def make(**settings: Any) -> Any:
        app = create_app(Settings(model_repository=tmp_path, **settings), wait_for_models=True)
        return await aiohttp_client(app)

    return make


def x(fill: float) -> dict[str, np.ndarray]:
    return {"x": np.full((2, 4), fill, np.float32)}


def test_a_request_id_is_kept_when_safe_and_replaced_otherwise() -> None:
    assert request_id_from("req-1.a_b:c") == "req-1.a_b:c"
    assert request_id_from("a" * 128) == "a" * 128
    for unsafe in ("a" * 129, "has space", "new\nline", "", "é", "<script>"):
        assert GENERATED.fullmatch(request_id_from(unsafe)), unsafe
    assert GENERATED.fullmatch(request_id_from(None))


async def test_every_response_carries_the_request_id(make_client: Any) -> None:
    client = await make_client()
    for method, path in (("GET", "/v2/health/live"), ("GET", "/metrics"), ("GET", "/nowhere"),
                         ("POST", "/v2/models/nope/infer"), ("GET", "/v2/models/echo/stats")):
        response = await client.request(method, path, headers={"X-Request-ID": "mine-1"})
        assert response.headers["X-Request-ID"] == "mine-1", path
        generated = await client.request(method, path, headers={"X-Request-ID": "not safe!"})
        assert GENERATED.fullmatch(generated.headers["X-Request-ID"]), path
    reply = await client.get("/nowhere", headers={"X-Request-ID": "mine-2"})
    assert (await reply.json()) == {"error": "404: Not Found", "code": "http_error",
                                    "request_id": "mine-2"}


async def test_the_log_lines_of_a_failing_request_carry_its_id(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client()
    caplog.set_level(logging.INFO)
    # The KServe body's id is on the line too.
    reply = await client.post(
        "/v2/models/echo/infer",
        data=json.dumps({"id": "kserve-7", "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [1, 2, 4], "data": [13] * 8}]}),
        headers={"Content-Type": "application/json", "X-Request-ID": "poison-1"},
    )
    assert reply.status == 500 and reply.headers["X-Request-ID"] == "poison-1"
    assert (await reply.json())["request_id"] == "poison-1"
    (line,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert line.request_id == "poison-1"  # type: ignore[attr-defined]
    assert "POST /v2/models/echo/infer (id 'kserve-7') -> 500 model_failure" in line.getMessage()
    # The model's own traceback, chained to the error the caller got.
    assert line.exc_info is not None
    text = logging.Formatter().formatException(line.exc_info)
    assert "RuntimeError: poison value 13 in batch" in text and "in forward" in text

    bad = body([{"x": np.ones((2, 3), np.float32)}])
    reply = await client.post("/v2/models/echo/infer", data=bad,
                              headers={**MSGPACK, "X-Request-ID": "bad-1"})
    assert reply.status == 400 and reply.headers["X-Request-ID"] == "bad-1"
    native_error = msgpack.unpackb(await reply.read())  # a msgpack error body carries it too
    assert native_error["request_id"] == "bad-1" and native_error["code"] == "invalid_input"
    (warning,) = [r for r in caplog.records if getattr(r, "request_id", None) == "bad-1"]
    assert warning.levelno == logging.WARNING and warning.exc_info is None
    assert "-> 400 invalid_input" in warning.getMessage()


async def test_lines_logged_by_code_the_handler_calls_carry_the_id() -> None:
    install_request_ids()
    log = logging.getLogger("tensorserve.test")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    log.addHandler(handler)
    try:
        async def request(rid: str) -> None:
            REQUEST_ID.set(rid)
            await asyncio.to_thread(log.warning, "in a thread for %s", rid)
            log.warning("on the loop for %s", rid)

        await asyncio.gather(request("a"), request("b"))
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    ids = {r.getMessage(): r.request_id for r in records}  # type: ignore[attr-defined]
    assert ids == {"in a thread for a": "a", "on the loop for a": "a",
                   "in a thread for b": "b", "on the loop for b": "b", "outside": "-"}


async def test_a_flood_of_bad_requests_logs_a_few_lines(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client()
    caplog.set_level(logging.INFO)
    bad = body([{"x": np.ones((2, 3), np.float32)}])
    for _ in range(40):
        reply = await client.post("/v2/models/echo/infer", data=bad, headers=MSGPACK)
        assert reply.status == 400
    lines = [r for r in caplog.records if "invalid_input" in r.getMessage()]
    assert 1 <= len(lines) <= RateLimit().burst


def test_the_rate_limit_counts_what_it_left_out() -> None:
    limit = RateLimit(burst=2, period=10.0)
    assert [limit.allow("a", now) for now in (0.0, 1.0, 2.0, 3.0)] == [
        (True, 0), (True, 0), (False, 1), (False, 2)]
    assert limit.allow("b", 3.0) == (True, 0)  # per key
    assert limit.allow("a", 10.5) == (True, 2)  # the next window says how many were dropped
    assert limit.allow("a", 10.6) == (True, 0)


async def test_the_access_log_has_latency_bytes_and_id_and_skips_probes(
    make_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(access_log=True)
    caplog.set_level(logging.INFO, logger="tensorserve.access")
    await client.get("/v2/health/ready")
    await client.get("/metrics")
    reply = await client.post("/v2/models/echo/infer", data=body([x(1.0)]),
                              headers={**MSGPACK, "X-Request-ID": "ok-1"})
    assert reply.status == 200
    (line,) = [r for r in caplog.records if r.name == "tensorserve.access"]
    assert line.request_id == "ok-1"  # type: ignore[attr-defined]
    fields = line.__dict__
    assert (fields["method"], fields["path"], fields["status"]) == ("POST", "/v2/models/echo/infer",
                                                                    200)
    assert fields["bytes"] == len(await reply.read()) and fields["latency_ms"] > 0
    assert re.fullmatch(r"POST /v2/models/echo/infer 200 [0-9.]+ms \d+B", line.getMessage())

    probes = await make_client(access_log=True, log_probes=True)
    caplog.clear()
    await probes.get("/v2/health/live")
    assert [r.__dict__["path"] for r in caplog.records if r.name == "tensorserve.access"] == [
        "/v2/health/live"]


def test_json_lines_carry_the_fields_and_the_traceback() -> None:
    install_request_ids()
    token = REQUEST_ID.set("json-1")
    try:
        try:
            raise ValueError("boom")
        except ValueError as exc:
            record = logging.getLogger("t").makeRecord(
                "t", logging.ERROR, __file__, 1, "failed %s", ("here",), (type(exc), exc, None),
                extra={"status": 500},
            )
    finally:
        REQUEST_ID.reset(token)
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "json-1" and line["message"] == "failed here"
    assert line["level"] == "ERROR" and line["status"] == 500
    assert "ValueError: boom" in line["exc"]


def test_the_startup_line_shows_the_frontends_in_effect(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorserve.dataplane import logs

    monkeypatch.setattr(logs, "available_cpus", lambda: 2)
    with caplog.at_level(logging.INFO, logger="tensorserve"):
        logs.log_startup(Settings(frontends="auto"))
        logs.log_startup(Settings(frontends=3))
    auto, three = (r for r in caplog.records if "starting:" in r.getMessage())
    assert ", frontends=auto → 1 (2 CPUs), " in auto.getMessage()
    assert auto.settings["frontends"] == "auto → 1 (2 CPUs)"  # type: ignore[attr-defined]
    assert ", frontends=3, " in three.getMessage()
    assert logs.effective_frontends("auto", cpus=16) == "auto → 8 (16 CPUs)"
    assert logs.effective_frontends("auto", cpus=1) == "auto → 1 (1 CPU)"

"""Traces, end to end: a real server process sends its spans by OTLP/HTTP to a
real receiver on loopback, which parses each ``ExportTraceServiceRequest``.
A request with a known ``traceparent`` (an HTTP header, or gRPC metadata)
continues that trace through every stage; with the sampling ratio at 0, a
request without one records nothing; the response (its headers, or the
call's initial metadata) carries the request span's context back."""

from __future__ import annotations

import gzip
import os
import re
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.conftest import ROOT, ServerProcess
from tests.helpers import (
    MSGPACK,
    SLEEPY_IO,
    SLEEPY_MODEL,
    body,
    toy_config,
    wait_until,
    write_toy_model,
)
from tests.test_ensemble import DOUBLE_PY, FLOATS, TOY, _ensemble_toml, _step, _write

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def sampled(flags: str) -> bool:
    return bool(int(flags, 16) & 1)  # the other bits: W3C level 2's "random" flag

STAGES = {"queue", "pad", "compute", "unpad", "encode"}
INFER = "POST /v2/models/{model}/infer"
GRPC_INFER = "inference.GRPCInferenceService/ModelInfer"


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value"))


class Receiver:
    """An OTLP/HTTP traces endpoint: keeps every span it is sent, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                receiver.keep(self.path, self.headers.get("Content-Type", ""), data)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def keep(self, path: str, content_type: str, data: bytes) -> None:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(data)
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append({
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "kind": span.kind,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "status": span.status.code,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            "resource": resource,
                        })

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "two-front-ends"])
def traced(
    receiver: Receiver, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ServerProcess]:
    """A server tracing to the receiver; new traces sampled at ratio 0, so
    only callers that send a sampled traceparent are traced. With two front
    ends, the request's spans come from a front end and its batch's from
    the scheduler process: one trace all the same."""
    repo = tmp_path_factory.mktemp("repo")
    write_toy_model(repo, "sleepy", SLEEPY_MODEL, max_batch_size=8, **SLEEPY_IO)
    _write(repo, "double", toy_config({"x": FLOATS}, {"y": FLOATS}, **TOY), DOUBLE_PY)
    _write(repo, "twice", _ensemble_toml([_step("double", {"x": "X"}, {"y": "OUT"})]), None)
    server = ServerProcess(
        repo, "--otlp-endpoint", receiver.url, "--trace-sample-ratio", "0",
        "--frontends", request.param,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # export within 50 ms, not the SDK's 5 s
    )
    yield server
    server.stop()


def infer(url: str, ms: float, headers: dict[str, str] | None = None) -> httpx.Response:
    items = [{"ms": np.full(3, ms, np.float32)}, {"ms": np.full(5, ms, np.float32)}]
    return httpx.post(f"{url}/v2/models/sleepy/infer", content=body(items), timeout=30,
                      headers={**MSGPACK, **(headers or {})})


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def wait_for_stages(receiver: Receiver, trace_id: str, names: set[str]) -> list[dict[str, Any]]:
    wait_until(lambda: names <= {s["name"] for s in receiver.trace(trace_id)},
               f"spans {sorted(names)} of trace {trace_id}", timeout=20)
    return receiver.trace(trace_id)


def test_a_traced_request_continues_its_trace_through_every_stage(
    traced: ServerProcess, receiver: Receiver
) -> None:
    traceparent, trace_id, caller_span = new_traceparent()
    response = infer(traced.url, 0, {"traceparent": traceparent, "X-Request-ID": "traced-1"})
    assert response.status_code == 200
    back = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert back is not None and back[1] == trace_id and sampled(back[3])
    assert back[2] != caller_span  # the server's own span, not the caller's

    spans = wait_for_stages(receiver, trace_id, {INFER, *STAGES})
    (request,) = [s for s in spans if s["name"] == INFER]
    assert request["span_id"] == back[2] and request["parent"] == caller_span
    assert request["kind"] == 2  # SPAN_KIND_SERVER
    assert request["resource"]["service.name"] == "tensorserve"
    attributes = request["attributes"]
    assert attributes["http.request.method"] == "POST"
    assert attributes["http.route"] == "/v2/models/{model}/infer"
    assert attributes["url.path"] == "/v2/models/sleepy/infer"
    assert attributes["http.response.status_code"] == 200
    assert attributes["tensorserve.model"] == "sleepy"
    assert attributes["tensorserve.model.version"] == "1"
    assert attributes["tensorserve.items"] == 2
    assert attributes["tensorserve.request_id"] == "traced-1"
    assert attributes["tensorserve.outcome"] == "ok"

    by_name = {s["name"]: s for s in spans}
    for name in STAGES:  # every stage hangs under the request's span, inside it
        stage = by_name[name]
        assert stage["parent"] == request["span_id"], name
        assert request["start"] <= stage["start"] <= stage["end"] <= request["end"], name
    assert by_name["queue"]["attributes"]["tensorserve.items"] == 2
    order = ["queue", "pad", "compute", "unpad", "encode"]
    for before, after in zip(order, order[1:]):
        assert by_name[before]["end"] <= by_name[after]["start"] + 1_000, (before, after)
    compute = by_name["compute"]["attributes"]
    assert compute["tensorserve.batch.size"] == 2
    assert compute["tensorserve.batch.padded_length"] == 5  # the longer item's length
    assert by_name["compute"]["links"] == [(trace_id, request["span_id"])]


def test_one_batch_of_two_traced_requests_links_to_both(
    traced: ServerProcess, receiver: Receiver
) -> None:
    # A slow batch holds the model while the two requests queue: they run as one batch.
    admitted = _admitted(traced.url)
    with ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(infer, traced.url, 1500)
        wait_until(lambda: _admitted(traced.url) > admitted and not _queued(traced.url),
                   "the slow batch to leave the queue")
        parents = [new_traceparent() for _ in range(2)]
        calls = [pool.submit(infer, traced.url, 0, {"traceparent": p[0]}) for p in parents]
        wait_until(lambda: _queued(traced.url) == 4, "both requests to queue behind it")
        assert blocker.result().status_code == 200
        responses = [call.result() for call in calls]
    assert all(r.status_code == 200 for r in responses)
    request_spans = []
    for (_, trace_id, _), response in zip(parents, responses):
        match = TRACEPARENT.fullmatch(response.headers["traceparent"])
        assert match is not None
        request_spans.append((trace_id, match[2]))
        wait_for_stages(receiver, trace_id, {INFER, "queue"})

    def computes() -> list[dict[str, Any]]:
        return [s for t, _ in request_spans for s in receiver.trace(t) if s["name"] == "compute"]

    wait_until(lambda: len(computes()) >= 1, "the batch's compute span")
    (compute,) = computes()  # one batch, one compute span, in the first request's trace
    assert compute["attributes"]["tensorserve.batch.size"] == 4
    assert sorted(compute["links"]) == sorted(request_spans)


def grpc_infer(address: str, model: str, traceparent: str) -> tuple[Any, dict[str, str]]:
    """A ModelInfer of two items of length 3 with ``traceparent`` in its
    metadata: (the reply or the grpc.RpcError, the initial metadata)."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="ms", datatype="FP32", shape=[2, 3])
    request.raw_input_contents.append(np.zeros((2, 3), np.float32).tobytes())
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            reply, call = stub.ModelInfer.with_call(
                request, metadata=[("traceparent", traceparent)], timeout=30
            )
        except grpc.RpcError as failed:
            reply, call = failed, failed
        return reply, dict(call.initial_metadata())


def test_a_traced_grpc_call_continues_its_trace_through_every_stage(
    traced: ServerProcess, receiver: Receiver
) -> None:
    traceparent, trace_id, caller_span = new_traceparent()
    reply, metadata = grpc_infer(traced.grpc_address, "sleepy", traceparent)
    assert list(reply.outputs[0].shape) == [2, 3]
    back = TRACEPARENT.fullmatch(metadata["traceparent"])
    assert back is not None and back[1] == trace_id and sampled(back[3])
    assert back[2] != caller_span

    spans = wait_for_stages(receiver, trace_id, {GRPC_INFER, *STAGES})
    (request,) = [s for s in spans if s["name"] == GRPC_INFER]
    assert request["span_id"] == back[2] and request["parent"] == caller_span
    assert request["kind"] == 2  # SPAN_KIND_SERVER: the gRPC call is the server span
    attributes = request["attributes"]
    assert attributes["rpc.system"] == "grpc"
    assert attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert attributes["rpc.method"] == "ModelInfer"
    assert attributes["rpc.grpc.status_code"] == 0  # OK
    assert attributes["network.peer.address"] == "127.0.0.1"
    assert attributes["tensorserve.model"] == "sleepy"
    assert attributes["tensorserve.items"] == 2
    assert attributes["tensorserve.outcome"] == "ok"
    assert attributes["tensorserve.request_id"] == metadata["x-request-id"]

    by_name = {s["name"]: s for s in spans}
    for name in STAGES:
        assert by_name[name]["parent"] == request["span_id"], name
        assert request["start"] <= by_name[name]["start"] <= by_name[name]["end"] <= request["end"]
    compute = by_name["compute"]
    assert compute["attributes"]["tensorserve.batch.size"] == 2
    assert compute["links"] == [(trace_id, request["span_id"])]  # the batch links the call


def test_a_failed_grpc_call_carries_its_status(traced: ServerProcess, receiver: Receiver) -> None:
    traceparent, trace_id, _ = new_traceparent()
    failed, metadata = grpc_infer(traced.grpc_address, "nope", traceparent)
    assert failed.code() == grpc.StatusCode.NOT_FOUND
    assert TRACEPARENT.fullmatch(metadata["traceparent"])[1] == trace_id  # type: ignore[index]
    (span,) = wait_for_stages(receiver, trace_id, {GRPC_INFER})
    assert span["attributes"]["tensorserve.outcome"] == "model_not_found"
    assert span["attributes"]["rpc.grpc.status_code"] == 5  # NOT_FOUND
    assert span["status"] != 2  # the caller's mistake, not the server's


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v2/models/sleepy/stats", timeout=5).json()["batching"]


def _admitted(url: str) -> int:
    return int(_stats(url)["total_requests"])


def _queued(url: str) -> int:
    return int(_stats(url)["queue_depth"])


def test_an_unsampled_request_records_no_span_but_answers_its_context(
    traced: ServerProcess, receiver: Receiver
) -> None:
    response = infer(traced.url, 0)
    match = TRACEPARENT.fullmatch(response.headers["traceparent"])
    assert response.status_code == 200 and match is not None and not sampled(match[3])
    # Spans leave in order: once a later sampled request's spans are in, the
    # unsampled one's would have been too.
    traceparent, trace_id, _ = new_traceparent()
    infer(traced.url, 0, {"traceparent": traceparent})
    wait_for_stages(receiver, trace_id, {INFER, *STAGES})
    assert receiver.trace(match[1]) == []


def test_a_failed_request_carries_its_outcome(traced: ServerProcess, receiver: Receiver) -> None:
    traceparent, trace_id, _ = new_traceparent()
    response = httpx.post(f"{traced.url}/v2/models/nope/infer", content=b"{}", timeout=10,
                          headers={"traceparent": traceparent})
    assert response.status_code == 404
    (span,) = wait_for_stages(receiver, trace_id, {INFER})
    assert span["attributes"]["tensorserve.outcome"] == "model_not_found"
    assert span["attributes"]["http.response.status_code"] == 404
    assert span["status"] != 2  # STATUS_CODE_ERROR: a 4xx is the caller's, not the server's


def test_tracing_without_the_sdk_exits_2_saying_what_to_install(tmp_path: Path) -> None:
    hide_sdk = (
        "import sys; sys.modules['opentelemetry'] = None; "
        "from tensorserve.cli import main; "
        f"sys.exit(main(['serve', '--otlp-endpoint', 'http://127.0.0.1:1', "
        f"'--model-repository', {str(tmp_path)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", hide_sdk], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=os.environ)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "from the repository's root: pip install -e '.[otel]'" in lines[0], result.stderr


def test_a_server_without_tracing_never_imports_opentelemetry() -> None:
    script = (
        "import sys; from tensorserve.http.app import create_app; "
        "from tensorserve.settings import Settings; create_app(Settings()); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_an_ensembles_steps_and_their_batches_join_the_requests_trace(
    traced: ServerProcess, receiver: Receiver
) -> None:
    traceparent, trace_id, _ = new_traceparent()
    request = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
    response = httpx.post(f"{traced.url}/v2/models/twice/infer", json=request,
                          headers={"traceparent": traceparent}, timeout=30)
    assert response.status_code == 200, response.text
    spans = wait_for_stages(receiver, trace_id, {INFER, "step double", "compute"})
    by_name = {s["name"]: s for s in spans}
    assert by_name["step double"]["parent"] == by_name[INFER]["span_id"]
    assert by_name["compute"]["attributes"]["tensorserve.model"] == "double"


def test_one_clock_is_read_against_another_at_one_instant_whatever_a_preemption_costs() -> None:
    """A span's clocks are converted by offsets read as a bracket of reads,
    the tightest of three: one stretched 51 us (a descheduled thread, seen
    on a VM: the queue span ended after the pad span began) is not used."""
    from tensorserve.tracing.batches import offset_ns

    # Two clocks 1,000,000 ns apart; the first try's bracket is stretched.
    reads = iter([100, 1_000_150, 51_100,  # 51,000 ns between the other clock's reads
                  60_000, 1_060_002, 60_004,  # 4 ns
                  70_000, 1_070_010, 70_020])  # 20 ns  # fmt: skip
    readings = {"reference": 0, "other": 0}

    def clock(name: str) -> Any:
        def read() -> int:
            readings[name] += 1
            return next(reads)

        return read

    assert offset_ns(clock("reference"), clock("other")) == 1_000_000
    assert readings == {"reference": 3, "other": 6}

"""Each server process's CPU and event-loop lag (metrics/processes.py): this
process's own series, labelled with its role and pid, grow with the CPU it
burns; another process's reported figures appear in the exposition and go
when it is forgotten; a real server's ``/metrics`` shows its own process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from tensorserve.metrics import Metrics
from tensorserve.metrics.processes import ProcessMetrics, cpu_seconds
from tensorserve.serving.registry import ModelRegistry
from tests.conftest import ServerProcess
from tests.test_metrics import Samples, parse

CPU = "tensorserve_process_cpu_seconds_total"
LAG = "tensorserve_event_loop_lag_seconds"
OWN = str(os.getpid())


def series(samples: Samples, name: str) -> dict[tuple[str, str], float]:
    """(role, pid) -> value of every sample of ``name``, whatever else it has."""
    found = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            by_name = dict(labels)
            assert set(by_name) == {"role", "pid"}, by_name
            found[by_name["role"], by_name["pid"]] = value
    return found


def metrics(tmp_path: Path, **kwargs: object) -> Metrics:
    return Metrics(ModelRegistry(tmp_path), **kwargs)  # type: ignore[arg-type]


def burn(seconds: float) -> None:
    start = cpu_seconds()
    while cpu_seconds() - start < seconds:
        sum(i * i for i in range(10_000))


def test_the_own_process_series_carry_role_and_pid_and_grow_with_cpu(tmp_path: Path) -> None:
    served = metrics(tmp_path, loop_lag=lambda: 0.25)
    before = series(parse(served.exposition().decode()), CPU)
    assert set(before) == {("server", OWN)}
    burn(0.1)
    after = series(parse(served.exposition().decode()), CPU)
    assert set(after) == {("server", OWN)}
    grew = after["server", OWN] - before["server", OWN]
    assert 0.1 <= grew < 5.0, grew
    times = psutil.Process().cpu_times()
    assert after["server", OWN] <= times.user + times.system + 0.01
    assert series(parse(served.exposition().decode()), LAG) == {("server", OWN): 0.25}


def test_the_role_given_labels_this_process(tmp_path: Path) -> None:
    lag = [0.0]
    served = metrics(tmp_path, loop_lag=lambda: lag[0], role="scheduler")
    lag[0] = 0.125  # read at each scrape, not at construction
    samples = parse(served.exposition().decode())
    assert set(series(samples, CPU)) == {("scheduler", OWN)}
    assert series(samples, LAG) == {("scheduler", OWN): 0.125}


def test_without_a_loop_lag_this_process_has_no_lag_series(tmp_path: Path) -> None:
    served = metrics(tmp_path)
    samples = parse(served.exposition().decode())
    assert set(series(samples, CPU)) == {("server", OWN)}
    assert series(samples, LAG) == {}
    served.processes.report("frontend", 4242, 1.5, 0.01)
    assert series(parse(served.exposition().decode()), LAG) == {("frontend", "4242"): 0.01}


def test_reported_processes_appear_until_forgotten(tmp_path: Path) -> None:
    served = metrics(tmp_path, loop_lag=lambda: 0.0, role="scheduler")
    served.processes.report("frontend", 1001, 3.5, 0.002)
    served.processes.report("frontend", 1002, 7.25, 0.03)
    served.processes.report("frontend", 1001, 4.0, 0.001)  # the latest report wins
    samples = parse(served.exposition().decode())
    cpu = series(samples, CPU)
    assert cpu.pop(("scheduler", OWN)) > 0
    assert cpu == {("frontend", "1001"): 4.0, ("frontend", "1002"): 7.25}
    assert series(samples, LAG) == {
        ("scheduler", OWN): 0.0,
        ("frontend", "1001"): 0.001,
        ("frontend", "1002"): 0.03,
    }
    served.processes.forget(1001)
    served.processes.forget(1001)  # again, or a pid never reported: no error
    served.processes.forget(999)
    samples = parse(served.exposition().decode())
    assert set(series(samples, CPU)) == {("scheduler", OWN), ("frontend", "1002")}
    assert set(series(samples, LAG)) == {("scheduler", OWN), ("frontend", "1002")}
    # Exposed with the counter's type, so rate() applies.
    text = served.exposition().decode()
    assert "# TYPE tensorserve_process_cpu_seconds_total counter" in text
    assert "# TYPE tensorserve_event_loop_lag_seconds gauge" in text


def test_unknown_roles_and_the_own_pid_are_refused() -> None:
    with pytest.raises(ValueError, match="'frontends' is not one of server, scheduler, frontend"):
        ProcessMetrics("frontends", None)
    processes = ProcessMetrics("scheduler", None)
    with pytest.raises(ValueError, match="is not one of"):
        processes.report("worker", 1001, 1.0, 0.0)
    with pytest.raises(ValueError, match="this process's own"):
        processes.report("frontend", os.getpid(), 1.0, 0.0)
    (cpu, _) = processes.collect()
    assert cpu.samples[0].labels == {"role": "scheduler", "pid": OWN}


def test_reports_and_forgets_on_another_thread_while_scraping(tmp_path: Path) -> None:
    served = metrics(tmp_path, loop_lag=lambda: 0.0, role="scheduler")
    done = threading.Event()
    failures: list[BaseException] = []

    def churn() -> None:
        try:
            for round_ in range(300):
                for pid in range(10_000, 10_020):
                    served.processes.report("frontend", pid, float(round_), 0.0)
                for pid in range(10_000, 10_020, 2):
                    served.processes.forget(pid)
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            failures.append(exc)
        finally:
            done.set()

    worker = threading.Thread(target=churn)
    worker.start()
    scrapes = 0
    while not done.is_set() or scrapes == 0:
        cpu = series(parse(served.exposition().decode()), CPU)
        assert ("scheduler", OWN) in cpu
        assert all(role == "frontend" for role, pid in cpu if pid != OWN)
        scrapes += 1
    worker.join()
    assert failures == []
    final = series(parse(served.exposition().decode()), CPU)
    assert set(final) == {("scheduler", OWN)} | {
        ("frontend", str(pid)) for pid in range(10_001, 10_020, 2)
    }


def test_a_real_servers_metrics_show_its_own_process(server: ServerProcess) -> None:
    assert server.process is not None
    pid = server.process.pid
    url = server.url

    def own_cpu() -> float:
        found = series(parse(httpx.get(f"{url}/metrics", timeout=30).text), CPU)
        assert set(found) == {("server", str(pid))}, found
        return found["server", str(pid)]

    first = own_cpu()
    for _ in range(20):  # a scrape itself costs the server CPU; so do these
        httpx.get(f"{url}/v2/health/ready", timeout=30)
    samples = parse(httpx.get(f"{url}/metrics", timeout=30).text)
    assert set(series(samples, LAG)) == {("server", str(pid))}
    second = own_cpu()
    times = psutil.Process(pid).cpu_times()
    assert 0 < first <= second <= times.user + times.system + 0.01


def test_a_front_ends_bucket_counts_expose_as_the_values_observed_one_by_one() -> None:
    """A front end reports latencies as bucket counts; the scheduler process
    adds them at once. /metrics must read exactly as if each was observed,
    values on bucket bounds and past the last one included."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tensorserve.frontends.report import RequestReport
    from tensorserve.metrics.requests import LATENCY_BUCKETS, RequestMetrics

    values = [0.0001, 0.0005, 0.003, LATENCY_BUCKETS[5], 0.07, 2.5, 1e6]
    registries = CollectorRegistry(), CollectorRegistry()
    one_by_one, reported = (RequestMetrics(registry) for registry in registries)
    report = RequestReport()
    for value in values:
        one_by_one.observe("http", "m", "1", "ok", 200, 1, value)
        one_by_one.observe_encode("m", value / 10)
        report.observe("http", "m", "1", "ok", 200, 1, value)
        report.observe_encode("m", value / 10)
    taken = report.take()
    for outcome in taken["requests"]:
        reported.observe_many(*outcome)
    for model, counts, total in taken["encode"]:
        reported.observe_encode_many(model, counts, total)

    def exposed(registry: CollectorRegistry) -> list[str]:  # without creation times
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if "_created" not in line]

    text = exposed(registries[0])
    assert any(line.startswith("tensorserve_request_duration_seconds_bucket{") for line in text)
    assert any(line.startswith("tensorserve_response_encode_seconds_bucket{") for line in text)
    assert exposed(registries[1]) == text

"""Every PromQL query of docs/observability.md and of the Grafana dashboard,
evaluated by a real Prometheus scraping a real tensorserve under load.

    python scripts/check_prometheus.py                    # the check (needs `prometheus` on PATH)
    python scripts/check_prometheus.py --write-dashboard  # rebuild docs/grafana-dashboard.json

The queries are read from the docs' ```promql blocks, whose first line is a
comment: what the query shows, then ``range: LOW..HIGH``. The dashboard must
hold exactly the same queries (so neither can drift from the other). The
check starts ``tensorserve serve`` on the bundled model_repository, drives it
with ``tensorserve bench`` (good requests) and a thread of bad ones (invalid
input, an unknown model, a token id the tagger has no embedding for), starts
Prometheus with a temporary config (1 s scrapes), and asks Prometheus's HTTP
API for each query: every one must answer a non-empty vector of finite values
within its range. scripts/check_prometheus.sh installs Prometheus first.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "observability.md"
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
_BLOCK = re.compile(r"```promql\n(.*?)```", re.DOTALL)
_HEAD = re.compile(r"#\s*(?P<title>.*?)\s*range:\s*(?P<low>[-0-9.e+]+)\.\.(?P<high>[-0-9.e+]+)\s*$")


@dataclass(frozen=True)
class Query:
    title: str
    low: float
    high: float
    expr: str  # the PromQL without its comment line


def docs_queries(path: Path = DOCS) -> list[Query]:
    queries = []
    for block in _BLOCK.findall(path.read_text()):
        lines = block.strip().splitlines()
        head = _HEAD.match(lines[0])
        if head is None:
            raise ValueError(f"{path}: a promql block must start with '# title. range: LOW..HIGH': "
                             f"{lines[0]!r}")
        expr = " ".join(line.strip() for line in lines[1:] if not line.strip().startswith("#"))
        title = head["title"].rstrip(". ")
        queries.append(Query(title, float(head["low"]), float(head["high"]), expr))
    return queries


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    board = json.loads(path.read_text())
    return [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]


def dashboard(queries: list[Query]) -> dict[str, Any]:
    """A Grafana dashboard: one time-series panel per query, two a row."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for index, query in enumerate(queries):
        labels = re.search(r"by \(([^)]*)\)", query.expr)
        legend = " ".join(f"{{{{{name.strip()}}}}}" for name in labels[1].split(",")) if labels else ""
        unit = "s" if "(s)" in query.title else "bytes" if "(bytes)" in query.title else (
            "percentunit" if query.high == 1 and "ready" not in query.title.lower() else "short")
        panels.append({
            "id": index + 1,
            "type": "timeseries",
            "title": query.title,
            "datasource": source,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": "A", "datasource": source, "expr": query.expr,
                         "legendFormat": legend or "__auto"}],
        })
    return {
        "title": "tensorserve",
        "uid": "tensorserve",
        "tags": ["tensorserve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{
            "name": "datasource", "type": "datasource", "query": "prometheus",
            "label": "Prometheus",
        }]},
        "panels": panels,
    }


def check_same_queries() -> list[Query]:
    queries = docs_queries()
    documented = [q.expr for q in queries]
    on_board = dashboard_queries()
    if documented != on_board:
        missing = sorted(set(documented) - set(on_board))
        extra = sorted(set(on_board) - set(documented))
        raise SystemExit(
            f"{DASHBOARD.name} and {DOCS.name} differ (run this script with --write-dashboard); "
            f"not on the dashboard: {missing}; not in the docs: {extra}"
        )
    return queries


# ---------------------------------------------------------------------- the live check
def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return bytes(response.read())


def _post(url: str, payload: dict[str, Any]) -> int:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


# A model that fails the batches holding a 13 (a bug in a model, as a caller
# meets it: a 500 model_failure); served beside the bundled repository so that
# the failure queries have something to show. The bundled models fail no valid
# request: an id past a vocabulary is a 400 ([[input]] max_value).
FAILING_MODEL = {
    "config.toml": (
        'max_batch_size = 8\nisolation = "thread"\n'
        '[[input]]\nname = "x"\ndtype = "float32"\nshape = [-1]\n'
        '[[output]]\nname = "y"\ndtype = "float32"\nshape = [-1]\n'
    ),
    "1/model.py": (
        "import torch\n\n\nclass Model(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        if (x == 13).any():\n"
        "            raise RuntimeError('poison value 13')\n"
        "        return x * 2\n"
    ),
}


def repository_with_a_failing_model(work: Path) -> Path:
    """The bundled models (linked) and ``failing``, in a repository of its own."""
    repository = work / "repository"
    repository.mkdir()
    for model in (ROOT / "model_repository").iterdir():
        if model.is_dir():
            (repository / model.name).symlink_to(model)
    for name, text in FAILING_MODEL.items():
        path = repository / "failing" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return repository


def bad_traffic(url: str, stop: threading.Event) -> dict[int, int]:
    """Invalid input, an unknown model, an out-of-vocabulary token and an item
    that fails its model, until ``stop``."""
    statuses: dict[int, int] = {}
    good_mask = {"name": "attention_mask", "datatype": "INT64", "shape": [1, 4], "data": [1] * 4}
    requests: list[tuple[str, dict[str, Any]]] = [
        ("tagger", {"inputs": [{"name": "input_ids", "datatype": "FP32", "shape": [1, 4],
                                "data": [1.5] * 4}, good_mask]}),
        ("no_such_model", {"inputs": []}),
        ("tagger", {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 4],
                                "data": [1, 2, 10**6, 3]}, good_mask]}),
        ("failing", {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                 "data": [1.0, 13.0, 2.0]}]}),
    ]
    while not stop.wait(0.1):
        for model, payload in requests:
            status = _post(f"{url}/v2/models/{model}/infer", payload)
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = json.loads(_get(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    if reply.get("status") != "success":
        raise RuntimeError(f"{expr}: {reply}")
    if reply["data"]["resultType"] != "vector":
        raise RuntimeError(f"{expr}: a {reply['data']['resultType']}, not a vector")
    return list(reply["data"]["result"])


def wait_until(condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except (OSError, RuntimeError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def live_check(queries: list[Query], load_seconds: float) -> int:
    sys.path.insert(0, str(ROOT))
    from tensorserve_bench.server import ServerProcess

    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        raise SystemExit("no `prometheus` on PATH (scripts/check_prometheus.sh installs it)")
    work = Path(tempfile.mkdtemp(prefix="tensorserve-prometheus-"))
    repository = repository_with_a_failing_model(work)
    server = ServerProcess(str(repository), log=work / "server.log").start()
    print(f"tensorserve at {server.url}")
    target = server.url.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tensorserve\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    prometheus_url = f"http://127.0.0.1:{port}"
    with open(work / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen(
            [prometheus_bin, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    stop = threading.Event()
    bad: dict[int, int] = {}
    bad_thread = threading.Thread(target=lambda: bad.update(bad_traffic(server.url, stop)))
    bench = None
    bench_log = open(work / "bench.log", "wb")  # noqa: SIM115 - the bench child writes to it
    failures = 0
    try:
        wait_until(lambda: _get(f"{prometheus_url}/-/ready") is not None, "Prometheus ready", 60)
        print(f"prometheus at {prometheus_url} ({prometheus_bin})")
        bench = subprocess.Popen(
            [sys.executable, "-m", "tensorserve", "bench", "tagger", "--url", server.url,
             "--concurrency", "8", "--duration", str(load_seconds + 60), "--warmup", "0",
             "--no-plots", "--no-progress", "--output", str(work / "bench.json")],
            stdout=subprocess.DEVNULL, stderr=bench_log, cwd=ROOT,
        )
        bad_thread.start()
        wait_until(lambda: query(prometheus_url, 'up{job="tensorserve"} == 1'),
                   "Prometheus scraping tensorserve", 60)
        # Every rate needs two samples in its window; give the load time to show.
        time.sleep(load_seconds)
        try:
            wait_until(lambda: all(query(prometheus_url, q.expr) for q in queries),
                       "every query to answer", 60)
        except SystemExit:
            # Go on: each query that still answers nothing is reported below by
            # name as a failure, with the logs kept.
            print("timed out after 60 s waiting for every query to answer")
        for q in queries:
            result = query(prometheus_url, q.expr)
            values = [float(sample["value"][1]) for sample in result]
            sane = bool(values) and all(math.isfinite(v) and q.low <= v <= q.high for v in values)
            failures += not sane
            shown = ", ".join(
                f"{_labels(s['metric'])}={float(s['value'][1]):.4g}" for s in result[:4]
            ) + (f", ... ({len(result)} series)" if len(result) > 4 else "")
            print(f"{'ok  ' if sane else 'FAIL'} {q.title} [{q.low:g}..{q.high:g}]: {shown or 'empty'}")
    finally:
        stop.set()
        if bad_thread.is_alive():
            bad_thread.join(15)
        if bench is not None:
            bench.terminate()
            bench.wait(15)
        bench_log.close()
        prometheus.terminate()
        prometheus.wait(15)
        server.stop()
        if failures:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"bad requests sent, by status: {dict(sorted(bad.items()))}")
    print(f"{len(queries) - failures} of {len(queries)} queries sane")
    return 1 if failures else 0


def _labels(metric: dict[str, str]) -> str:
    shown = {k: v for k, v in metric.items() if k not in ("__name__", "instance", "job")}
    return "{" + ",".join(f"{k}={v}" for k, v in sorted(shown.items())) + "}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-dashboard", action="store_true",
                        help=f"write {DASHBOARD.relative_to(ROOT)} from the docs' queries and exit")
    parser.add_argument("--load-seconds", type=float, default=20.0,
                        help="load before the queries are asked")
    args = parser.parse_args()
    if args.write_dashboard:
        DASHBOARD.write_text(json.dumps(dashboard(docs_queries()), indent=2) + "\n")
        print(f"wrote {DASHBOARD}")
        return 0
    queries = check_same_queries()
    print(f"{len(queries)} queries, the same in {DOCS.name} and {DASHBOARD.name}")
    return live_check(queries, args.load_seconds)


if __name__ == "__main__":
    sys.exit(main())

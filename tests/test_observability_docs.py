"""docs/observability.md against the code: every metric a server exposes is
documented and every documented one exists; the Grafana dashboard holds
exactly the docs' PromQL queries, each with its range. (The queries
themselves are evaluated by a real Prometheus in scripts/check_prometheus.sh.)"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tensorserve.http.app import create_app
from tensorserve.settings import Settings
from tests.helpers import ECHO, POISON_MODEL, write_toy_model

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "observability.md"


def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_prometheus",
                                                  ROOT / "scripts" / "check_prometheus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_dashboard_holds_exactly_the_documented_queries() -> None:
    check = checker()
    queries = check.docs_queries()
    assert len(queries) >= 10
    assert [q.expr for q in queries] == check.dashboard_queries()
    board = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    assert [p["title"] for p in board["panels"]] == [q.title for q in queries]
    assert board == check.dashboard(queries)  # rebuilt by --write-dashboard, not edited by hand
    for q in queries:
        assert q.low < q.high and q.expr and "#" not in q.expr, q
    text = " ".join(q.expr for q in queries)
    # What the issue asks an operator to be able to see.
    for needed in ("rate(tensorserve_requests_total", "histogram_quantile(0.99",
                   "tensorserve_batch_size_sum", "tensorserve_real_elements_total",
                   "tensorserve_rejections_total", "by (role) (rate(tensorserve_process_cpu_seconds_total",
                   "by (role) (tensorserve_event_loop_lag_seconds"):
        assert needed in text, needed


def _base(name: str) -> str:
    return name.removesuffix("_total")


async def test_every_exposed_metric_is_documented_and_every_documented_one_exposed(
    aiohttp_client: Any, tmp_path: Path
) -> None:
    write_toy_model(tmp_path, "echo", POISON_MODEL, **ECHO)
    client = await aiohttp_client(create_app(Settings(model_repository=tmp_path),
                                             wait_for_models=True))
    text = await (await client.get("/metrics")).text()
    exposed = {_base(f.name) for f in text_string_to_metric_families(text)
               if f.name.startswith("tensorserve_")}
    documented = {_base(n) for n in re.findall(r"`(tensorserve_[a-z0-9_]+)`", DOCS.read_text())}
    documented -= {"tensorserve_build"}  # the Info metric's name without its _info suffix
    assert exposed - documented == set(), "exposed but not documented"
    assert documented - exposed == set(), "documented but not exposed"
    # Triton's names too (metrics/triton.py), each in the side-by-side table.
    triton = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("nv_")}
    assert len(triton) == 10
    assert triton == set(re.findall(r"^\| `(nv_[a-z_]+)`", DOCS.read_text(), re.MULTILINE))
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= families

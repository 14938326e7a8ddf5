"""Tandem's Grafana dashboard: the committed JSON and panel documentation are what
``cluster/observability/grafana.py`` makes; the JSON is a well-formed dashboard whose every query is valid
PromQL (checked by promtool when it is installed) and names only metrics that
``cluster/observability/metrics.py`` defines. (That a real cluster's scrape has them is checked end to end in
tests/e2e/test_service.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.observability import grafana

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "helm" / "tandem" / "dashboards"


def test_committed_files_are_what_the_module_makes(tmp_path):
    assert grafana.main([str(tmp_path)]) == 0
    for name in ("tandem.json", "README.md"):
        assert (FOLDER / name).read_text() == (tmp_path / name).read_text(), (
            f"helm/tandem/dashboards/{name} is stale: run `python -m cluster.observability.grafana`")


def test_the_dashboard_is_well_formed():
    board = json.loads((FOLDER / "tandem.json").read_text())
    assert board["uid"] == "tandem-overview" and board["title"] == "Tandem"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["cluster"]["type"] == "query"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat") and panel["title"] and panel["description"]
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"] and '{cluster="$cluster"' in target["expr"], target["expr"]
    # Panels of one row never overlap.
    cells = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def test_the_issue_asks_for_these_panels():
    titles = {p["title"] for p in grafana.dashboard()["panels"]}
    for wanted in ("Goodput by SLO class", "SLO attainment by class", "TTFT percentiles by class",
                   "TPOT percentiles by class", "Queue and requests in flight", "KV cache use per worker",
                   "Prefix cache hit rate per worker", "Placements by path and policy", "KV received per decode worker",
                   "Mean KV transfer time", "Migrations", "Worker failures"):
        assert wanted in titles


def defined_metrics() -> set[str]:
    """Every metric cluster/observability/metrics.py defines, as Prometheus names it through Ray."""
    source = (ROOT / "cluster" / "observability" / "metrics.py").read_text()
    names = set()
    for kind, name in re.findall(r"metrics\.(Counter|Gauge|Histogram)\(\s*\"(tandem_[a-z_]+)\"", source):
        base = f"ray_{name}"
        names |= {f"{base}_total"} if kind == "Counter" else (
            {f"{base}_bucket", f"{base}_sum", f"{base}_count"} if kind == "Histogram" else {base})
    return names


def test_every_query_names_a_metric_the_cluster_defines():
    used = grafana.metric_names(grafana.dashboard())
    assert used and used <= defined_metrics(), used - defined_metrics()


def test_every_query_is_valid_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian: prometheus) is not installed")
    board = grafana.dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    rules = [{"record": f"tandem:check:{i}", "expr": expr.replace("$__rate_interval", "1m").replace("$cluster", "c")}
             for i, expr in enumerate(exprs)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "tandem-dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_preselected_cluster():
    board = grafana.dashboard(default_cluster="prod")
    cluster = next(v for v in board["templating"]["list"] if v["name"] == "cluster")
    assert cluster["current"]["value"] == "prod"

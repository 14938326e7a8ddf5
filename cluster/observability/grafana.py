"""Tandem's Grafana dashboard, built from the panel list below.

``python -m cluster.observability.grafana`` writes it to ``helm/tandem/dashboards/tandem.json`` (which the
Helm chart provisions for a Grafana sidecar) and the panel-by-panel description to
``helm/tandem/dashboards/README.md``; a test checks both are what this module makes, that the
JSON is a valid dashboard, and that every metric its queries name is on a real cluster's
scrape. ``tandem up`` writes the same dashboard beside the ones Ray generates for its session.

Every query reads Tandem's metrics (``cluster/observability/metrics.py``) as Prometheus names them, under
Ray's ``ray_`` prefix, for the cluster chosen by the ``cluster`` variable. Ray adds labels of
its own to each series (the process, the node), so queries aggregate by Tandem's labels:
``sum`` for counters and histograms (each ingress replica counts its own requests), ``max``
for gauges that several processes set to the same value (each router exports goodput).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

UID = "tandem-overview"
TITLE = "Tandem"
C = '{cluster="$cluster"}'
RATE = "[$__rate_interval]"


def _c(extra: str = "") -> str:
    """The cluster's label matcher, with more matchers when given."""
    return f'{{cluster="$cluster"{", " + extra if extra else ""}}}'


PLACED = _c('action="place"')
NOT_PLACED = _c('action!="place"')
UNSERVED = _c('outcome=~"unavailable|rejected"')


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    max_value: float | None = None


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"histogram_quantile({q}, sum by (le, slo_class) (rate(ray_{metric}_bucket{C}{RATE})))",
                  f"p{round(q * 100)} {{{{slo_class}}}}") for q in (0.5, 0.9, 0.99))


def _worker_rate(metric: str) -> str:
    """A counter's rate per worker (summed over the series Ray exports for it)."""
    return f"sum by (worker) (rate(ray_{metric}_total{C}{RATE}))"


PROPOSED, ACCEPTED = _worker_rate("tandem_spec_proposed_tokens"), _worker_rate("tandem_spec_accepted_tokens")

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Service level", (
        Panel("Serving", "1 while every ingress replica can serve: a decode (or colocated) worker can generate; "
              "0 while one cannot (its gRPC health says NOT_SERVING, Serve's check fails). The "
              "minimum over the replicas.",
              ((f"min(ray_tandem_serving{C})", "serving"),), kind="stat", width=4, max_value=1),
        Panel("Goodput by SLO class", "Requests per second, over the last minute, that met both their TTFT and TPOT "
              "objectives (DistServe's goodput), per SLO class, as the registry counts them: the numbers `tandem "
              "status` shows.",
              ((f"max by (slo_class) (ray_tandem_goodput_rps{C})", "{{slo_class}}"),), unit="reqps", width=10),
        Panel("SLO attainment by class", "Share of the last minute's requests of each class that met both "
              "objectives; a class with no requests in the last minute is not drawn.",
              ((f"max by (slo_class) (ray_tandem_slo_attainment{C}) and on (slo_class) "
                f"max by (slo_class) (ray_tandem_slo_requests{C}) > 0", "{{slo_class}}"),),
              unit="percentunit", width=10, max_value=1),
        Panel("Requests by outcome", "Finished requests per second by outcome: stop and length (served), abort "
              "(the caller went away), rejected (admission control), unavailable (no worker could serve it), "
              "invalid, not_found.",
              ((f"sum by (outcome) (rate(ray_tandem_requests_total{C}{RATE}))", "{{outcome}}"),), unit="reqps"),
        Panel("Requests finished per class (last minute)", "Requests of each SLO class that finished in the last "
              "minute, the denominator of the attainment above.",
              ((f"max by (slo_class) (ray_tandem_slo_requests{C})", "{{slo_class}}"),)),
        Panel("TTFT percentiles by class", "Time to first token as callers saw it (from the call's arrival at the "
              "API), p50, p90 and p99 per SLO class, from the tandem_ttft_seconds histogram.",
              _quantiles("tandem_ttft_seconds"), unit="s"),
        Panel("TPOT percentiles by class", "Time per output token after the first, p50, p90 and p99 per SLO class, "
              "from the tandem_tpot_seconds histogram.",
              _quantiles("tandem_tpot_seconds"), unit="s"),
    )),
    ("Router", (
        Panel("Queue and requests in flight", "Requests the routers hold until a pair can meet their objectives "
              "(queued), and requests placed and not finished (in flight), summed over the routers.",
              ((f"sum(ray_tandem_queue_length{C})", "queued"), (f"sum(ray_tandem_in_flight{C})", "in flight"))),
        Panel("Placements by path and policy", "Placements per second by policy and path: remote (a prefill worker "
              "computes the KV and sends it), local (the decode worker prefills the prompt itself), load_only (placed "
              "by load while the registry was unreachable).",
              ((f"sum by (policy, path) (rate(ray_tandem_router_decisions_total{PLACED}{RATE}))",
                "{{policy}} {{path}}"),), unit="ops"),
        Panel("Rejections and queueing", "Decisions that did not place a request at once, per second: reject "
              "(admission control refused it) and queue (it waited for a pair that can meet its objectives).",
              ((f"sum by (action) (rate(ray_tandem_router_decisions_total{NOT_PLACED}{RATE}))",
                "{{action}}"),), unit="ops"),
        Panel("Router warm-up", "Seconds each router took, when it (re)started, to rebuild its view from the "
              "registry (load reports, step-time fits) before its first placement; its prefix index is the "
              "registry's own, so a restarted router places as warm as before.",
              ((f"max by (policy) (ray_tandem_router_warm_up_seconds{C})", "{{policy}}"),), unit="s",
              kind="stat", width=6),
        Panel("Live planner: workers per role", "The planner's latest look (planner.mode advise or act): workers "
              "per role now (current) and in the split it proposes (proposed).",
              ((f"max by (split, role) (ray_tandem_planner_workers{C})", "{{split}} {{role}}"),), width=9),
        Panel("Live planner: predicted goodput per split", "Goodput the planner's simulator predicts for each "
              "prefill:decode split it simulated at its latest look.",
              ((f"max by (split) (ray_tandem_planner_predicted_goodput_rps{C})", "{{split}}"),), unit="reqps",
              width=9),
    )),
    ("Workers", (
        Panel("KV cache use per worker", "Share of each worker's KV blocks in use (blocks kept only for the prefix "
              "cache count as free).",
              ((f"max by (worker) (ray_tandem_kv_blocks_used{C}) / (max by (worker) (ray_tandem_kv_blocks_used{C}) "
                f"+ max by (worker) (ray_tandem_kv_blocks_free{C}))", "{{worker}}"),),
              unit="percentunit", width=8, max_value=1),
        Panel("Prefix cache hit rate per worker", "Share of prompt tokens each worker served from its prefix cache "
              "since it started.",
              ((f"max by (worker) (ray_tandem_prefix_cache_hit_rate{C})", "{{worker}}"),),
              unit="percentunit", width=8, max_value=1),
        Panel("Requests per worker", "Requests on each worker: waiting in its scheduler's queue, running in its "
              "batch, and receiving (their KV still landing).",
              ((f"max by (worker, state) (ray_tandem_worker_requests{C})", "{{worker}} {{state}}"),), width=8),
    )),
    ("KV host tier", (
        Panel("Host tier blocks per worker", "KV blocks each worker's host tier holds (kv.host_cache): blocks its "
              "device cache evicted, kept to be loaded back as prefix hits.",
              ((f"max by (worker) (ray_tandem_kv_host_blocks_used{C})", "{{worker}}"),), width=8),
        Panel("Host tier offloads and loads", "Blocks per second each worker copied to its host tier (offloaded) "
              "and loaded back as prefix hits (loaded).",
              ((_worker_rate("tandem_kv_host_offloaded_blocks"), "{{worker}} offloaded"),
               (_worker_rate("tandem_kv_host_loaded_blocks"), "{{worker}} loaded")), width=8),
        Panel("Host tier hit share", "Of the blocks a worker's host tier took, the share it loaded back: low means "
              "the tier mostly keeps blocks no prompt asks for again.",
              ((f"{_worker_rate('tandem_kv_host_loaded_blocks')} / {_worker_rate('tandem_kv_host_offloaded_blocks')}",
                "{{worker}}"),), unit="percentunit", width=8, max_value=1),
    )),
    ("Speculative decoding", (
        Panel("Guessed tokens proposed and accepted", "Tokens per second that each speculating worker guessed and "
              "checked (proposed), and those it kept because they equal the model's own (accepted).",
              ((PROPOSED, "{{worker}} proposed"), (ACCEPTED, "{{worker}} accepted")), width=8),
        Panel("Speculative acceptance rate per worker", "Share of guessed tokens kept, per worker; not drawn while "
              "it guesses none (a worker without decode.speculative, or an adaptive one whose batch is too busy "
              "for guesses to pay).",
              ((f"{ACCEPTED} / {PROPOSED}", "{{worker}}"),), unit="percentunit", width=8, max_value=1),
        Panel("Tokens per verify step", "Tokens a request's step emitted when it checked guesses (1 + accepted "
              "guesses per verifying request-step), per worker: the speed-up of those steps before their cost.",
              ((f"1 + {ACCEPTED} / {_worker_rate('tandem_spec_verify_steps')}", "{{worker}}"),), width=8),
    )),
    ("KV transfer", (
        Panel("KV received per decode worker", "Bytes of KV per second that each decode worker received from prefill "
              "workers.",
              ((_worker_rate("tandem_kv_transfer_bytes"), "{{worker}}"),), unit="Bps"),
        Panel("Mean KV transfer time", "Mean seconds from the start of a transfer's receive to its last layer "
              "landing (the prefill computes meanwhile when layers stream), per decode worker.",
              ((f"{_worker_rate('tandem_kv_transfer_seconds')} / {_worker_rate('tandem_kv_transfers')}", "{{worker}}"),),
              unit="s"),
    )),
    ("Failures", (
        Panel("Migrations", "Placements after the first, per second: worker_failed (a worker died under the request; "
              "its prompt and the tokens already sent moved elsewhere) and retry (its KV transfer failed).",
              ((f"sum by (reason) (rate(ray_tandem_migrations_total{C}{RATE}))", "{{reason}}"),), unit="ops"),
        Panel("Worker failures", "Requests that found a worker dead under them, per worker, over the last 5 minutes.",
              ((f"sum by (worker) (increase(ray_tandem_worker_failures_total{C}[5m]))", "{{worker}}"),)),
        Panel("Unavailable and rejected requests", "Requests per second that no worker could serve (unavailable) or "
              "that admission control refused (rejected).",
              ((f"sum by (outcome) (rate(ray_tandem_requests_total{UNSERVED}{RATE}))",
                "{{outcome}}"),), unit="reqps"),
    )),
)


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit, "min": 0}
    if panel.max_value is not None:
        defaults["max"] = panel.max_value
    out = {
        "id": panel_id, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }
    if panel.kind == "timeseries":
        out["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                          "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        out["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                          "colorMode": "background", "graphMode": "none"}
        out["fieldConfig"]["defaults"]["thresholds"] = {
            "mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}]}
        out["fieldConfig"]["defaults"]["mappings"] = [
            {"type": "value", "options": {"0": {"text": "NOT SERVING"}, "1": {"text": "SERVING"}}}]
    return out


def dashboard(default_cluster: str | None = None) -> dict:
    """The dashboard as Grafana's JSON model; ``default_cluster`` preselects a cluster."""
    panels, panel_id, y = [], 1, 0
    for row_title, row_panels in ROWS:
        panels.append({"id": panel_id, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y, x, height = panel_id + 1, y + 1, 0, 0
        for panel in row_panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    current = ({"selected": True, "text": default_cluster, "value": default_cluster} if default_cluster else {})
    return {
        "uid": UID, "title": TITLE, "tags": ["tandem", "llm-serving"], "timezone": "browser", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "graphTooltip": 1,
        "description": "Tandem: goodput and SLO attainment per class, latency, router decisions, workers' KV cache "
                       "and queues, speculative decoding, KV transfers, migrations and failures. Panel by panel: "
                       "helm/tandem/dashboards/README.md.",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            {"name": "cluster", "label": "Cluster", "type": "query",
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(ray_tandem_kv_blocks_free, cluster)", "refId": "cluster"},
             "definition": "label_values(ray_tandem_kv_blocks_free, cluster)", "current": current, "hide": 0,
             "refresh": 2, "includeAll": False, "multi": False, "options": [], "sort": 1},
        ]},
        "panels": panels,
    }


def dashboard_json(default_cluster: str | None = None) -> str:
    return json.dumps(dashboard(default_cluster), indent=2) + "\n"


def panel_doc() -> str:
    """The dashboard's panels, one by one, as Markdown."""
    lines = ["# Tandem's Grafana dashboard", "",
             "Generated by `python -m cluster.observability.grafana` from `cluster/observability/grafana.py` (do not edit by hand); "
             "`tandem.json` is the dashboard (uid `tandem-overview`). The Helm chart provisions it for a Grafana "
             "sidecar (`grafana.dashboards` in `values.yaml`); `tandem up` writes it beside Ray's own dashboards "
             "(see the top-level README, \"Metrics, dashboards and traces\").", "",
             "Variables: `datasource` (a Prometheus that scrapes the Ray metrics agents) and `cluster` (the "
             "topology's `cluster.name`, from the `cluster` label).", ""]
    for row_title, row_panels in ROWS:
        lines += [f"## {row_title}", "", "| panel | what it shows | query |", "| --- | --- | --- |"]
        for panel in row_panels:
            queries = "<br>".join(f"`{expr.replace('|', chr(92) + '|')}`" for expr, _ in panel.targets)
            lines.append(f"| {panel.title} | {panel.description} | {queries} |")
        lines.append("")
    return "\n".join(lines)


def metric_names(board: dict) -> set[str]:
    """Every Prometheus metric name the dashboard's queries (and variables) read."""
    import re

    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return {name for expr in exprs for name in re.findall(r"\bray_tandem_[a-z_]+", expr)}


def main(argv: list[str] | None = None) -> int:
    """Writes tandem.json and README.md into OUT_DIR (default: helm/tandem/dashboards)."""
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "helm" / "tandem" / "dashboards"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tandem.json").write_text(dashboard_json())
    (out / "README.md").write_text(panel_doc())
    print(f"[grafana] wrote {out / 'tandem.json'} and {out / 'README.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A cluster's status as ``tandem status`` and ``tandem top`` show it, read through the cluster's
API (``GetStatus``, answered by an ingress replica: ``cluster/ingress/status.py``).

The command line reads it through the API, not through Ray: no Ray client connects, so no
Ray job is registered per look (the dashboard's "Recent jobs" stays the cluster's own), and a
remote cluster needs only its API address (with its TLS and token, as ``tandem generate``).
Locally the state file that ``tandem up`` wrote names the address, the certificate and where
the token is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from google.protobuf.json_format import MessageToDict

from tandem.v1 import tandem_pb2

ROUTER_SUMS = ("in_flight", "waiting", "placed", "local_prefills", "rejected", "queued_decisions",
               "placed_by_load_only", "placed_after_waiting", "goodput_records_waiting", "prefill_path_remeasures")


# -- on the command line: the status as a mapping, and as text ----------------------------------

def status_dict(message: tandem_pb2.ClusterStatus, api: str | None = None, dashboard: str | None = None) -> dict:
    """``tandem status --json``: the workers, the routers summed (``router``, as with one
    router; ``routers`` counts them, ``each_router`` lists them), goodput (None while the
    registry is unreachable), and health."""
    raw = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    routers = raw.get("routers", [])
    for router in routers:
        for key in ROUTER_SUMS:
            router[key] = int(router.get(key, 0))
        router["rejected_by_class"] = {name: int(n) for name, n in router.get("rejected_by_class", {}).items()}
        router.setdefault("ttft_prediction_error", None)
        router.setdefault("warm_up_s", None)
    router = dict(routers[0]) if routers else {"policy": "-", "registry": "no router answers",
                                              **{k: 0 for k in ROUTER_SUMS}, "rejected_by_class": {}}
    router["rejected_by_class"] = dict(router["rejected_by_class"])
    for other in routers[1:]:
        for key in ROUTER_SUMS:
            router[key] += other[key]
        for name, n in other["rejected_by_class"].items():
            router["rejected_by_class"][name] = router["rejected_by_class"].get(name, 0) + n
    for worker in raw.get("workers", []):
        speculation = worker.setdefault("speculation", None)
        if speculation is not None:
            for key in ("proposed_tokens", "accepted_tokens", "verify_steps"):  # uint64: strings in JSON
                speculation[key] = int(speculation.get(key, 0))
        for key, counts in (("host_tier", ("offloaded_blocks", "loaded_blocks")),
                            ("pulls", ("pulled", "recomputed", "blocks")),
                            ("draft", ("prompt_tokens_fed", "prompts_received", "forwards"))):
            figures = worker.setdefault(key, None)
            for count in counts if figures is not None else ():
                figures[count] = int(figures.get(count, 0))
    goodput = None
    if message.HasField("last_minute"):
        goodput = {window: _windows(raw[window]) for window in ("last_minute", "last_hour")}
    return {"cluster": message.cluster, "model": message.model, "serving": message.serving, "health": message.health,
            "workers": raw.get("workers", []), "router": router, "routers": len(routers), "each_router": routers,
            "goodput": goodput, "worker_events": raw.get("worker_events", []), "planner": _planner(raw),
            "queued": router["waiting"], "in_flight": router["in_flight"], "api": api, "dashboard": dashboard}


def _windows(view: dict) -> dict:
    def window(values: dict) -> dict:
        values = dict(values)
        for key in ("requests", "met", "ttft_met", "tpot_met", "failed"):
            values[key] = int(values.get(key, 0))
        for key in ("mean_ttft_s", "mean_tpot_s"):
            values.setdefault(key, None)
        return values

    return {"cluster": window(view.get("cluster", {})),
            "classes": {name: window(v) for name, v in sorted(view.get("classes", {}).items())},
            "workers": {name: window(v) for name, v in sorted(view.get("workers", {}).items())}}


def worker_rows(status: dict) -> list[tuple[str, ...]]:
    """The workers table (header first) that ``tandem status`` and ``tandem top`` print."""
    rows = [("worker", "role", "TP", "state", "node", "KV used", "waiting", "running", "receiving", "hit rate")]
    for w in status["workers"]:
        if w.get("state") != "alive":
            rows.append((w["name"], w["role"], "-", w.get("state") or "dead", "-", "-", "-", "-", "-", "-"))
            continue
        state = "draining" if w.get("drain") == "draining" else w["state"]  # alive, taking no new requests
        rows.append((w["name"], w["role"], str(w["tp"]), state, node_label(w),
                     f"{w['kv_blocks_used']}/{w['kv_blocks']}", str(w["waiting"]), str(w["running"]),
                     str(w["receiving"]), f"{w['prefix_cache_hit_rate']:.0%}"))
    return rows


def node_label(worker: dict) -> str:
    """A worker's node as the table shows it: the start of its id (what tells nodes on one
    address apart) and its address."""
    node = worker.get("node_id") or ""
    return f"{node[:8]}@{worker.get('node_address') or '?'}" if node else "-"


def speculation_lines(status: dict) -> list[str]:
    """A line for each worker that decodes speculatively: its guessed tokens since it started."""
    lines = []
    for w in status["workers"]:
        spec = w.get("speculation")
        if w.get("state") == "alive" and spec:
            sizing = "adaptive" if spec["adaptive"] else "fixed"
            lines.append(f"{w['name']}: speculative decoding ({spec['method']}, up to {spec['num_tokens']} tokens, "
                         f"{sizing}): {spec['accepted_tokens']} of {spec['proposed_tokens']} guessed tokens accepted "
                         f"({spec['acceptance_rate']:.0%}), {spec['tokens_per_verify']:.2f} tokens per verify step")
    return lines


def draft_lines(status: dict) -> list[str]:
    """A line for each worker with a draft model: the prompt work its draft did since it started."""
    lines = []
    for w in status["workers"]:
        draft = w.get("draft")
        if w.get("state") != "alive" or not draft:
            continue
        if w["role"] == "prefill":
            lines.append(f"{w['name']}: draft model: built the draft KV of {draft['prompt_tokens_fed']} prompt tokens "
                         f"to send with the model's")
        else:
            lines.append(f"{w['name']}: draft model: {draft['prompts_received']} prompts' draft KV received with the "
                         f"model's, {draft['prompt_tokens_fed']} prompt tokens caught up here")
    return lines


def kv_tier_lines(status: dict) -> list[str]:
    """A line for each worker with a host KV tier or peer pulls: what they did since it started."""
    lines = []
    for w in status["workers"]:
        host, pulls = w.get("host_tier"), w.get("pulls")
        if w.get("state") != "alive" or not (host or pulls):
            continue
        parts = []
        if host:
            parts.append(f"host tier {host['used']}/{host['blocks']} blocks, {host['offloaded_blocks']} offloaded, "
                         f"{host['loaded_blocks']} loaded back ({host['load_seconds']:.2f} s)")
        if pulls:
            parts.append(f"{pulls['pulled']} pulls from peers ({pulls['blocks']} blocks), {pulls['recomputed']} "
                         f"recomputed instead")
        lines.append(f"{w['name']}: " + "; ".join(parts))
    return lines


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in rows]


def _by_class(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{name} {n}' for name, n in sorted(counts.items()))})" if counts else ""


def health_line(status: dict) -> str:
    return "serving" if status["serving"] else f"NOT SERVING: {status['health']}"


def format_status(status: dict) -> str:
    router = status["router"]
    lines = [f"cluster {status['cluster']}: model {status['model']}; API {status.get('api')}; dashboard "
             f"{status.get('dashboard') or 'off'}; {health_line(status)}",
             f"router {router['policy']} (registry {router['registry']}): {status['queued']} waiting for placement, "
             f"{status['in_flight']} placed and not finished, {router['rejected']} rejected"
             + _by_class(router.get("rejected_by_class", {}))]
    lines += table(worker_rows(status))
    lines += speculation_lines(status)
    lines += draft_lines(status)
    lines += kv_tier_lines(status)
    lines += [f"{w['name']}: takes no KV from {', '.join(w['unpaired'])} now (rebuilding the transfer group)"
              for w in status["workers"] if w.get("unpaired")]
    lines += worker_event_lines(status)
    lines += planner_lines(status)
    goodput = status.get("goodput")
    if goodput:
        for window in ("last_minute", "last_hour"):
            lines += goodput_lines(window.replace("_", " "), goodput[window])
    else:
        lines.append("goodput: registry unreachable")
    return "\n".join(lines)


def _planner(raw: dict) -> dict | None:
    planner = raw.get("planner")
    if not planner:
        return None
    defaults = {"number": 0, "at": 0.0, "mode": "", "current": "", "proposed": "", "acted": False,
                "predicted_goodput_rps": 0.0, "predicted_attainment": 0.0, "observed": "", "detail": "",
                "measured_goodput_rps": None, "measured_attainment": None, "measured_at": None,
                "measured_rate_rps": None, "expected_goodput_rps": None}  # proto3 leaves these out
    planner["decisions"] = [{**defaults, **d, "number": int(d.get("number", 0))} for d in planner.get("decisions", [])]
    return planner


def planner_lines(status: dict) -> list[str]:
    """The live planner's latest look and its decisions, oldest first."""
    from cluster.registry.planner_decisions import PlannerDecision

    planner = status.get("planner")
    if not planner:
        return []
    lines = [f"planner ({planner.get('mode', '')}): {planner.get('observed', '')}",
             f"  proposal: {planner.get('proposal', '')}" + (f" ({planner['waiting']})" if planner.get("waiting") else "")]
    decisions = planner.get("decisions") or []
    if decisions:
        lines.append("  decisions:")
        lines += [f"    {PlannerDecision.from_mapping(d).line()}" for d in decisions]
    return lines


def worker_event_lines(status: dict) -> list[str]:
    """The workers lost, started again, added, draining and removed, newest first."""
    from cluster.registry.worker_events import WorkerEvent

    events = status.get("worker_events") or []
    return ["worker events:"] + [f"  {WorkerEvent(**e).line()}" for e in events] if events else []


def goodput_lines(title: str, view: dict) -> list[str]:
    cluster = view["cluster"]
    lines = [f"{title}: {cluster['requests']} requests, goodput {cluster['goodput_rps']:.2f}/s, SLO attainment "
             f"{cluster['attainment']:.0%}"]
    for name, c in view["classes"].items():
        lines.append(f"  {name}: {c['requests']} requests, goodput {c['goodput_rps']:.2f}/s, attainment "
                     f"{c['attainment']:.0%}, mean TTFT {_ms(c['mean_ttft_s'])}, mean TPOT {_ms(c['mean_tpot_s'])}")
    return lines


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# -- on the command line: where the API is ------------------------------------------------------

@dataclass(frozen=True)
class ApiTarget:
    """How to reach a cluster's API: address, token and CA file (None: plain TCP)."""

    address: str
    token: str | None = None
    tls_ca: str | None = None
    dashboard: str | None = None


def api_target(cluster: str, addr: str | None, token_env: str | None, tls_ca: str | None) -> ApiTarget:
    """From ``--addr`` (with ``--token-env`` and ``--tls-ca``), else from the state file that
    ``tandem up`` wrote for ``cluster`` here. LookupError (one line) when neither says where."""
    from cluster.deployment.state_file import read_state, state_file

    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise LookupError(f"environment variable {token_env} (--token-env) is not set or empty")
    if addr:
        return ApiTarget(addr, token, tls_ca)
    state = read_state(cluster)
    if not state or not state.get("api"):
        raise LookupError(f"cluster {cluster!r} is not up here (no {state_file(cluster)}); give its API address "
                          "with --addr HOST:PORT")
    if token is None:
        token = _state_token(state)
    address = state["api"]
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "[::]"):  # bound to every interface: reach it here through loopback
        address = f"localhost:{port}"
    ca = tls_ca or (state.get("tls_cert") if state.get("tls") else None)
    return ApiTarget(address, token, ca, state.get("dashboard"))


def _state_token(state: dict) -> str | None:
    env, path = state.get("auth_token_env"), state.get("auth_token_file")
    if env:
        token = os.environ.get(env)
        if not token:
            raise LookupError(f"the cluster's API wants a token from environment variable {env} (server.auth_token_env), "
                              "which is not set here; set it, or give --token-env")
        return token
    if path:
        try:
            return open(os.path.expanduser(path), encoding="utf-8").read().strip()
        except OSError as exc:
            raise LookupError(f"cannot read the API token file {path} (server.auth_token_file): "
                              f"{exc.strerror or exc}") from None
    return None


def fetch_status(target: ApiTarget, timeout_s: float = 30.0) -> dict:
    """The cluster's status through its API; LookupError (one line) when it cannot be read."""
    from tandem.client import TandemClient, TandemError

    try:
        client = TandemClient(target.address, token=target.token, tls_ca_file=target.tls_ca, timeout_s=timeout_s)
    except OSError as exc:
        raise LookupError(f"cannot read the CA file {target.tls_ca}: {exc.strerror or exc}") from None
    with client:
        try:
            message = client.status()
        except TandemError as exc:
            raise LookupError(f"cannot read the status from {target.address}: {exc}") from None
    return status_dict(message, target.address, target.dashboard)

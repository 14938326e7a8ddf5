"""``tandem status`` and ``tandem top`` from a ``ClusterStatus`` message: the mapping of
``--json`` (routers summed as one, goodput or None), the text, a frame of ``top`` with rates
between frames, and where the API is (``--addr``, or the state `tandem up` wrote, with its
certificate and token source)."""

from __future__ import annotations

import io
import json

import pytest

from cluster.cli.status import api_target, format_status, status_dict
from cluster.cli.top import render, run_top
from cluster.ingress.status import _fields
from tandem.v1 import tandem_pb2

pytestmark = pytest.mark.unit


def message(placed: int = 7, goodput: bool = True) -> tandem_pb2.ClusterStatus:
    m = tandem_pb2.ClusterStatus(cluster="c1", model="m", serving=True)
    m.workers.add(name="prefill-0", role="prefill", state="alive", tp=2, kv_blocks_used=3, kv_blocks=64, waiting=1,
                  running=0, receiving=0, prefix_cache_hit_rate=0.5, registry="ok", node_id="a1b2c3d4e5f60718",
                  node_address="10.0.0.5")
    m.workers.add(name="decode-0", role="decode", state="dead")
    m.workers.add(name="decode-1", role="decode", state="alive", tp=1, kv_blocks=64, registry="ok",
                  unpaired=["prefill-0"], pair_rebuilds=1)
    m.worker_events.add(event="node_lost", node_id="ffee00112233", node_address="10.0.0.6", at=1_700_000_003.0)
    m.worker_events.add(worker="decode-0", role="decode", event="lost", node_id="ffee00112233", node_address="10.0.0.6",
                        at=1_700_000_000.0, detail="The actor died unexpectedly")
    for i in range(2):
        r = m.routers.add(name=f"router-{i}", policy="slo", registry="ok", waiting=1, in_flight=2, placed=placed,
                          rejected=1 + 2 * i, failed_workers=["decode-0"], prefill_path_remeasures=3 + i)
        r.ttft_correction_s["remote"] = 0.01
        r.rejected_by_class["standard"] = 1
        if i:
            r.rejected_by_class["interactive"] = 2
            r.warm_up_s = 0.0146  # started again: its view rebuilt from the registry
    if goodput:
        for window in (m.last_minute, m.last_hour):
            window.cluster.CopyFrom(tandem_pb2.SloWindow(window_s=60, requests=4, met=3, goodput_rps=0.05,
                                                         attainment=0.75))
            window.classes["standard"].CopyFrom(tandem_pb2.SloWindow(window_s=60, requests=4, met=3, goodput_rps=0.05,
                                                                     attainment=0.75, mean_ttft_s=0.2))
    return m


def test_status_dict_sums_the_routers_and_keeps_the_shape_of_status_json():
    status = status_dict(message(), api="127.0.0.1:1", dashboard=None)
    json.dumps(status)  # plain JSON
    assert status["router"]["placed"] == 14 and status["router"]["waiting"] == 2 and status["queued"] == 2
    assert status["router"]["prefill_path_remeasures"] == 7  # summed
    assert status["in_flight"] == 4 and status["routers"] == 2 and len(status["each_router"]) == 2
    assert status["router"]["ttft_correction_s"] == {"remote": 0.01}
    assert status["router"]["ttft_prediction_error"] is None
    assert [r["warm_up_s"] for r in status["each_router"]] == [None, 0.0146]
    assert status["router"]["rejected_by_class"] == {"standard": 2, "interactive": 2}  # summed over the routers
    workers = {w["name"]: w for w in status["workers"]}
    assert workers["prefill-0"]["kv_blocks_used"] == 3 and workers["prefill-0"]["tp"] == 2
    assert workers["decode-0"]["state"] == "dead"
    assert (workers["prefill-0"]["node_id"], workers["prefill-0"]["node_address"]) == ("a1b2c3d4e5f60718", "10.0.0.5")
    assert status["worker_events"] == [
        {"worker": "", "role": "", "event": "node_lost", "node_id": "ffee00112233", "node_address": "10.0.0.6",
         "at": 1_700_000_003.0, "detail": ""},
        {"worker": "decode-0", "role": "decode", "event": "lost", "node_id": "ffee00112233", "node_address": "10.0.0.6",
         "at": 1_700_000_000.0, "detail": "The actor died unexpectedly"}]
    minute = status["goodput"]["last_minute"]
    assert minute["cluster"]["requests"] == 4 and minute["classes"]["standard"]["mean_ttft_s"] == 0.2
    assert minute["classes"]["standard"]["mean_tpot_s"] is None
    assert status_dict(message(goodput=False))["goodput"] is None


def test_format_status_lists_workers_health_and_goodput():
    text = format_status(status_dict(message(), api="127.0.0.1:1"))
    assert "cluster c1: model m; API 127.0.0.1:1; dashboard off; serving" in text
    assert "2 waiting for placement, 4 placed and not finished, 4 rejected (interactive 2, standard 2)" in text
    assert "prefill-0  prefill  2   alive  a1b2c3d4@10.0.0.5  3/64" in text
    assert "decode-0   decode   -   dead   -" in text
    lines = text.splitlines()
    events_at = lines.index("worker events:")
    assert lines[events_at:events_at + 3] == [
        "worker events:", "  2023-11-14 22:13:23 UTC: node ffee00112233 (10.0.0.6) left the cluster",
        "  2023-11-14 22:13:20 UTC: decode-0 lost on node ffee00112233 (10.0.0.6): The actor died unexpectedly"]
    assert "decode-1: takes no KV from prefill-0 now (rebuilding the transfer group)" in text
    assert "last minute: 4 requests, goodput 0.05/s, SLO attainment 75%" in text
    assert "  standard: 4 requests, goodput 0.05/s, attainment 75%, mean TTFT 200 ms, mean TPOT -" in text
    down = message(goodput=False)
    down.serving, down.health = False, "no decode worker can generate (decode-0 dead)"
    text = format_status(status_dict(down))
    assert "NOT SERVING: no decode worker can generate (decode-0 dead)" in text
    assert "goodput: registry unreachable" in text


def test_a_top_frame_shows_rates_since_the_last_frame():
    first, second = status_dict(message(placed=7), api="a"), status_dict(message(placed=12), api="a")
    frame = render(second, first, 2.0, 0.0)
    assert "placed 24 (5.0/s)" in frame and "rejected 4 (0.0/s)" in frame
    assert "failed workers: decode-0" in frame
    assert "prefill-0" in frame and "#" in frame.split("prefill-0")[1].splitlines()[0]  # the KV bar
    assert "goodput, last minute: 4 requests" in frame
    assert "placed 14," in render(first, None, None, 0.0)


def test_top_draws_frames_until_its_iterations(monkeypatch):
    frames = iter([message(placed=1), message(placed=3)])
    monkeypatch.setattr("cluster.cli.top.fetch_status", lambda target, timeout_s: status_dict(next(frames), target.address))
    out = io.StringIO()
    from cluster.cli.status import ApiTarget

    assert run_top(ApiTarget("x:1"), interval_s=0.01, iterations=2, out=out) == 0
    text = out.getvalue()
    assert text.count("tandem top - ") == 2 and "\x1b[" not in text  # not a terminal: frames one after another


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))

    def write(**fields):
        path = tmp_path / "clusters" / "c1.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"pid": 1, "api": "0.0.0.0:5000", "dashboard": None, **fields}))

    return write


def test_the_api_from_the_state_file(state, tmp_path, monkeypatch):
    state(tls=True, tls_cert="/etc/cert.pem", auth_token_env="MY_TOKEN")
    monkeypatch.setenv("MY_TOKEN", "s3cret")
    target = api_target("c1", None, None, None)
    assert (target.address, target.token, target.tls_ca) == ("localhost:5000", "s3cret", "/etc/cert.pem")
    monkeypatch.delenv("MY_TOKEN")
    with pytest.raises(LookupError, match="MY_TOKEN"):
        api_target("c1", None, None, None)
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    state(tls=False, auth_token_file=str(token_file))
    target = api_target("c1", None, None, None)
    assert (target.token, target.tls_ca) == ("from-file", None)


def test_addr_needs_no_state_and_a_missing_cluster_says_what_to_give(state, monkeypatch):
    monkeypatch.setenv("T", "tok")
    target = api_target("nowhere", "10.0.0.5:50051", "T", "/ca.pem")
    assert (target.address, target.token, target.tls_ca) == ("10.0.0.5:50051", "tok", "/ca.pem")
    with pytest.raises(LookupError, match="cluster 'nowhere' is not up here .* give its API address with --addr"):
        api_target("nowhere", None, None, None)
    with pytest.raises(LookupError, match="environment variable UNSET_TOKEN_VAR"):
        api_target("nowhere", "h:1", "UNSET_TOKEN_VAR", None)


def speculating_worker(**counts) -> dict:
    """A decode worker's status() as the worker answers it, speculation included."""
    from types import SimpleNamespace

    from cluster.engine.engine import EngineStats
    from cluster.engine.speculative.config import SpeculativeConfig
    from cluster.worker.engine_worker import EngineWorker

    stats = EngineStats(**counts)
    speculation = EngineWorker._speculation(SimpleNamespace(engine=SimpleNamespace(
        speculative=SpeculativeConfig(num_tokens=4, adaptive=False), stats=stats)))
    return {"name": "decode-1", "role": "decode", "tp": 1, "state": "alive", "pid": 7, "threads": 2,
            "kv_blocks_used": 2, "kv_blocks": 64, "waiting": 0, "running": 1, "receiving": 0,
            "prefix_cache_hit_rate": 0.0, "registry": "ok", "speculation": speculation}


def test_a_worker_that_speculates_shows_its_guesses_through_the_api():
    from cluster.ingress.status import _fields

    worker = speculating_worker(proposed_tokens=300, accepted_tokens=120, verify_steps=100)
    assert worker["speculation"] == {"method": "ngram", "num_tokens": 4, "adaptive": False, "proposed_tokens": 300,
                                     "accepted_tokens": 120, "verify_steps": 100, "acceptance_rate": 0.4,
                                     "tokens_per_verify": 2.2}
    m = tandem_pb2.ClusterStatus(cluster="c1", model="m", serving=True)
    m.workers.add(**_fields(tandem_pb2.WorkerStatus, worker))  # as the ingress reads it
    m.workers.add(**_fields(tandem_pb2.WorkerStatus, {**worker, "name": "decode-2", "speculation": None}))
    status = status_dict(m)
    json.dumps(status)
    first, second = status["workers"]
    assert first["speculation"] == worker["speculation"] and second["speculation"] is None
    text = format_status(status)
    line = ("decode-1: speculative decoding (ngram, up to 4 tokens, fixed): 120 of 300 guessed tokens accepted (40%), "
            "2.20 tokens per verify step")
    assert line in text.splitlines() and "decode-2: speculative" not in text
    assert line in render(status, None, None, 0.0).splitlines()


def test_a_worker_that_has_not_guessed_yet_shows_zeros():
    worker = speculating_worker()
    assert (worker["speculation"]["proposed_tokens"], worker["speculation"]["acceptance_rate"],
            worker["speculation"]["tokens_per_verify"]) == (0, 0.0, 0.0)


def test_the_live_planner_s_look_and_decisions_are_shown():
    m = message()
    assert status_dict(m)["planner"] is None and "planner" not in format_status(status_dict(m))  # off: nothing
    m.planner.CopyFrom(tandem_pb2.PlannerStatus(mode="act", latest_at=1_700_000_100.0,
                                                observed="3.00 req/s offered, 1024 in / 16 out (last 60 s)",
                                                proposal="keep 2P+1D: predicted goodput 2.90 req/s",
                                                waiting="the current split is the best"))
    m.planner.decisions.add(number=1, at=1_700_000_000.0, mode="act", current="1P+2D", proposed="2P+1D", acted=True,
                            predicted_goodput_rps=2.5, predicted_attainment=1.0, observed="...", detail="now 2P+1D",
                            measured_goodput_rps=2.0, measured_attainment=0.9, measured_at=1_700_000_060.0)
    m.planner.decisions.add(number=2, at=1_700_000_050.0, mode="act", current="2P+1D", proposed="1P+2D",
                            predicted_goodput_rps=1.0, detail="resize failed: no room")  # not acted, not measured
    view = status_dict(m)
    assert view["planner"]["decisions"][1]["measured_goodput_rps"] is None
    text = format_status(view).splitlines()
    start = text.index("planner (act): 3.00 req/s offered, 1024 in / 16 out (last 60 s)")
    assert text[start + 1:start + 5] == [
        "  proposal: keep 2P+1D: predicted goodput 2.90 req/s (the current split is the best)",
        "  decisions:",
        "    22:13:20 resized 1P+2D -> 2P+1D: predicted 2.50 req/s (100%), measured 2.00 req/s (90%), +25%; now 2P+1D",
        "    22:14:10 did not resize 2P+1D -> 1P+2D: predicted 1.00 req/s (0%); resize failed: no room",
    ]
    assert json.loads(json.dumps(view))["planner"]["decisions"][0]["number"] == 1


def test_a_draining_worker_and_the_resize_steps_in_the_status():
    m = tandem_pb2.ClusterStatus(cluster="c1", model="m", serving=True)
    m.workers.add(name="decode-0", role="decode", state="alive", tp=1, kv_blocks_used=5, kv_blocks=64, running=2,
                  registry="ok", drain="draining", node_id="a1b2c3d4e5f60718", node_address="10.0.0.5")
    m.workers.add(name="decode-1", role="decode", state="alive", tp=1, kv_blocks=64, registry="ok", drain="serving")
    for event, at, detail in (("removed", 3.0, "drained in 1.3s"), ("draining", 2.0, ""), ("added", 1.0, "")):
        worker = "decode-1" if event == "added" else "decode-0"
        m.worker_events.add(worker=worker, role="decode", event=event, node_id="a1b2c3d4e5f60718",
                            node_address="10.0.0.5", at=1_700_000_000.0 + at, detail=detail)
    status = status_dict(m)
    assert [(w["name"], w["drain"]) for w in status["workers"]] == [("decode-0", "draining"), ("decode-1", "serving")]
    lines = format_status(status).splitlines()
    assert any(line.startswith("decode-0  decode  1   draining  a1b2c3d4@10.0.0.5  5/64") for line in lines), lines
    events_at = lines.index("worker events:")
    assert lines[events_at + 1:events_at + 4] == [
        "  2023-11-14 22:13:23 UTC: decode worker decode-0 removed on node a1b2c3d4e5f6 (10.0.0.5) (drained in 1.3s)",
        "  2023-11-14 22:13:22 UTC: decode worker decode-0 draining on node a1b2c3d4e5f6 (10.0.0.5)",
        "  2023-11-14 22:13:21 UTC: decode worker decode-1 added on node a1b2c3d4e5f6 (10.0.0.5)"]


def test_an_add_waiting_for_a_node_and_one_given_up_are_one_line_each():
    from cluster.registry.worker_events import NOT_ADDED, WAITING, WorkerEvent

    waiting = WorkerEvent("prefill-2", "prefill", WAITING, "", "", at=1_700_000_000.0, detail="1 CPU, 1 tandem-prefill")
    assert waiting.line() == ("2023-11-14 22:13:20 UTC: prefill worker prefill-2 waiting for a node with "
                              "1 CPU, 1 tandem-prefill")
    gave_up = WorkerEvent("prefill-2", "prefill", NOT_ADDED, "", "", at=1_700_000_300.0, detail="cannot place it")
    assert gave_up.line() == "2023-11-14 22:18:20 UTC: prefill worker prefill-2 not added: cannot place it"


def test_host_tier_and_peer_pulls_show_per_worker():
    """A worker's host KV tier and a decode worker's pulls from peers, from the worker's status
    (``cluster/worker/engine_worker.py``, ``decode_worker/worker.py``) through the message."""
    m = tandem_pb2.ClusterStatus(cluster="c1", model="m", serving=True)
    m.workers.add(**_fields(tandem_pb2.WorkerStatus, {
        "name": "decode-0", "role": "decode", "state": "alive", "tp": 1, "kv_blocks": 64, "registry": "ok",
        "host_tier": {"blocks": 256, "used": 40, "offloaded_blocks": 120, "loaded_blocks": 80, "load_seconds": 0.25},
        "pulls": {"pulled": 3, "recomputed": 1, "blocks": 17}}))
    m.workers.add(name="prefill-0", role="prefill", state="alive", tp=1, kv_blocks=64, registry="ok")
    status = status_dict(m)
    json.dumps(status)
    workers = {w["name"]: w for w in status["workers"]}
    assert workers["decode-0"]["host_tier"] == {"blocks": 256, "used": 40, "offloaded_blocks": 120, "loaded_blocks": 80,
                                                "load_seconds": 0.25}
    assert workers["decode-0"]["pulls"] == {"pulled": 3, "recomputed": 1, "blocks": 17}
    assert workers["prefill-0"]["host_tier"] is None and workers["prefill-0"]["pulls"] is None
    assert ("decode-0: host tier 40/256 blocks, 120 offloaded, 80 loaded back (0.25 s); 3 pulls from peers "
            "(17 blocks), 1 recomputed instead") in format_status(status).splitlines()


def test_a_draft_models_prompt_work_shows_per_worker():
    """``decode.speculative`` with a draft: a prefill worker builds the draft's KV of what it
    sends; a decode worker receives it, or catches up on the prompt itself."""
    m = tandem_pb2.ClusterStatus(cluster="c1", model="m", serving=True)
    m.workers.add(**_fields(tandem_pb2.WorkerStatus, {"name": "prefill-0", "role": "prefill", "state": "alive",
                                                      "draft": {"prompt_tokens_fed": 640, "forwards": 12}}))
    m.workers.add(**_fields(tandem_pb2.WorkerStatus, {"name": "decode-0", "role": "decode", "state": "alive",
                                                      "draft": {"prompt_tokens_fed": 30, "prompts_received": 9,
                                                                "forwards": 400}}))
    status = status_dict(m)
    assert status["workers"][1]["draft"] == {"prompt_tokens_fed": 30, "prompts_received": 9, "forwards": 400}
    lines = format_status(status).splitlines()
    assert "prefill-0: draft model: built the draft KV of 640 prompt tokens to send with the model's" in lines
    assert "decode-0: draft model: 9 prompts' draft KV received with the model's, 30 prompt tokens caught up here" in lines

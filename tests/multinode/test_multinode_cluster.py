"""A real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a raylet per node,
all on 127.0.0.1, told apart by custom resources; token authentication on), with topologies that
pin the prefill and decode pools to nodes through ``node.resources``.

- Prefill on one node, decode on another: the greedy tokens are the colocated engine's (and the
  transformers reference's); every prompt's KV crossed from one node to the other; each worker's
  status, registry record and ``tandem status`` name its node, and the decode worker's stream is
  reached at its node's address.
- Two decode nodes, one removed mid-stream (its raylet and every worker on it killed): every
  stream completes with the tokens of an undisturbed run; the registry drops the dead node's
  worker and blocks; routers place on the survivor; ``tandem status`` says which worker and node
  went and when. A node added back is placed on: the lost worker starts again there, paired with
  the prefill worker again, and serves requests with exact tokens.
- Two prefill nodes and a decode node, one prefill node removed while its worker prefills requests
  whose KV it streams (frozen first, so they are caught mid-transfer however fast it runs): every
  request completes with the tokens of an undisturbed run (its transfer retried on the other
  prefill worker), as its trace shows; the registry drops the dead node's worker and blocks;
  routers place on the survivor; no block stays referenced; ``tandem status`` says what went.
- A worker added (the live planner's ``act``, ``tandem scale add``) whose resources no node has
  free waits for one (``ray.node_wait_s``), saying so in the worker events: past the bound its
  placement group is removed, nothing is left and the decision is kept as not done in one line;
  a node that joins while it waits (as KubeRay's autoscaler starts one) takes it, and it serves.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.offline.disaggregated import DisaggregatedLLM, PoolResources
from cluster.registry.keys import Keys
from cluster.registry.kv_index import KVIndexReader
from cluster.registry.load import read_loads
from cluster.registry.reporter import connect
from cluster.registry.worker_events import read_events
from cluster.runtime.ray_runtime import ray_environment
from conftest import random_prompts, wait_for
from reference_checks import (
    MAX_TOKENS, PROMPT_LENGTHS, assert_equivalent, colocated_tokens, greedy, reference_greedy, run_batch,
)

pytestmark = pytest.mark.multinode

CLUSTER = "tandem-multinode-tests"
BLOCKS = 64
NODE = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 * 1024**2, include_dashboard=False)
# The GCS finds a node gone after 3 failed health checks a second apart (Ray's default: 5, 3 s
# apart): the node-loss test waits for that to see the node's loss recorded.
HEAD = dict(NODE, _system_config={"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                                  "health_check_failure_threshold": 3})


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node (the driver's: no worker is pinned to it) and a node for prefill workers
    (resource ``prefill_node``); tests add and remove the other nodes. Token authentication is
    on, as on every Ray that Tandem starts."""
    ray_environment()  # workers at nice 0: read by each raylet started here
    import ray
    from ray._private.authentication.authentication_token_setup import enable_token_auth_by_default
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # another tier's Ray in this process: this one is a cluster of its own
        ray.shutdown()
    enable_token_auth_by_default()
    cluster = Cluster(initialize_head=True, head_node_args=HEAD)
    try:
        nodes = {"prefill": cluster.add_node(**NODE, resources={"prefill_node": 1})}
        ray.init(address=cluster.address, namespace=CLUSTER, log_to_driver=False)
        assert is_token_auth_enabled()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def disaggregated(model_dir, cluster, decode_resources, prefill_resources=(("prefill_node", 0.01),),
                  **kwargs) -> DisaggregatedLLM:
    kwargs = {"num_kv_blocks": BLOCKS, "max_num_batched_tokens": 96, "verbose": False,
              "local_prefill_max_tokens": 0, "num_threads": 1, **kwargs}  # every prompt's KV travels
    pools = {"prefill": PoolResources(resources=prefill_resources),
             "decode": PoolResources(resources=decode_resources)}
    return DisaggregatedLLM.from_args(str(model_dir), cluster_name=CLUSTER, ray_address=cluster.address, pools=pools,
                                      **kwargs)


def remove_node_with_frozen_worker(cluster, node, pid: int) -> None:
    """The node gone as in a crash: its raylet and every process on it killed, the worker frozen
    (SIGSTOP) on it too (a frozen process cannot see its raylet die and exit, and would keep its
    ports)."""
    cluster.remove_node(node, allow_graceful=False)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def cluster_status(llm: DisaggregatedLLM) -> dict:
    """``tandem status --json`` of this deployment, read as an ingress replica answers it."""
    from cluster.cli.status import status_dict
    from cluster.ingress.health import HealthMonitor
    from cluster.ingress.status import read_status

    async def read():
        monitor = HealthMonitor(llm.path)
        await monitor.check_now()
        return await read_status(monitor)

    return status_dict(llm._on_loop(read()))


def test_prefill_and_decode_on_different_nodes_give_the_colocated_tokens(checkpoint, reference_model, ray_cluster):
    cluster, nodes = ray_cluster
    decode_node = cluster.add_node(**NODE, resources={"decode_node": 1})
    model_dir = checkpoint("llama")
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    try:
        with disaggregated(model_dir, cluster, (("decode_node", 0.01),)) as llm:
            outputs = llm.generate(prompts, greedy())
            assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
            assert [o.token_ids for o in outputs] == run_batch(model_dir).tokens
            reference = reference_model(model_dir)
            for prompt, output in zip(prompts, outputs):
                expected, scores = reference_greedy(reference, prompt, MAX_TOKENS)
                assert_equivalent(output.token_ids, expected, scores, __import__("torch").float32, "multinode")
            # Every prompt's KV crossed from the prefill node to the decode node.
            sent = {t.request_id: (t.prefill_worker, t.decode_worker, t.blocks_sent) for t in llm.transfers}
            assert [sent[o.request_id] for o in outputs] == [("prefill-0", "decode-0", -(-n // 16))
                                                            for n in PROMPT_LENGTHS]
            where = {nodes["prefill"].node_id: "prefill-0", decode_node.node_id: "decode-0"}
            # Each worker's status, registry record and `tandem status` row name its node.
            statuses = {w["name"]: w for w in llm.worker_status()}
            assert {w["node_id"]: n for n, w in statuses.items()} == where
            assert all(w["node_address"] == "127.0.0.1" for w in statuses.values())
            registry = connect(llm.registry_url)
            loads = read_loads(registry, CLUSTER, ["prefill-0", "decode-0"])
            registry.close()
            assert {load.node_id: name for name, load in loads.items()} == where
            status = cluster_status(llm)
            assert {w["node_id"]: w["name"] for w in status["workers"]} == where
            from cluster.cli.status import format_status

            text = format_status(status)
            assert f"decode-0   decode   1   alive  {decode_node.node_id[:8]}@127.0.0.1" in text
            # The decode worker's stream listens on its node's address.
            assert llm.path._addresses["decode-0"].rpartition(":")[0] == decode_node.node_ip_address
    finally:
        cluster.remove_node(decode_node)


def test_a_decode_node_lost_mid_stream_then_added_back(checkpoint, ray_cluster):
    """Two decode nodes (one decode worker each: a rank takes a node's whole ``decode_pool``);
    the node of decode-0 is removed while it streams."""
    cluster, nodes = ray_cluster
    decode_nodes = [cluster.add_node(**NODE, resources={"decode_pool": 1}) for _ in range(2)]
    model_dir = checkpoint("llama")
    prompts = random_prompts([30, 45, 20, 60], seed=12)
    params = greedy(300)
    expected = colocated_tokens(model_dir, prompts, params)
    later = random_prompts([25, 40], seed=13)
    expected_later = colocated_tokens(model_dir, later, greedy(16))
    added = []
    try:
        with disaggregated(model_dir, cluster, (("decode_pool", 1.0),), decode_workers=2, policy="round_robin",
                           num_kv_blocks=160) as llm:
            node_of = {w["name"]: w["node_id"] for w in llm.worker_status()}
            lost = next(n for n in decode_nodes if n.node_id == node_of["decode-0"])
            assert node_of["decode-1"] != lost.node_id
            ids = [f"m{i}" for i in range(len(prompts))]
            for request_id, prompt in zip(ids, prompts):
                llm.engine.add_request(request_id, prompt, params)

            def frozen_while_generating() -> bool:
                """decode-0 stopped (SIGSTOP) as soon as it generates: its streams are all mid-way
                when its node goes, however quickly it decodes and the node is torn down."""
                worker = next(w for w in llm.worker_status() if w["name"] == "decode-0")
                if worker.get("running"):
                    os.kill(worker["pid"], signal.SIGSTOP)
                return worker["pid"] if worker.get("running") else None

            frozen = wait_for(frozen_while_generating, timeout_s=120, what="decode-0 to be generating", every_s=0.01)
            remove_node_with_frozen_worker(cluster, lost, frozen)
            outputs = llm.run_until_done(ids)
            assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(prompts)
            assert [o.token_ids for o in outputs] == expected
            assert any(llm.migrations.get(i) for i in ids), "no request moved: nothing was tested"

            # The registry holds no worker or block of the dead node once its heartbeat is out.
            registry = connect(llm.registry_url)
            index = KVIndexReader(registry, CLUSTER)

            def dead_node_gone() -> bool:
                loads = read_loads(registry, CLUSTER, ["prefill-0", "decode-0", "decode-1"])
                held = [k for k in registry.scan_iter(Keys(CLUSTER).block("*")) if registry.hexists(k, "decode-0")]
                return ("decode-0" not in index.alive_workers() and "decode-0" not in loads and not held
                        and not registry.exists(Keys(CLUSTER).worker_blocks("decode-0"))
                        and all(load.node_id != lost.node_id for load in loads.values()))

            wait_for(dead_node_gone, timeout_s=30, what="the dead node's worker and blocks to leave the registry")
            # Routers place on the survivor only, and `tandem status` says which worker and node went, and when.
            after = llm.generate(later, greedy(16))
            assert [(o.error, o.token_ids) for o in after] == [(None, e) for e in expected_later]
            assert {llm.decisions[o.request_id].decode for o in after} == {"decode-1"}
            wait_for(lambda: any(e.event == "node_lost" for e in read_events(registry, CLUSTER)), timeout_s=60,
                     what="Ray to find the node dead")
            status = cluster_status(llm)
            events = [(e["event"], e["worker"], e["node_id"]) for e in status["worker_events"]]
            assert events == [("node_lost", "", lost.node_id), ("lost", "decode-0", lost.node_id)]
            assert {w["name"]: w["state"] for w in status["workers"]}["decode-0"] == "dead"
            from cluster.cli.status import format_status

            text = format_status(status)
            assert f"decode-0 lost on node {lost.node_id[:12]} (127.0.0.1)" in text
            assert f"node {lost.node_id[:12]} (127.0.0.1) left the cluster" in text

            # A node added back: decode-0 starts again there, is paired again and is placed on.
            added.append(cluster.add_node(**NODE, resources={"decode_pool": 1}))
            back = wait_for(lambda: next((w for w in llm.worker_status() if w["name"] == "decode-0"
                                          and w["state"] == "alive" and w["unpaired"] == []), None),
                            timeout_s=180, what="decode-0 to start again on the new node", every_s=0.5)
            assert back["node_id"] == added[0].node_id
            wait_for(lambda: (load := read_loads(registry, CLUSTER, ["decode-0"]).get("decode-0")) is not None
                     and load.unpaired == () and load.node_id == added[0].node_id, timeout_s=60,
                     what="the registry to show decode-0 paired on its new node")
            # The router reads the new worker's report with the next placement, and places on it again.
            again = llm.generate(later * 2, greedy(16))
            assert [(o.error, o.token_ids) for o in again] == [(None, e) for e in expected_later * 2]
            served = {llm.decisions[o.request_id].decode for o in again}
            assert served == {"decode-0", "decode-1"}  # round robin over both again
            on_new = [t for t in llm.transfers if t.decode_worker == "decode-0" and t.request_id in
                      {o.request_id for o in again}]
            assert on_new and all(t.prefill_worker == "prefill-0" and t.blocks_sent > 0 for t in on_new)
            events = read_events(registry, CLUSTER)
            registry.close()
            assert [(e.worker, e.event, e.node_id) for e in events] == [
                ("decode-0", "restarted", added[0].node_id), ("", "node_lost", lost.node_id),
                ("decode-0", "lost", lost.node_id)]
            assert events[0].at > events[1].at > events[2].at
    finally:
        for node in added + [n for n in decode_nodes if n in cluster.worker_nodes]:
            cluster.remove_node(node)


def test_a_prefill_node_lost_mid_transfer(checkpoint, ray_cluster):
    """Two prefill workers on two nodes (each takes a node's whole ``prefill_node``: the
    fixture's node and one added here), decode on a third. The added node's prefill worker is
    frozen (SIGSTOP) while it prefills requests whose KV it streams, then its node is removed:
    those requests were in their transfer when it went, and must complete with exact tokens."""
    from cluster.ingress.tracing import memory_exporter, request_tracer
    from cluster.topology import TracingSpec

    cluster, nodes = ray_cluster
    added = [cluster.add_node(**NODE, resources={"prefill_node": 1}),
             cluster.add_node(**NODE, resources={"decode_node": 1})]
    model_dir = checkpoint("llama")
    params = greedy(8)
    rounds = [random_prompts([260, 300, 240, 280, 250, 290], seed=40 + r) for r in range(6)]
    later = random_prompts([120, 150, 90, 130], seed=49)
    spans = memory_exporter()
    spans.clear()
    try:
        with disaggregated(model_dir, cluster, (("decode_node", 0.01),), prefill_workers=2, policy="round_robin",
                           prefill_resources=(("prefill_node", 1.0),), num_kv_blocks=256, max_num_batched_tokens=32,
                           transfer_timeout_s=20.0) as llm:
            llm.path.tracer = request_tracer(TracingSpec(exporter="memory"), CLUSTER)
            node_of = {w["name"]: w["node_id"] for w in llm.worker_status()}
            lost_worker = next(n for n in ("prefill-0", "prefill-1") if node_of[n] == added[0].node_id)
            survivor = ({"prefill-0", "prefill-1"} - {lost_worker}).pop()
            assert node_of[survivor] == nodes["prefill"].node_id and node_of["decode-0"] == added[1].node_id
            # First each prefill worker caches a prompt (round robin): the lost one has blocks in the registry.
            warm = random_prompts([64, 80, 72, 96], seed=48)
            assert [o.token_ids for o in llm.generate(warm, params)] == colocated_tokens(model_dir, warm, params)
            registry = connect(llm.registry_url)
            wait_for(lambda: any(registry.hexists(k, lost_worker) for k in registry.scan_iter(Keys(CLUSTER).block("*"))),
                     timeout_s=30, what=f"{lost_worker}'s cached blocks in the registry")
            ids, sent, frozen = [], [], None
            for number, prompts in enumerate(rounds):  # until one round is caught mid-prefill
                for i, prompt in enumerate(prompts):
                    ids.append(f"p{number}-{i}")
                    sent.append(prompt)
                    llm.engine.add_request(ids[-1], prompt, params)

                def freeze_while_prefilling():
                    """The lost node's prefill worker stopped as soon as it has a request in its
                    batch and another waiting behind it: their KV is part-sent or unsent when the
                    node goes, however fast it runs (with one request only, its last chunk could
                    finish between the status read and the stop, leaving nothing to lose)."""
                    worker = next(w for w in llm.worker_status() if w["name"] == lost_worker)
                    if worker["running"] and worker["waiting"]:
                        os.kill(worker["pid"], signal.SIGSTOP)
                        return worker["running"], time.time(), worker["pid"]
                    return None if any(not llm.pending[i].done() for i in ids) else "missed"

                frozen = wait_for(freeze_while_prefilling, timeout_s=120, what=f"{lost_worker} to prefill",
                                  every_s=0.005)
                if frozen != "missed":
                    break
            assert frozen not in (None, "missed"), "the prefill worker was never caught prefilling"
            running_at_freeze, frozen_at, pid = frozen
            remove_node_with_frozen_worker(cluster, added[0], pid)
            outputs = llm.run_until_done(ids)
            expected = colocated_tokens(model_dir, sent, params)
            assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(ids)
            assert [o.token_ids for o in outputs] == expected

            # The traces: each request the frozen worker was prefilling has a failed attempt
            # there, placed before the freeze, and then its KV from the survivor (or recomputed).
            by_trace: dict = {}
            for span in spans.get_finished_spans():
                by_trace.setdefault(span.context.trace_id, []).append(span)
            caught = []
            for trace in by_trace.values():
                root = next(s for s in trace if s.name == "tandem.request")
                failed = [s for s in trace if s.name == "prefill" and s.attributes["tandem.worker"] == lost_worker
                          and not s.status.is_ok]
                if failed:
                    assert root.attributes["tandem.outcome"] == "length" and root.attributes["tandem.migrations"] >= 1
                    assert all(f"prefill worker {lost_worker} died" in s.status.description for s in failed)
                    last = max((s for s in trace if s.name == "prefill"), key=lambda s: s.attributes["tandem.attempt"])
                    assert last.status.is_ok and last.attributes["tandem.worker"] in (survivor, "decode-0")
                    if min(s.start_time for s in failed) < frozen_at * 1e9:
                        caught.append(root.attributes["tandem.request_id"])
            assert running_at_freeze >= 1 and caught, (caught, running_at_freeze)

            # The registry holds no worker or block of the dead node once its heartbeat is out.
            index = KVIndexReader(registry, CLUSTER)

            def dead_node_gone() -> bool:
                loads = read_loads(registry, CLUSTER, ["prefill-0", "prefill-1", "decode-0"])
                held = [k for k in registry.scan_iter(Keys(CLUSTER).block("*")) if registry.hexists(k, lost_worker)]
                return (lost_worker not in index.alive_workers() and lost_worker not in loads and not held
                        and not registry.exists(Keys(CLUSTER).worker_blocks(lost_worker))
                        and all(load.node_id != added[0].node_id for load in loads.values()))

            wait_for(dead_node_gone, timeout_s=30, what="the dead node's worker and blocks to leave the registry")
            # Routers place on the survivor only.
            after = llm.generate(later, params)
            assert [(o.error, o.token_ids) for o in after] == [(None, e) for e in colocated_tokens(model_dir, later,
                                                                                                 params)]
            assert {llm.decisions[o.request_id].prefill for o in after} == {survivor}
            # Nothing is left referenced on the surviving workers.
            wait_for(lambda: all(w["kv_blocks_used"] == 0 and w["running"] == 0 and w["waiting"] == 0
                                 for w in llm.worker_status() if w["state"] == "alive"), timeout_s=60,
                     what="every block on the surviving workers to be free")
            # `tandem status` says which worker and node went, and when.
            wait_for(lambda: any(e.event == "node_lost" for e in read_events(registry, CLUSTER)), timeout_s=60,
                     what="Ray to find the node dead")
            registry.close()
            status = cluster_status(llm)
            events = [(e["event"], e["worker"], e["node_id"]) for e in status["worker_events"]]
            assert events == [("node_lost", "", added[0].node_id), ("lost", lost_worker, added[0].node_id)]
            assert all(e["at"] >= frozen_at for e in status["worker_events"])
            assert {w["name"]: w["state"] for w in status["workers"]}[lost_worker] == "dead"
            from cluster.cli.status import format_status

            text = format_status(status)
            assert f"{lost_worker} lost on node {added[0].node_id[:12]} (127.0.0.1)" in text
            assert f"node {added[0].node_id[:12]} (127.0.0.1) left the cluster" in text
    finally:
        spans.clear()
        for node in [n for n in added if n in cluster.worker_nodes]:
            cluster.remove_node(node)


def waiting_for_nodes(model_dir, cluster, wait_s: float, planner: str = "off") -> DisaggregatedLLM:
    """One prefill worker (it takes the fixture's prefill node whole) and one decode worker (on a
    node the test adds); a prefill worker added waits up to ``wait_s`` for a node with room."""
    from dataclasses import replace

    from cluster.offline.spec_from_args import disaggregated_spec

    spec, engine = disaggregated_spec(
        str(model_dir), cluster_name=CLUSTER, ray_address=cluster.address, num_kv_blocks=BLOCKS,
        max_num_batched_tokens=96, local_prefill_max_tokens=0, num_threads=1, policy="round_robin",
        pools={"prefill": PoolResources(resources=(("prefill_node", 1.0),)),
               "decode": PoolResources(resources=(("decode_node", 0.01),))})
    spec = replace(spec, ray=replace(spec.ray, node_wait_s=wait_s),
                   planner=replace(spec.planner, mode=planner, prefill_max=2, max_workers=3))
    return DisaggregatedLLM(spec, engine, verbose=False)


def test_an_added_worker_no_node_can_hold_waits_then_gives_up_cleanly(checkpoint, ray_cluster):
    """The live planner in ``act`` adds a prefill worker whose resources no node has free: the
    add waits (saying for what), then past ``ray.node_wait_s`` removes its placement group, and
    the decision is kept as not done in one line. Nothing is left: no group, no actor, no member."""
    import ray
    from ray.util.placement_group import placement_group_table

    from cluster.plan.live.observe import Observation
    from cluster.plan.live.propose import Prediction, Proposal, Split
    from cluster.registry.planner_decisions import Journal

    cluster, _ = ray_cluster
    decode_node = cluster.add_node(**NODE, resources={"decode_node": 1})
    try:
        with waiting_for_nodes(checkpoint("llama"), cluster, wait_s=3.0, planner="act") as llm:
            free_before, groups_before = ray.available_resources(), set(placement_group_table())
            # The planner's decision to add a prefill worker, as a look that proposed it takes it.
            proposal = Proposal(Split(1, 1), Split(2, 1), {Split(1, 1): Prediction(1.0, 0.5),
                                                           Split(2, 1): Prediction(2.0, 1.0)})
            observation = Observation(time.time(), 60.0, 120, 2.0, 1.0, 0.5, 1024.0, 16.0)
            planner = llm.deployment.planner
            planner.journal.set_latest({"at": observation.at, "mode": "act", "current": "1P+1D",
                                        "observed": observation.describe(), "proposal": proposal.describe()})
            decision = planner._decide(proposal, observation)
            line = ("cannot place prefill-1: no node with 0.25 CPU, 1 prefill_node joined or freed up within 3s "
                    "(ray.node_wait_s); its placement group was removed")
            assert (decision.acted, decision.detail) == (False, f"resize failed: {line}")
            registry = connect(llm.registry_url)
            assert Journal(registry, CLUSTER).decisions()[-1].detail == f"resize failed: {line}"
            events = [(e.worker, e.event, e.detail) for e in read_events(registry, CLUSTER)]
            registry.close()
            assert events == [("prefill-1", "not_added", line), ("prefill-1", "waiting", "0.25 CPU, 1 prefill_node")]
            # Nothing left of it: the group removed, no actor, the pools as they were.
            new = {k: g for k, g in placement_group_table().items() if k not in groups_before}
            assert [(g["name"], g["state"]) for g in new.values()] == [(f"{CLUSTER}-prefill-1", "REMOVED")]
            assert "prefill-1" not in llm.deployment.placement_groups and "prefill-1" not in llm.deployment.workers
            with pytest.raises(ValueError):
                ray.get_actor("prefill-1", namespace=CLUSTER)
            assert llm.deployment.members == {"prefill": ["prefill-0"], "decode": ["decode-0"]}
            assert ray.available_resources() == free_before
            status = cluster_status(llm)
            from cluster.cli.status import format_status

            text = format_status(status)
            assert "prefill worker prefill-1 waiting for a node with 0.25 CPU, 1 prefill_node" in text
            assert f"prefill worker prefill-1 not added: {line}" in text
            assert (f"did not resize 1P+1D -> 2P+1D: predicted {decision.predicted_goodput_rps:.2f} req/s "
                    f"({decision.predicted_attainment:.0%}); resize failed: {line}") in text
    finally:
        cluster.remove_node(decode_node)


def test_an_added_worker_comes_up_on_a_node_that_joins_while_it_waits(checkpoint, ray_cluster):
    """A prefill worker added with no node free for it waits; a node with its resource joins
    (as KubeRay's autoscaler would start one for the pending placement group): the worker comes
    up there, is paired with the decode worker, and serves with exact tokens."""
    import threading

    from cluster.registry.worker_events import WAITING

    cluster, nodes = ray_cluster
    decode_node = cluster.add_node(**NODE, resources={"decode_node": 1})
    added, outcome = [], {}
    model_dir = checkpoint("llama")
    prompts = random_prompts([40, 70, 50, 90], seed=31)
    expected = colocated_tokens(model_dir, prompts, greedy(8))
    try:
        with waiting_for_nodes(model_dir, cluster, wait_s=300.0) as llm:
            registry = connect(llm.registry_url)

            def add() -> None:
                outcome["name"] = llm.deployment.scale.add("prefill", say=lambda line: None)

            adding = threading.Thread(target=add)
            adding.start()
            wait_for(lambda: any(e.event == WAITING for e in read_events(registry, CLUSTER)), timeout_s=60,
                     what="the add to wait for a node")
            assert adding.is_alive()
            added.append(cluster.add_node(**NODE, resources={"prefill_node": 1}))
            adding.join(timeout=240)
            assert not adding.is_alive() and outcome == {"name": "prefill-1"}
            workers = {w["name"]: w for w in llm.worker_status()}
            assert workers["prefill-1"]["state"] == "alive" and workers["prefill-1"]["node_id"] == added[0].node_id
            assert workers["decode-0"]["unpaired"] == [] and workers["prefill-0"]["node_id"] == nodes["prefill"].node_id
            events = [(e.worker, e.event, e.node_id) for e in read_events(registry, CLUSTER)]
            registry.close()
            assert events == [("prefill-1", "added", added[0].node_id), ("prefill-1", "waiting", "")]
            outputs = llm.generate(prompts, greedy(8))
            assert [(o.error, o.token_ids) for o in outputs] == [(None, e) for e in expected]
            assert {llm.decisions[o.request_id].prefill for o in outputs} == {"prefill-0", "prefill-1"}
    finally:
        for node in [decode_node, *added]:
            cluster.remove_node(node)

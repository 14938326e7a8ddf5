"""What prefill and decode workers share: an engine stepped by one background thread.

Calls into a worker run on Ray's threads (the actors are threaded); every use of the engine's
scheduler goes through ``_lock``. The loop steps whenever ``_has_work()`` says so and hands
each step's outputs to ``_on_outputs``; when idle it sleeps until a call has used the engine
(every change to the engine's work goes through ``_lock``, whose release wakes it).

On start a worker gives its engine a start-up profile, measured step times for the router's
cost model before the first request: measured on a worker's first start, then kept per model,
settings and machine (``cluster/worker/step_profile.py``). Its KV cache's pages are faulted in
by a background thread meanwhile (``cluster/engine/memory.py``). With a registry URL it then
reports its KV events, a heartbeat and its load from a background thread
(``cluster/registry/reporter.py``). A step that holds the engine longer than the reporter waits
for it (a long prompt chunk on a slow or starved CPU) does not stop the heartbeat: the report
taken before the step is renewed, since nothing in the engine changes until the step ends; only
a step past ``STEP_BEAT_LIMIT_S``, hung, lets the worker fall silent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from itertools import islice

from typing import TYPE_CHECKING

from cluster.engine.block_manager import KVEvent
from cluster.engine.config import EngineConfig
from cluster.engine.node_quiet import ServingMark
from cluster.engine.sampling_params import SamplingParams
from cluster.observability.metrics import WorkerMetrics
from cluster.registry.load import STEPS_REPORTED, StepSample, WorkerLoad
from cluster.registry.reporter import WorkerReporter
from cluster.runtime.cpu_cores import compute_cores
from cluster.runtime.ray_node import this_incarnation, this_node
from cluster.runtime.short_slice import serve_with_short_slices, short_slices_for
from cluster.worker.arrivals import RecentArrivals

if TYPE_CHECKING:
    from cluster.engine.engine import RequestOutput
    from cluster.kv_transfer.agent import PairLayout
    from cluster.parallel.group import GroupSpec

IDLE_WAKE_S = 0.05
EXIT_STEP_FAILED = 70  # the process's exit status when a step raised (EX_SOFTWARE)
# How long the reporter waits for the engine before renewing the report it took last: a third of
# the heartbeat's 3 s lifetime. A step that held the engine longer than the lifetime (a 1,024-token
# prompt takes 2.6 s on one thread of this project's 2 cores, two of them in one step about 5 s)
# let the worker's heartbeat lapse, and the routers saw it gone ("no live prefill worker").
REPORT_WAIT_S = 1.0
# A step holding the engine this long is hung (a tensor-parallel group's collectives time out at
# 120 s): the worker stops renewing its report, and the routers stop placing on it.
STEP_BEAT_LIMIT_S = 150.0


class StepLock:
    """The engine's lock, with calls served first: the stepping loop takes it again after a step
    only once no call is waiting, so a call (reserve, prefill, generate) waits for at most the
    step in progress, not for a run of steps (a plain lock lets the releasing thread win)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0
        self._held_since: float | None = None  # monotonic time the holder took the lock
        self.released = threading.Event()  # set when a call lets go: it may have given the loop work

    def __enter__(self) -> "StepLock":
        self.acquire_within(None)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire_within(self, timeout_s: float | None) -> bool:
        """Takes the lock as a call does (served before the loop's next step), waiting at most
        ``timeout_s`` (None: until it is free); True if taken (then ``release`` it)."""
        with self._count:
            self._waiting += 1
        try:
            taken = self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s)
        finally:
            with self._count:
                self._waiting -= 1
        if taken:
            self._held_since = time.monotonic()
        return taken

    def acquire_now(self) -> bool:
        """Takes the lock if it is free now (then ``release`` it); never waits."""
        taken = self._lock.acquire(blocking=False)
        if taken:
            self._held_since = time.monotonic()
        return taken

    def release(self) -> None:
        self._held_since = None
        self._lock.release()
        self.released.set()

    def held_for(self) -> float:
        """Seconds the current holder has held the lock (0 when free)."""
        since = self._held_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @contextmanager
    def step_turn(self):
        """For the loop: the lock, once no call waits for it."""
        while self._waiting:
            time.sleep(0.0002)
        with self._lock:
            self._held_since = time.monotonic()
            try:
                yield
            finally:
                self._held_since = None


def reported_steps(stats) -> list:
    """The steps a load report carries: the latest ``STEPS_REPORTED``, after the latest
    prefill-only steps and the latest decode-only steps of each batch width older than those
    (``EngineStats.prefill_steps``, ``decode_steps``), so that a decode worker whose recent steps
    are all decodes still shows the router how long its prompts took, and one whose recent
    batches were narrow still shows how a wide one ran."""
    latest = list(islice(reversed(stats.steps), STEPS_REPORTED))[::-1]
    recent = {id(s) for s in latest}
    older = [s for width in sorted(stats.decode_steps) for s in stats.decode_steps[width] if id(s) not in recent]
    return [s for s in stats.prefill_steps if id(s) not in recent] + older + latest


class EngineWorker:
    prefill_side: bool = True

    role = "prefill"

    def __init__(self, config: EngineConfig, registry_url: str | None = None, profile: bool = True):
        # Imported here, not with the class: a process that only holds a worker's handle (an
        # ingress replica) loads the class, and should not load torch and the engine with it.
        import torch

        from cluster.engine.engine import LLMEngine
        from cluster.kv_transfer.agent import TransferAgent
        from cluster.parallel.tp_runner import engine_runner
        from cluster.worker import step_profile

        self.engine = LLMEngine(config, verbose=False, make_runner=engine_runner(kv_port=TransferAgent),
                                fault_kv_in_background=True)
        self.name = config.engine_name
        self.cluster = config.cluster_name
        self._compute_cores = compute_cores(torch.device(self.engine.config.device).type == "cpu",
                                            torch.get_num_threads(), config.tensor_parallel_size)
        self.pairs_joined: set[str] = set()  # the transfer groups (pair names) this worker has joined
        self.node = this_node()
        self.incarnation = this_incarnation()
        self.started_at = time.time()
        self._lock = StepLock()
        self.arrivals = RecentArrivals()  # the requests it took lately, named in its load reports
        self._stop = threading.Event()
        if profile:
            step_profile.start_up(self.engine, self.role)
        self.metrics = WorkerMetrics(config.cluster_name, self.name, self.role,  # before the reporter sets it
                                     generates=not self.prefill_side)
        self.reporter = (WorkerReporter(registry_url, config.cluster_name, self.name, self._report_snapshot)
                         if registry_url else None)
        self._serving = ServingMark()  # while it steps requests, the machine's KV fault-ins pause
        self._stepper = threading.Thread(target=self._run, name=f"{type(self).__name__}-loop", daemon=True)
        self._stepper.start()

    def peer_worker(self, name: str):
        """Another worker of this cluster, by name. Looked up in the cluster's namespace, where the
        deployment names them, not this process's: a driver that started Ray for another cluster
        first (tests, a notebook) keeps that one's namespace for every later cluster."""
        import ray

        return ray.get_actor(name, namespace=self.cluster)

    def _report_snapshot(self) -> tuple[list[KVEvent], WorkerLoad] | None:
        """The reporter's snapshot; None while a step (or call) has held the engine for longer than
        ``REPORT_WAIT_S`` and less than ``STEP_BEAT_LIMIT_S``: the last report still holds, and is renewed.
        A holder past the limit is waited for, so the heartbeat lapses meanwhile."""
        lock = self._lock
        if not lock.acquire_within(REPORT_WAIT_S):
            if lock.held_for() < STEP_BEAT_LIMIT_S:
                return None
            lock.acquire_within(None)
        try:
            return self._snapshot_held()
        finally:
            lock.release()

    def _snapshot_held(self) -> tuple[list[KVEvent], WorkerLoad]:
        """The KV events since the last snapshot, and the load now (the caller holds the engine)."""
        engine = self.engine
        scheduler = engine.scheduler
        queued = scheduler.waiting + scheduler.running
        load = WorkerLoad(
            worker=self.name, role=self.role, waiting=len(scheduler.waiting), running=len(scheduler.running),
            receiving=len(scheduler.receiving),
            queued_prefill_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued),
            decode_context_tokens=sum(r.num_computed_tokens for r in scheduler.running
                                      if r.num_computed_tokens >= r.num_prompt_tokens),
            next_slot_tokens=min((r.params.max_tokens - r.num_output_tokens for r in scheduler.running),
                                 default=0),
            free_blocks=engine.block_manager.num_free_blocks, num_blocks=engine.block_manager.num_blocks,
            block_size=engine.config.block_size, max_num_batched_tokens=engine.config.max_num_batched_tokens,
            max_num_seqs=engine.config.max_num_seqs,
            steps=tuple(StepSample(s.num_prefill_tokens, s.prefill_attention, s.num_decode_tokens,
                                   s.context_tokens, s.seconds, s.kv_blocks_sent, s.transfer_tail_s,
                                   s.guess_tokens, s.accepted_tokens, s.host_loaded_blocks, s.host_load_s,
                                   s.draft_prompt_tokens, s.draft_seconds)
                        for s in reported_steps(engine.stats)),
            unpaired=self._unpaired_prefill(), node_id=self.node.node_id, node_address=self.node.address,
            incarnation=self.incarnation, prefill_call_s=self._prefill_call_s(), pull_from=self._pull_from(),
            pull_s_per_block=self._pull_s_per_block(), draft_prompt_share=self._draft_prompt_share(),
            arrived=self.arrivals.ids(), **self._compute_cores,
        )
        stats = engine.stats
        self.metrics.blocks(load.num_blocks - load.free_blocks, load.free_blocks, stats.prefix_cache_hit_rate,
                            load.waiting, load.running, load.receiving)
        self.metrics.speculation(stats.proposed_tokens, stats.accepted_tokens, stats.verify_steps)
        host = engine.block_manager.host
        self.metrics.host_tier(stats.host_offloaded_blocks, stats.host_loaded_blocks,
                               host.num_used if host is not None else 0)
        return engine.block_manager.drain_events(), load

    def describe(self) -> dict:
        engine = self.engine
        return {"num_kv_heads": engine.model_config.num_kv_heads, "tp": engine.config.tensor_parallel_size,
                "num_layers": engine.model_config.num_layers, "free_blocks": self._free_blocks(),
                "num_blocks": engine.block_manager.num_blocks, "block_size": engine.config.block_size,
                "max_model_len": engine.max_model_len, "hash_keys": engine.scheduler.extra_hash_keys,
                "role": self.role, "name": self.name}

    def lifetime(self) -> None:
        """Returns once the worker is shut down: its deployment keeps this call pending, and
        it fails at once when the worker dies (its process, or its whole node)."""
        self._stop.wait()

    def join_pair(self, layout: PairLayout, spec: GroupSpec, sends: bool | None = None) -> None:
        """Joins the transfer group shared with one worker of the other role (every TP rank), or
        with a peer (``sends``: this side sends, the layout's first ranks; default: a prefill
        worker sends, a decode worker receives)."""
        self.engine.runner.join_transfer(layout, spec, self.prefill_side if sends is None else sends)
        self.pairs_joined.add(layout.name)

    def leave_pair(self, pair: str) -> None:
        """Leaves the transfer group ``pair`` (every TP rank): its peer is being removed."""
        self.engine.runner.leave_transfer(pair)
        self.pairs_joined.discard(pair)

    def status(self) -> dict:
        """What ``tandem status`` shows of this worker. Its state is ``alive`` while the thread
        that steps its engine runs, ``stopped`` once it ended (a step raised): such a worker
        answers calls but cannot generate, and the ingress's health check counts it out."""
        import torch  # loaded with the engine already; not with the class (see __init__)

        engine = self.engine
        state = "alive" if self._stepper.is_alive() else "stopped"
        with self._lock:
            scheduler, blocks, stats = engine.scheduler, engine.block_manager, engine.stats
            return {"name": self.name, "role": self.role, "tp": engine.config.tensor_parallel_size, "state": state,
                    "pid": os.getpid(), "threads": torch.get_num_threads(),
                    "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks, "kv_blocks": blocks.num_blocks,
                    "waiting": len(scheduler.waiting), "running": len(scheduler.running),
                    "receiving": len(scheduler.receiving), "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                    "registry": "ok" if self.reporter is None or self.reporter.connected else "unreachable",
                    "speculation": self._speculation(), "draft": self._draft(), "node_id": self.node.node_id,
                    "node_address": self.node.address, "started_at": self.started_at,
                    "transfer_groups": sorted(self.pairs_joined), "host_tier": self._host_tier_status()}

    def _host_tier_status(self) -> dict | None:
        """The host KV tier since the worker started (``kv.host_cache``; None when off)."""
        host, stats = self.engine.block_manager.host, self.engine.stats
        if host is None:
            return None
        return {"blocks": host.num_slots, "used": host.num_used, "offloaded_blocks": stats.host_offloaded_blocks,
                "loaded_blocks": stats.host_loaded_blocks, "load_seconds": stats.host_load_seconds}

    def _speculation(self) -> dict | None:
        """Speculative decoding since the worker started, where its engine speculates (else None)."""
        spec, stats = self.engine.speculative, self.engine.stats
        if spec is None:
            return None
        return {"method": spec.method, "num_tokens": spec.num_tokens, "adaptive": spec.adaptive,
                "proposed_tokens": stats.proposed_tokens, "accepted_tokens": stats.accepted_tokens,
                "verify_steps": stats.verify_steps, "acceptance_rate": stats.acceptance_rate,
                "tokens_per_verify": stats.tokens_per_verify}

    def _draft(self) -> dict | None:
        """The draft model's prompt work, where the engine loads one (else None): the prompt tokens
        it was fed (a prefill worker's: prompts whose draft KV it sent; a decode worker's: its
        catch-up) and, on a decode worker, the prompts whose draft KV arrived with the model's."""
        draft = self.engine.draft
        if draft is None:
            return None
        return {"prompt_tokens_fed": draft.prompt_tokens_fed, "prompts_received": draft.prompts_received,
                "forwards": draft.forward_count}

    def free_blocks(self) -> int:
        return self._free_blocks()

    def in_flight(self) -> int:
        """Requests this worker holds now, from their arrival to their end (what a drain waits for)."""
        with self._lock:
            scheduler = self.engine.scheduler
            return len(scheduler.waiting) + len(scheduler.running) + len(scheduler.receiving)

    def _free_blocks(self) -> int:
        with self._lock:
            return self.engine.block_manager.num_free_blocks

    def cached_prefix_blocks(self, prompt_token_ids: list[int]) -> int:
        """Leading full blocks of the prompt this worker's cache holds now (the oracle the
        routing benchmark compares the registry's view with)."""
        from cluster.engine.request import Request

        with self._lock:
            probe = Request("probe", list(prompt_token_ids), SamplingParams())
            return self.engine.scheduler.cached_prefix_blocks(probe)

    def shutdown(self) -> None:
        self._stop.set()
        self._stepper.join(timeout=10)
        self._serving.close()
        if self.reporter is not None:
            self.reporter.stop()
        self.engine.shutdown()

    def _unpaired_prefill(self) -> tuple[str, ...]:
        """Prefill workers this worker cannot take KV from now (a decode worker's rebuilding pairs)."""
        return ()

    def _pull_from(self) -> tuple[str, ...]:
        """Peers this worker can pull cached KV from now (a decode worker's built peer pairs)."""
        return ()

    def _draft_prompt_share(self) -> float:
        """A decode worker's share of remote prefills asked for the draft's KV (``WorkerLoad.draft_prompt_share``)."""
        return 0.0

    def _prefill_call_s(self) -> float:
        """A decode worker's calls to prefill workers, beyond their work (``WorkerLoad.prefill_call_s``)."""
        return 0.0

    def _pull_s_per_block(self) -> float:
        """A decode worker's measured pulls from peers, per block (``WorkerLoad.pull_s_per_block``)."""
        return 0.0

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        self._compute_with_short_slices()
        try:
            while not self._stop.is_set():
                with self._lock.step_turn():
                    busy = self._has_work()
                    self._serving.mark(busy)
                    if busy:
                        self._on_outputs(self.engine.step())
                if not busy:  # idle: asleep until a call has used the engine (the timeout is only a backstop)
                    self.engine.check_health()
                    self._lock.released.wait(IDLE_WAKE_S)
                    self._lock.released.clear()
        except BaseException as exc:  # noqa: BLE001 - whatever a step raised, the engine is past trusting
            self._engine_failed(exc)

    @staticmethod
    def _compute_with_short_slices() -> int:
        """This stepping thread and the native kernels' pool workers (started by the warm-up, on
        another thread; those started later come from this one and inherit it) take the short
        slice the serving threads have: one stream decoded ~6% faster (cluster/runtime/short_slice.py)."""
        from cluster.engine.kernels.threads import pool_worker_tids

        return serve_with_short_slices() + short_slices_for(pool_worker_tids())

    _exit = staticmethod(os._exit)

    def _engine_failed(self, exc: BaseException) -> None:
        """A step raised, or the engine found itself broken while idle (a tensor-parallel rank
        died, say): the process ends, so that Ray reports this worker dead, its callers'
        streams move to other workers and the supervisor starts it again (Ray ends the TP
        ranks it started with it). A loop that ended quietly left a worker that beat and took
        placements but never stepped again."""
        line = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        print(f"[tandem] worker {self.name}: its engine failed ({line}); the worker exits to be started again",
              file=sys.stderr, flush=True)
        self._exit(EXIT_STEP_FAILED)

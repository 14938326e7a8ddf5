"""A model runner spread over a tensor-parallel group of processes.

Rank 0 lives in the engine's process: it schedules, samples and drives. Ranks 1..N-1 are Ray
actors (:class:`TPFollower`), each with its shard of the weights and of the KV cache. Each
step, rank 0 sends the step's plan (plain integers, :class:`StepPlan`) to the followers over
Ray, the control channel, and then every rank runs the same forward pass; activations only
travel through the process group's collectives. A follower that dies makes the step fail with
an error naming it instead of hanging: its peers' collectives see the closed connection, and
the process group has a timeout besides.

On GPUs, rank r uses ``cuda:(k + r)`` of its node when rank 0 uses ``cuda:k``, so a group of N
ranks on one node needs N GPUs; NCCL cannot put two ranks of a group on one GPU.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

import torch

from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.engine import RunnerFactory, single_rank_runner
from cluster.engine.kv_port import KVPortFactory
from cluster.engine.model_runner import ModelRunner, StepInputs, StepPlan
from cluster.engine.models.config import ModelConfig
from cluster.engine.node_quiet import ServingMark
from cluster.parallel.group import GroupSpec, join_group
from cluster.runtime.ray_runtime import ensure_ray
from cluster.runtime.startup import exception_line, guarded


# A follower of a decode engine blocks a thread in each KV receive while the engine keeps
# stepping; with too few threads, steps starve receives (and the prefill side's sends time
# out). Drivers keep the receives in flight per engine well below this.
FOLLOWER_THREADS = 64


class TensorParallelError(RuntimeError):
    pass


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raises ValueError naming the numbers when ``tp_size`` cannot split this model."""
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp_size}")
    problems = []
    if config.num_heads % tp_size:
        problems.append(f"{config.num_heads} attention heads")
    if config.num_kv_heads % tp_size and tp_size % config.num_kv_heads:
        problems.append(f"{config.num_kv_heads} KV heads (neither divides the other)")
    if config.intermediate_size % tp_size:
        problems.append(f"MLP size {config.intermediate_size}")
    if problems:
        raise ValueError(f"tensor-parallel size {tp_size} does not divide this model's {', '.join(problems)}")


def threads_per_rank(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)


class TPFollower:
    """A rank other than 0: its shard of the model and of the KV cache (a Ray actor)."""

    def __init__(self, config: ModelConfig, model_dir: str, block_size: int, max_model_len: int, device: str,
                 spec: GroupSpec, rank: int, num_threads: int, attention_backend: str = "auto",
                 load_format: str = "safetensors", kv_port: KVPortFactory | None = None):
        torch.set_num_threads(num_threads)
        if device.startswith("cuda"):
            import ray

            # Ray-assigned GPUs (num_gpus) leave this rank seeing only its own device; otherwise
            # the ranks take consecutive devices after rank 0's.
            first = int(device.partition(":")[2] or 0)
            device = "cuda:0" if ray.get_gpu_ids() else f"cuda:{first + rank}"
            torch.cuda.set_device(device)
        group = join_group(spec, rank, torch.device(device))
        self.runner = ModelRunner(config, Path(model_dir), block_size, max_model_len, device, group,
                                  attention_backend=attention_backend, load_format=load_format, kv_port=kv_port)
        self._serving = ServingMark()

    def ready(self) -> int:
        return self.runner.weight_bytes

    def watch(self) -> None:
        """Never returns while this rank lives: rank 0 keeps the call open, and its end (the
        actor died) tells rank 0 at once that the group is broken, even while it is idle."""
        threading.Event().wait()

    def allocate_kv_cache(self, num_blocks: int, fault_in_background: bool = False) -> None:
        self.runner.allocate_kv_cache(num_blocks, fault_in_background)

    def execute(self, plan: StepPlan) -> dict[str, str | None]:
        self._serving.mark(True)  # for the step: this node's KV fault-ins pause (rank 0 marks its own node)
        try:
            inputs = self.runner.build_inputs(plan)
            self.runner.execute(inputs)
        finally:
            self._serving.mark(False)
        return inputs.transfer_errors

    def join_transfer(self, layout, spec: GroupSpec, prefill_side: bool) -> None:
        self.runner.join_transfer(layout, spec, prefill_side)

    def leave_transfer(self, pair: str) -> None:
        self.runner.leave_transfer(pair)

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int, timeout_s: float) -> str | None:
        return self.runner.receive(pair, request_id, dst_blocks, tag_base, timeout_s)

    def send(self, pair: str, request_id: str, block_ids: list[int], tag_base: int, timeout_s: float) -> str | None:
        return self.runner.send(pair, request_id, block_ids, tag_base, timeout_s)


class TensorParallelRunner(ModelRunner):
    """Rank 0 of the group; the engine uses it exactly like a :class:`ModelRunner`."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        block_size: int,
        max_model_len: int,
        tp_size: int,
        cluster: str,
        name: str,
        device: str = "cpu",
        ray_address: str | None = None,
        num_threads: int | None = None,
        progress: Callable[[int, int, str], None] | None = None,
        cpus_per_rank: float = 0.25,
        gpus_per_rank: int = 0,
        attention_backend: str = "auto",
        load_format: str = "safetensors",
        kv_port: KVPortFactory | None = None,
    ):
        """Ranks 1..N-1 start as Ray actors of ``cpus_per_rank`` CPUs each; inside a placement
        group that captures child tasks (the cluster reserves one per TP group) they land in its
        bundles, on rank 0's node."""
        check_tensor_parallel(config, tp_size)
        ray = ensure_ray(cluster, ray_address)
        self._ray = ray
        threads = num_threads or threads_per_rank(tp_size)
        torch.set_num_threads(threads)
        spec = GroupSpec(cluster, f"{name}-tp", tp_size)
        follower = ray.remote(guarded(TPFollower))
        self.followers = [
            follower.options(name=f"{name}-tp{rank}", namespace=cluster, num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
                             max_concurrency=FOLLOWER_THREADS).remote(
                config, str(model_dir), block_size, max_model_len, device, spec, rank, threads, attention_backend,
                load_format, kv_port,
            )
            for rank in range(1, tp_size)
        ]
        self.follower_names = [f"{name}-tp{rank}" for rank in range(1, tp_size)]
        try:
            group = join_group(spec, 0, torch.device(device))
            super().__init__(config, model_dir, block_size, max_model_len, device, group, progress,
                             attention_backend=attention_backend, load_format=load_format, kv_port=kv_port)
            self._wait([f.started.remote() for f in self.followers], "loading its shard")
            self._watches = [f.watch.remote() for f in self.followers]
        except BaseException:
            self.shutdown()
            raise

    def _wait(self, refs: list, doing: str) -> list:
        """The followers' results (``refs`` in rank order); a rank that failed becomes one line
        naming it."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayError as first:
            failed = "a tensor-parallel rank", first
            for name, ref in zip(self.follower_names, refs):
                try:
                    self._ray.get(ref, timeout=0)
                except self._ray.exceptions.GetTimeoutError:
                    continue
                except self._ray.exceptions.RayError as exc:
                    failed = name, exc
                    break
            raise TensorParallelError(f"{failed[0]} failed while {doing}: {exception_line(failed[1])}") from None

    def check_health(self) -> None:
        """Raises ``TensorParallelError`` naming a rank that has died (its watch call ended)."""
        ended, _ = self._ray.wait(self._watches, num_returns=1, timeout=0)
        if not ended:
            return
        name = self.follower_names[self._watches.index(ended[0])]
        try:
            self._ray.get(ended[0])
        except self._ray.exceptions.RayError as exc:
            raise TensorParallelError(f"{name} died: {exception_line(exc)}") from None
        raise TensorParallelError(f"{name} ended")

    def allocate_kv_cache(self, num_blocks: int, fault_in_background: bool = False) -> None:
        refs = [f.allocate_kv_cache.remote(num_blocks, fault_in_background) for f in self.followers]
        super().allocate_kv_cache(num_blocks, fault_in_background)
        self._wait(refs, "allocating its KV cache")

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        refs = [f.execute.remote(inputs.plan) for f in self.followers]
        try:
            logits = super().execute(inputs)
        except RuntimeError as exc:
            self._wait(refs, "running a step")
            raise TensorParallelError(f"tensor-parallel step failed: {exc}") from exc
        for errors in self._wait(refs, "running a step"):
            for request_id, error in errors.items():
                if error is not None and inputs.transfer_errors.get(request_id) is None:
                    inputs.transfer_errors[request_id] = error
        return logits

    def join_transfer(self, layout, spec: GroupSpec, prefill_side: bool) -> None:
        """Every rank joins the pair's group (they block until the other engine's ranks do)."""
        refs = [f.join_transfer.remote(layout, spec, prefill_side) for f in self.followers]
        super().join_transfer(layout, spec, prefill_side)
        self._wait(refs, "joining a KV-transfer group")

    def leave_transfer(self, pair: str) -> None:
        """Every rank leaves the pair's group."""
        refs = [f.leave_transfer.remote(pair) for f in self.followers]
        super().leave_transfer(pair)
        self._wait(refs, "leaving a KV-transfer group")

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int, timeout_s: float) -> str | None:
        """Every rank receives its heads; returns None, or the first error."""
        refs = [f.receive.remote(pair, request_id, dst_blocks, tag_base, timeout_s) for f in self.followers]
        errors = [super().receive(pair, request_id, dst_blocks, tag_base, timeout_s)] + self._wait(refs, "receiving KV")
        return next((e for e in errors if e is not None), None)

    def send(self, pair: str, request_id: str, block_ids: list[int], tag_base: int, timeout_s: float) -> str | None:
        """Every rank sends its heads of ``block_ids``; returns None, or the first error."""
        refs = [f.send.remote(pair, request_id, block_ids, tag_base, timeout_s) for f in self.followers]
        errors = [super().send(pair, request_id, block_ids, tag_base, timeout_s)] + self._wait(refs, "sending KV")
        return next((e for e in errors if e is not None), None)

    def shutdown(self) -> None:
        for actor in getattr(self, "followers", []):
            self._ray.kill(actor, no_restart=True)
        self.followers, self._watches = [], []


def engine_runner(kv_port: KVPortFactory | None = None) -> RunnerFactory:
    """How an engine builds its runner (``LLMEngine(make_runner=...)``): one rank in the engine's
    process, or a tensor-parallel group; each rank moves KV through ``kv_port`` (None: no KV moves)."""

    def make(cfg: EngineConfig, model_config: ModelConfig, model_dir: Path, max_model_len: int,
             progress) -> ModelRunner:
        if cfg.tensor_parallel_size == 1:
            # Ray starts actors with OMP_NUM_THREADS=1 (fractional CPUs): without this a one-rank
            # worker would step on one thread whatever the machine has.
            torch.set_num_threads(cfg.num_threads or threads_per_rank(1))
            return single_rank_runner(cfg, model_config, model_dir, max_model_len, progress, kv_port)
        try:
            check_tensor_parallel(model_config, cfg.tensor_parallel_size)
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
        return TensorParallelRunner(
            model_config, model_dir, cfg.block_size, max_model_len, cfg.tensor_parallel_size, cfg.cluster_name,
            cfg.engine_name, cfg.device, cfg.ray_address, cfg.num_threads, progress, cfg.cpus_per_rank,
            cfg.gpus_per_rank, cfg.attention_backend, cfg.load_format, kv_port,
        )

    return make

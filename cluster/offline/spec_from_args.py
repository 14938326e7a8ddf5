"""A topology from ``tandem run --disaggregated``'s arguments (and the Python API's): the
:class:`~cluster.topology.ClusterSpec` a :class:`DisaggregatedLLM` deploys, and the engine
settings a topology does not hold."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Mapping

from cluster.deployment.pools import EngineOverrides, PoolResources
from cluster.engine.config import EngineConfigError
from cluster.engine.request_limits import quote
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.topology import (
    ClusterSpec, KVSpec, ModelSpec, NodeConstraints, PoolSpec, RaySpec, RegistrySpec, SpeculativeSpec,
)
from router.config import RouterConfig, RouterConfigError

# EngineConfig fields that have a place in the topology: model.*, kv.* and each pool's.
_MODEL_ARGS = {"dtype": "dtype", "max_model_len": "max_model_len", "quantization": "quantization",
               "cpu_matmul_dtype": "cpu_matmul_dtype"}
_KV_ARGS = {"block_size": "block_size", "num_kv_blocks": "num_blocks", "kv_cache_memory_fraction":
            "cache_memory_fraction", "enable_prefix_caching": "prefix_caching", "kv_cache_dtype": "cache_dtype"}
_POOL_ARGS = {"max_num_batched_tokens": "max_num_batched_tokens", "max_num_seqs": "max_num_seqs",
              "num_threads": "threads"}


def disaggregated_spec(
    model: str | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    prefill_workers: int = 1,
    decode_workers: int = 1,
    cluster_name: str = "tandem",
    ray_address: str | None = None,
    restart_workers: bool = True,
    transfer_timeout_s: float = 60.0,
    kv_transport: str = "torch_distributed",
    stream_layers: bool = True,
    policy: str = "slo",
    router_config: RouterConfig | None = None,
    registry_url: str | None = None,
    pools: Mapping[str, PoolResources] | None = None,
    role_args: Mapping[str, Mapping] | None = None,
    local_prefill_max_tokens: int | None = None,
    **engine_args,
) -> tuple[ClusterSpec, EngineOverrides]:
    """``engine_args`` are EngineConfig fields for both roles, ``role_args["prefill"]`` and
    ``role_args["decode"]`` override them per role; ``pools`` sets each role's resources.
    ``local_prefill_max_tokens`` (default: the router's) bounds the prompts a decode worker may
    prefill itself; 0 sends every prompt to a prefill worker. ``speculative`` (a
    :class:`~cluster.engine.speculative.config.SpeculativeConfig`) is the decode pool's
    (``decode.speculative``): prefill workers never speculate. ``restart_workers`` is
    ``ray.restart_workers``: a worker that dies is started again in its place."""
    if model is None:
        from cluster.default_model import default_model_path

        model = str(default_model_path())
    for name, value in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    try:
        overrides = {} if local_prefill_max_tokens is None else {"local_prefill_max_tokens": local_prefill_max_tokens}
        router_config = router_config or RouterConfig.for_policy(policy, **overrides)
    except RouterConfigError as exc:
        raise EngineConfigError(str(exc)) from None
    pools = pools or {}
    common = {"device": "cpu", **engine_args}  # ranks without a GPU of Ray's: on this device, as tandem run's --device
    model_args = {key: common.pop(arg) for arg, key in _MODEL_ARGS.items() if arg in common}
    kv_args = {key: common.pop(arg) for arg, key in _KV_ARGS.items() if arg in common}
    pool_args = {key: common.pop(arg) for arg, key in _POOL_ARGS.items() if arg in common}
    speculative = common.pop("speculative", None)
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise EngineConfigError(f"speculative must be a SpeculativeConfig or None, got {quote(speculative)}")

    def pool(role: str, replicas: int, tp: int, **more) -> PoolSpec:
        resources = pools.get(role, PoolResources())
        return PoolSpec(replicas, tp, resources.gpus_per_rank, resources.cpus_per_rank,
                        NodeConstraints(resources=dict(resources.resources)), **pool_args, **more)

    spec = ClusterSpec(
        name=cluster_name,
        model=ModelSpec(path=str(model), name=Path(model).name, **model_args),
        prefill=pool("prefill", prefill_workers, prefill_tp),
        decode=pool("decode", decode_workers, decode_tp,
                    speculative=SpeculativeSpec(**asdict(speculative)) if speculative is not None else None),
        kv=KVSpec(transport=kv_transport, transfer_timeout_s=transfer_timeout_s, stream_layers=stream_layers,
                  **kv_args),
        router=router_config,
        registry=RegistrySpec(url=registry_url),
        ray=RaySpec(address=ray_address, restart_workers=restart_workers),
    )
    return spec, EngineOverrides(common, {role: dict(args) for role, args in (role_args or {}).items()})

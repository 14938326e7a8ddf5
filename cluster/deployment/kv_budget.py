"""How a node's KV budget (``kv_cache_memory_fraction`` of its RAM) is shared by the CPU ranks on
it: equally among the workers placed at start, and for a worker added to a running pool, the
share its pool's workers started with where the node's memory allows it.

The workers placed before an added one keep the caches they were sized with (resizing a cache
under running requests is not done), so dividing the budget again by every worker now gives the
added one less than its pool's others (2,856 blocks beside 4,285 for a decode worker added to a
1 + 1 cluster): routers, the KV-aware placement and the planner take a pool's workers as alike.
An added worker is sized like them instead, as far as the memory available on its node holds
its cache with as much again to spare (its weights and activations); never less than the share
counting every worker on the node now.
"""

from __future__ import annotations


def kv_memory_shares(ranks: list[tuple[str, int, bool]]) -> list[float]:
    """Each worker's share of its node's KV budget, from (node id, ranks, on a CPU) per worker.

    The budget (``kv_cache_memory_fraction`` of the node's RAM) is the node's: every CPU rank
    placed on a node takes an equal part of it. A GPU rank has a GPU of its own (Ray gives
    each rank one, or ranks take consecutive devices), so its budget is that GPU's: share 1.
    """
    on_node: dict[str, int] = {}
    for node, tp, cpu in ranks:
        if cpu:
            on_node[node] = on_node.get(node, 0) + tp
    return [1.0 / on_node[node] if cpu else 1.0 for node, _, cpu in ranks]


def added_worker_share(started_with: float | None, counting_all: float, ranks: int, fraction: float,
                       node_bytes: int, available_bytes: int) -> float:
    """The share of its node's KV budget (``fraction`` of ``node_bytes``) for each of the
    ``ranks`` of a worker added to a running pool: ``started_with`` (its pool's workers' share at
    start; None: none started) where ``available_bytes`` holds the cache twice over, else as
    much of it as does, never less than ``counting_all`` (every worker on the node now)."""
    if started_with is None or started_with <= counting_all:
        return counting_all
    per_share = 2 * ranks * fraction * node_bytes  # the memory one whole share would need, spare included
    return max(counting_all, min(started_with, available_bytes / per_share))

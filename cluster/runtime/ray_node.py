"""Which Ray node a worker is on: its id and address, as a worker reports them (its status and
its registry record) and as the deployment reads them for a placed placement group.

Nodes are told apart by id: on one machine (a test's several raylets on 127.0.0.1) every node
has the same address.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class NodePlace:
    node_id: str = ""  # Ray's node id (hex); "" outside Ray
    address: str = ""  # the node's IP address

    def __str__(self) -> str:
        return f"{self.node_id[:12]} ({self.address})" if self.node_id else "-"


def this_node() -> NodePlace:
    """The node this process runs on (``NodePlace()`` outside a Ray worker)."""
    import ray

    if not ray.is_initialized():
        return NodePlace()
    return NodePlace(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def this_incarnation() -> str:
    """This process's actor id inside a Ray actor (a worker started again under its name has
    another), else a random id."""
    import ray

    if ray.is_initialized():
        actor = ray.get_runtime_context().get_actor_id()
        if actor:
            return actor
    return uuid.uuid4().hex


def node_place(ray, node_id: str) -> NodePlace:
    """A node by id, with its address (the address is "" for a node Ray no longer lists)."""
    address = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "")
    return NodePlace(node_id, address)


def group_node(group) -> str:
    """The node a placed (STRICT_PACK) placement group's bundles are on."""
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["bundles_to_node_id"][0]

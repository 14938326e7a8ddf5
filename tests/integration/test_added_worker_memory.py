"""The deployment asks the node an added worker is placed on for its memory, through Ray in the
worker's placement group, and reads what the engine there would (``cluster/engine/host_memory.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.deployment.deployment import Deployment
from cluster.engine.host_memory import host_memory_bytes
from cluster.runtime.ray_runtime import ensure_ray

pytestmark = pytest.mark.integration


def test_the_memory_of_an_added_worker_s_node_is_read_there():
    from ray.util.placement_group import placement_group, remove_placement_group

    ray = ensure_ray("tandem-added-memory-tests", num_cpus=1)
    try:
        group = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
        assert group.wait(60)
        deployment = SimpleNamespace(_ray=ray, placement_groups={"decode-1": group})
        node_bytes, available = Deployment._node_memory(deployment, "decode-1")
        assert node_bytes == host_memory_bytes()  # one node: this machine
        assert 0 < available <= node_bytes
        remove_placement_group(group)
    finally:
        ray.shutdown()

"""Names and ports of process groups, derived from the cluster's name.

Two clusters on one machine (say, two test runs, or a staging and a production deployment on
one host) must never join each other's groups: every group's rendezvous port and store prefix
is a pure function of ``(cluster name, group name)``. Ports come from a range that the Linux
kernel does not hand out as ephemeral ports (32768-60999), so an outgoing connection of
another program does not take them by chance.
"""

from __future__ import annotations

import hashlib

from cluster.engine.config import GroupNameError, check_name

__all__ = ["PORT_RANGE", "GroupNameError", "check_name", "group_id", "group_port"]

PORT_RANGE = (20000, 32000)


def group_id(cluster: str, group: str) -> str:
    """The store prefix and log name of a group: ``<cluster>/<group>``."""
    return f"{check_name('cluster', cluster)}/{check_name('group', group)}"


def group_port(cluster: str, group: str) -> int:
    """The rendezvous port of a group, the same in every process that names it."""
    digest = hashlib.sha256(group_id(cluster, group).encode()).digest()
    low, high = PORT_RANGE
    return low + int.from_bytes(digest[:4], "big") % (high - low)

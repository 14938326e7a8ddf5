"""Starting or joining Ray for Tandem's processes.

Without an address, Tandem starts a local Ray bound to loopback (no dashboard: it costs about
1 GB and is started only by the commands that serve it). With one (``ray://`` or
``host:port``), it joins that cluster. Either way actors live in the namespace named after the
Tandem cluster, so two clusters on one Ray never see each other's named actors.
"""

from __future__ import annotations

import os


def ensure_ray(cluster: str, address: str | None = None, num_cpus: int | None = None):
    """Initialises Ray for this process once; returns the ``ray`` module."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, namespace=cluster, log_to_driver=True)
    else:
        ray.init(
            namespace=cluster,
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    return ray

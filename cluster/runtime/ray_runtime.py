"""Starting or joining Ray for Tandem's processes.

Without an address, Tandem starts a local Ray bound to loopback (no dashboard: it costs about
1 GB and is started only by the commands that serve it). With one (``ray://`` or
``host:port``), it joins that cluster. Either way actors live in the namespace named after the
Tandem cluster, so two clusters on one Ray never see each other's named actors.

Token authentication: a local Ray that Tandem starts keeps Ray's default for a new cluster,
token authentication on (``RAY_AUTH_MODE=disabled`` in the environment turns it off). Even
on loopback that matters: any local user can reach a loopback port, and whoever reaches Ray
can run code as this user. Ray announces that default on every start; Tandem drops Ray's
notice, and ``tandem up`` says once, in its own words, where the token is
(:func:`auth_summary`), which is what a dashboard or ``ray`` command asks for.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropAuthNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_RAY_AUTH_NOTICE)


def quiet_auth_notice() -> None:
    """Drops Ray's notice that a new local cluster has token authentication on (once per process)."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DropAuthNotice) for f in logger.filters):
        logger.addFilter(_DropAuthNotice())


def silence_ray_output() -> None:
    """Prints nothing more of Ray's in this process: neither the worker logs Ray forwards to the
    driver (``log_to_driver``) nor its own loggers'. For a stop, where Ray's account of a
    shutdown (Serve deleting the app, its controller's pending calls failing as it exits, a
    worker's last lines) is noise to whoever asked for it; the stop says what happened itself."""
    for name in ("ray", "ray.serve"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        from ray._private import worker
        from ray._private.ray_logging import stderr_deduplicator, stdout_deduplicator
    except ImportError:
        return
    worker.global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")  # workers' lines
    worker.print_to_stdstream = lambda *args, **kwargs: None  # errors Ray pushes to the driver ("(raylet) Task ...")
    for deduplicator in (stdout_deduplicator, stderr_deduplicator):
        deduplicator.flush()  # the lines held back to count repeats: dropped, not printed at shutdown


def auth_summary() -> str:
    """Where this process's Ray token comes from, or that there is none (after ``ray.init``)."""
    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    if mode != "token":
        return "no token authentication (RAY_AUTH_MODE is not 'token')"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "token authentication; the token is in $RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path("~/.ray/auth_token"))
    return f"token authentication; the token is in {path}"


def ray_environment() -> None:
    """What Ray reads from the environment, set (where the caller left it unset) before ``import
    ray`` and before a local Ray starts, by the two ways this project starts one: ``tandem up``
    (``cluster/deployment/launcher.py``) and ``ensure_ray`` (a deployment built in process: the
    offline disaggregated API, the tests, the benchmarks).

    Ray starts worker processes at nice 15 so that its driver stays responsive. Here the workers
    are the service: at 15 every process at 0 (the API's clients, Ray's own daemons) preempted the
    decode step. ``RAY_worker_niceness`` is read by the raylet this process starts; a node started
    by `ray start` takes it from its own environment (the helm chart sets it). The quick start's
    one stream, started alternately at 15 and at 0: 122, 92, 115 against 132, 132, 150 tokens/s."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")


def ensure_ray(cluster: str, address: str | None = None, num_cpus: int | None = None):
    """Initialises Ray for this process once; returns the ``ray`` module."""
    ray_environment()
    import ray

    if ray.is_initialized():
        return ray
    if address:
        ray.init(address=address, namespace=cluster, log_to_driver=True)
    else:
        quiet_auth_notice()
        # "local": a Ray of its own, even where another was started on this machine (ray.init()
        # without an address joins the latest local one: another cluster's, another user's).
        ray.init(
            address="local",
            namespace=cluster,
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    return ray

"""``tandem scale``: resizing a running cluster that ``tandem up`` started here, without losing a
request (``cluster/deployment/scaling.py`` says how each step goes).

    tandem scale add decode                 a decode worker more
    tandem scale remove decode-0            drained (its requests finish), then stopped
    tandem scale move prefill-1 decode      drained and removed, and a decode worker added in its room

Each step is printed as it happens; the pools after it end the output.
"""

from __future__ import annotations

import argparse
import sys

ROLES = ("prefill", "decode", "colocated")


def add_scale_command(sub) -> None:
    scale = sub.add_parser("scale", help="resize a running cluster: add a worker, drain and remove one, or move "
                                         "one to the other role")
    scale.add_argument("--cluster", default="tandem", help="cluster name (default: tandem)")
    actions = scale.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="add a worker to a pool")
    add.add_argument("role", choices=ROLES)
    remove = actions.add_parser("remove", help="drain a worker (no new requests; those in flight finish), then "
                                               "stop it and free its placement group")
    remove.add_argument("worker", help="its name, as `tandem status` shows it (decode-0, ...)")
    move = actions.add_parser("move", help="drain and remove a worker, then add one of the other role")
    move.add_argument("worker", help="its name, as `tandem status` shows it (prefill-1, ...)")
    move.add_argument("role", choices=ROLES)
    for parser in (remove, move):
        parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                            help="seconds for its requests in flight to finish; those left then move to other "
                                 "workers (default: 60)")
    scale.set_defaults(func=run_scale_command)


def run_scale_command(args: argparse.Namespace) -> int:
    from cluster.deployment.scale_client import ClusterNotUp, scale_cluster
    from cluster.protocol.messages import ScaleRequest

    timeout = getattr(args, "timeout", 60.0)
    if not timeout > 0:
        print(f"tandem scale: --timeout must be positive, got {timeout:g}", file=sys.stderr)
        return 2
    request = ScaleRequest(args.action, role=getattr(args, "role", ""), worker=getattr(args, "worker", ""),
                           timeout_s=timeout)
    try:
        result = scale_cluster(args.cluster, request, lambda line: print(f"[tandem] {line}", flush=True))
    except (ClusterNotUp, OSError) as exc:
        print(f"tandem scale: {exc}", file=sys.stderr)
        return 1
    if not result.ok:
        print(f"tandem scale: {result.message}", file=sys.stderr)
        return 1
    pools = "; ".join(f"{role}: {', '.join(names) or '-'}" for role, names in result.members.items())
    print(f"[tandem] pools now: {pools}", flush=True)
    return 0

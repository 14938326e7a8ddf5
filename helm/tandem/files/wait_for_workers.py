"""Waits until the Ray head answers and every Tandem pool pod has joined the Ray cluster.

Run by start-head.sh before `tandem up`. The resources to wait for come from
$TANDEM_WAIT_RESOURCES (JSON: custom resource name to total units, e.g. {"tandem-prefill": 4,
"tandem-decode": 4}); the deadline from $TANDEM_WAIT_SECONDS (0: no deadline); it polls every
$TANDEM_WAIT_POLL_SECONDS (5). Exit status 0: all joined; 1: the deadline passed; 2: Ray's head
process exited.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cluster.deployment.state_file import process_alive


def log(message: str) -> None:
    print(f"[tandem-head] {message}", file=sys.stderr, flush=True)


def alive(pid: int | None) -> bool:
    return pid is None or process_alive(pid)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", default="127.0.0.1:6379")
    parser.add_argument("--ray-pid", type=int, default=None)
    args = parser.parse_args()
    need = json.loads(os.environ.get("TANDEM_WAIT_RESOURCES") or "{}")
    seconds = float(os.environ.get("TANDEM_WAIT_SECONDS") or 0)
    deadline = time.monotonic() + seconds if seconds > 0 else None
    poll = float(os.environ.get("TANDEM_WAIT_POLL_SECONDS") or 5)

    def expired() -> bool:
        return deadline is not None and time.monotonic() > deadline

    import ray

    connected = False
    while not connected:
        if not alive(args.ray_pid):
            log("Ray's head process exited before it answered")
            return 2
        if expired():
            log(f"Ray's head did not answer on {args.address} within {seconds:.0f}s")
            return 1
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False, namespace="tandem-wait")
            connected = True
        except Exception as exc:  # noqa: BLE001 - the GCS or the head's raylet is not up yet
            log(f"waiting for Ray's head ({type(exc).__name__})")
            time.sleep(poll)

    try:
        last = None
        while True:
            total = ray.cluster_resources()
            missing = {name: (total.get(name, 0.0), amount) for name, amount in need.items()
                       if total.get(name, 0.0) + 1e-9 < amount}
            if not missing:
                log("every pool pod has joined: " + ", ".join(f"{name} {amount:g}" for name, amount in need.items()))
                return 0
            report = ", ".join(f"{name} {have:g}/{want:g}" for name, (have, want) in sorted(missing.items()))
            if report != last:
                log(f"waiting for the pool pods to join the Ray cluster: {report}")
                last = report
            if not alive(args.ray_pid):
                log("Ray's head process exited")
                return 2
            if expired():
                log(f"the pool pods did not all join within {seconds:.0f}s: {report} "
                    "(see `kubectl get pods` and `kubectl describe pod` for pending ones)")
                return 1
            time.sleep(poll)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

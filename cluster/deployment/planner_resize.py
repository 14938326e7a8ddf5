"""What the live planner's ``act`` does to a deployment: resize its pools to a split with the
fewest steps of ``deployment.scale`` (``cluster/deployment/scaling.py``): workers moved from the
role that has too many to the one that lacks them first (a move keeps the hardware), then
workers added, then removed. The newest worker of a role is the one moved or removed."""

from __future__ import annotations

from cluster.deployment.supervisor import log
from cluster.plan.live.propose import Split


def split_of(deployment) -> Split:
    return Split(len(deployment.members.get("prefill", ())), len(deployment.members.get("decode", ())))


def resize_to(deployment, target: Split) -> str:
    """Resizes the deployment's pools to ``target``; returns what it did, in one line."""
    steps = []

    def newest(role: str) -> str:
        return deployment.members[role][-1]

    while True:
        now = split_of(deployment)
        if now.prefill > target.prefill and now.decode < target.decode:
            worker = newest("prefill")
            steps.append(f"moved {worker} to {deployment.scale.move(worker, 'decode', say=log)}")
        elif now.decode > target.decode and now.prefill < target.prefill:
            worker = newest("decode")
            steps.append(f"moved {worker} to {deployment.scale.move(worker, 'prefill', say=log)}")
        elif now.prefill < target.prefill:
            steps.append(f"added {deployment.scale.add('prefill', say=log)}")
        elif now.decode < target.decode:
            steps.append(f"added {deployment.scale.add('decode', say=log)}")
        elif now.prefill > target.prefill:
            worker = newest("prefill")
            deployment.scale.remove(worker, say=log)
            steps.append(f"removed {worker}")
        elif now.decode > target.decode:
            worker = newest("decode")
            deployment.scale.remove(worker, say=log)
            steps.append(f"removed {worker}")
        else:
            return ", ".join(steps) if steps else "nothing to do"

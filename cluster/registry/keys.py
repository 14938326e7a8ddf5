"""The registry's key schema. Every key starts with ``tandem:<cluster>:``, so clusters sharing
one Redis never see each other's data.

    tandem:<c>:workers                    SET   ids of workers that have published
    tandem:<c>:worker:<w>:alive           STR   heartbeat; expires unless renewed
    tandem:<c>:worker:<w>:seq             STR   sequence number of the last applied event batch
    tandem:<c>:worker:<w>:blocks          SET   hex block hashes the worker holds (in any tier)
    tandem:<c>:block:<hash>               HASH  worker id -> the best tier it holds the block in (device, host)
    tandem:<c>:worker:<w>:load            STR   JSON load report (cluster/registry/load.py); expires with the heartbeat
    tandem:<c>:goodput:...                      finished-request counters (cluster/registry/goodput.py)
    tandem:<c>:routers                    HASH  router name -> its JSON status (router/service.py), rewritten
                                                every few seconds; an entry not rewritten for a while is gone
    tandem:<c>:worker_events              LIST  JSON workers lost, started again, added, draining and removed,
                                                newest first, capped (cluster/registry/worker_events.py)
    tandem:<c>:membership                 STR   JSON workers by role and those draining, versioned
                                                (cluster/registry/membership.py)
    tandem:<c>:planner:decisions          HASH  decision number -> JSON, the live planner's latest decisions
    tandem:<c>:planner:latest             STR   JSON, its latest look (cluster/registry/planner_decisions.py)
"""

from __future__ import annotations


class Keys:
    def __init__(self, cluster: str):
        self.prefix = f"tandem:{cluster}:"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    def alive(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:alive"

    def seq(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:seq"

    def worker_blocks(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:blocks"

    def load(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:load"

    @property
    def worker_events(self) -> str:
        return self.prefix + "worker_events"

    @property
    def planner_decisions(self) -> str:
        return self.prefix + "planner:decisions"

    @property
    def planner_latest(self) -> str:
        return self.prefix + "planner:latest"

    @property
    def membership(self) -> str:
        return self.prefix + "membership"

    @property
    def routers(self) -> str:
        return self.prefix + "routers"

    def block(self, block_hash: str) -> str:
        return f"{self.prefix}block:{block_hash}"

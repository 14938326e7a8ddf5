"""What prefill and decode workers share: an engine stepped by one background thread.

Calls into a worker run on Ray's threads (the actors are threaded); every use of the engine's
scheduler goes through ``_lock``. The loop steps whenever ``_has_work()`` says so and hands
each step's outputs to ``_on_outputs``; it naps briefly when idle.
"""

from __future__ import annotations

import threading
import time

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.kv_transfer.agent import PairLayout
from cluster.parallel.group import GroupSpec


class EngineWorker:
    prefill_side: bool = True

    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config, verbose=False)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, name=f"{type(self).__name__}-loop", daemon=True)
        self._loop.start()

    def describe(self) -> dict:
        engine = self.engine
        return {"num_kv_heads": engine.model_config.num_kv_heads, "tp": engine.config.tensor_parallel_size,
                "num_layers": engine.model_config.num_layers, "free_blocks": self.free_blocks(),
                "num_blocks": engine.block_manager.num_blocks, "block_size": engine.config.block_size,
                "max_model_len": engine.max_model_len}

    def join_pair(self, layout: PairLayout, spec: GroupSpec) -> None:
        """Joins the transfer group shared with one worker of the other role (every TP rank)."""
        self.engine.runner.join_transfer(layout, spec, self.prefill_side)

    def free_blocks(self) -> int:
        with self._lock:
            return self.engine.block_manager.num_free_blocks

    def shutdown(self) -> None:
        self._stop.set()
        self._loop.join(timeout=10)
        self.engine.shutdown()

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                busy = self._has_work()
                if busy:
                    self._on_outputs(self.engine.step())
            if not busy:
                time.sleep(0.001)

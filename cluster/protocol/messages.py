"""The messages between Tandem's processes, as frozen dataclasses: what crosses a process
boundary is one of these, never a tuple or a dict whose keys are spelled in several files.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import RouterConfig
from router.router import Topology


@dataclass(frozen=True)
class ServingInfo:
    """What an ingress needs to know of a deployment to serve it: the model, the request
    limits of its smallest generating worker, the names of its workers, and the registry and
    topology its router places over."""

    cluster: str
    model_dir: str
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # of the smallest decode (or colocated) worker: a request needing more can never run
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    registry_url: str
    router_topology: Topology
    router_config: RouterConfig
    transfer_timeout_s: float = 60.0
    stream_layers: bool = True
    stream_token: str = ""  # presented on every connection to a worker's stream (cluster/protocol/stream.py)

    @property
    def workers(self) -> tuple[str, ...]:
        return self.prefill + self.decode + self.colocated

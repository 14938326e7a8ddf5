"""What a decode worker's call to a prefill worker costs beyond the prefill's own work: the
hop a remote prefill makes and a local one does not (Ray's dispatch, its thread hand-offs, the
answer's way back; 3-4 ms a call measured on the CPU quick start, where the prefill of a short
prompt takes about 7).

Each remote prefill gives a sample (its call's wall time less the prefill worker's own time on
it, ``PrefillResult.service_s``); pairing gives the first ones, before any request, by timing
calls that do nothing. The worker reports the median of the latest samples in its load
(``WorkerLoad.prefill_call_s``), and the router adds it to a remote prefill's predicted TTFT.
"""

from __future__ import annotations

import statistics
from collections import deque

SAMPLES_KEPT = 16  # the latest calls the median is taken over: one slowed call does not move it


class CallOverhead:
    def __init__(self, kept: int = SAMPLES_KEPT):
        self._samples: deque[float] = deque(maxlen=kept)

    def add(self, seconds: float) -> None:
        self._samples.append(max(0.0, seconds))

    @property
    def seconds(self) -> float:
        """The median of the latest samples; 0 before any."""
        samples = tuple(self._samples)  # the reporter reads it from its own thread
        return statistics.median(samples) if samples else 0.0

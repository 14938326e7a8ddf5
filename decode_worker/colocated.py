"""A worker of a ``colocated`` pool."""

from __future__ import annotations

from decode_worker.worker import DecodeWorker


class ColocatedWorker(DecodeWorker):
    """A worker of a ``colocated`` pool: it prefills and decodes every request itself (no KV
    travels), the baseline that disaggregation is measured against."""

    role = "colocated"

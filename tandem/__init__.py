"""The Python client of a Tandem cluster.

``TandemClient`` speaks the public gRPC API (``proto/tandem/v1/tandem.proto``); its generated
messages and stubs are in ``tandem.v1``. gRPC errors come out as ``TandemError``.
"""

from tandem.client import TandemClient, TandemError

__all__ = ["TandemClient", "TandemError"]

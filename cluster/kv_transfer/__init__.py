"""Moving KV caches from prefill workers to decode workers.

``state`` holds the explicit life cycle of one request's transfer (waiting, transferring,
done, failed, aborted) with its deadline; ``resharding`` decides which KV heads travel between
which ranks when the two sides run different tensor-parallel degrees; ``transport`` is the
interface a transport implements (chosen by name in configuration) and ``torch_transport`` is
the first one, point-to-point ``torch.distributed`` (gloo on CPUs, NCCL on GPUs).
"""

"""The names of the KV tiers a block may sit in, as KV events and the registry spell them."""

DEVICE = "device"  # the engine's KV cache, read by the forward
HOST = "host"  # the host tier (cluster/engine/kv_tiers/host_pool.py): loaded back before a forward reads it
TIERS = (DEVICE, HOST)

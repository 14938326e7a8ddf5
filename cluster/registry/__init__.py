"""The cluster's Redis-backed registry: which worker holds which KV block, and liveness."""

"""The prefill role: an engine that computes prompts and streams their KV to decode workers."""

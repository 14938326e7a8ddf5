"""The decode role: an engine that receives prompts' KV from prefill workers and generates."""

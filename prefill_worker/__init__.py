"""prefill_worker role (built in later issues)."""

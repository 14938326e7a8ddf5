"""router role (built in later issues)."""

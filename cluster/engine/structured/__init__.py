"""Constrained decoding: a request's output held to a JSON schema, a regex, a grammar or a list of choices."""

"""Constrained decoding: a request's output held to a JSON schema, a regex, a grammar or a list of choices.

``spec.py`` is what a request carries (``SamplingParams.structured``) and ``fields.py`` how the
APIs' fields become one; ``grammars.py`` turns a spec into the backend's grammar and checks it
without a tokenizer (the ingress does, before routing); ``backend.py`` compiles it against the
model's tokenizer (cached by spec); ``matcher.py`` is a request's place in its grammar;
``masks.py`` builds a step's token masks on a thread and ``bitmask.py`` applies them to the logits.
"""

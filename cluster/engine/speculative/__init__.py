"""Speculative decoding: several tokens per decode step, exact.

A proposer guesses the next tokens of a decoding request (``ngram``: copied from earlier in its
own prompt and output); the next step feeds the request's last token and the guesses as rows of
one step, each row attending to the cache up to itself, and samples every row from the target
model as usual (``verify``). A guess is kept while it equals the token its row's sample drew,
and the first row that disagrees gives its own sample instead: greedy output is the output
without speculation, token for token, and a sampled token is a draw from the target's own
distribution (for a deterministic proposal, rejection sampling accepts a guess ``d`` with
probability ``p(d)`` and otherwise draws from ``p`` without ``d``: exactly what one draw from
``p`` compared with ``d`` does). ``policy`` chooses how many guesses each request gets from the
engine's measured step times and the measured odds that guesses are kept, none where verifying
would cost more than it saves.
"""

"""A request's prompt (text, token ids or chat messages) as the token ids the engine and the
router's block hashes see. Torch-free, so an ingress tokenizes without loading the engine."""

from __future__ import annotations

from typing import Sequence, Union

from cluster.engine.chat_template import ChatPrompt, ChatTemplateError
from cluster.engine.request_limits import quote
from cluster.engine.sampling_params import InvalidRequestError
from cluster.engine.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], ChatPrompt]


def prompt_token_ids(prompt: Prompt, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """A prompt's token ids, checked against the vocabulary: text is tokenized, chat messages are
    rendered with the model's chat template and then tokenized. This is where every request
    becomes the token ids the engine (and the router's block hashes) see. Raises
    InvalidRequestError naming what to fix."""
    if isinstance(prompt, (str, ChatPrompt)) and tokenizer is None:
        what = "prompt_token_ids instead of prompt" if isinstance(prompt, str) else "prompt_token_ids instead of messages"
        raise InvalidRequestError(f"this model has no tokenizer; send {what}")
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, ChatPrompt):
        try:
            token_ids = tokenizer.apply_chat_template(prompt.messages, prompt.add_generation_prompt, prompt.tools,
                                                      prompt.tool_format)
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from None
    else:
        token_ids = list(prompt)
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt_token_ids must be integers in [0, {vocab_size}); got {quote(bad[:5])}")
    return token_ids

"""A draft model's KV of the prompt built by the prefill engine beside the model's and sent with
it (``TransferTarget.draft_first_block``), through the engines' own transfer code over the
in-process transport (the workers' test, ``test_disaggregated.py``, runs them as Ray actors
over gloo).

Greedy tokens equal ``transformers``' and those of the decode engine catching the draft up
itself; a draft that is the model keeps every guess (the draft's KV that arrived is the one it
would have built), and the decode engine's draft is never fed a prompt token (its first forward
for each request starts at the prompt's end). Blocks: none held on either side after rejected
guesses, cancellations and a request moved to another decode engine with its output so far.
"""

from __future__ import annotations

import itertools

import pytest

from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.engine import LLMEngine
from cluster.engine.request import TransferTarget
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.kv_transfer import transports
from cluster.kv_transfer.agent import PairLayout, TransferAgent
from cluster.kv_transfer.in_process_transport import InProcessTransport
from cluster.kv_transfer.sender import TAG_STRIDE
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import engine_runner
from conftest import random_prompts
from reference_checks import reference_greedy

pytestmark = pytest.mark.integration

BLOCK = 16
BLOCKS = 48
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
_names = itertools.count()


@pytest.fixture(autouse=True)
def in_process_transport(monkeypatch):
    monkeypatch.setitem(transports._TRANSPORTS, InProcessTransport.name, InProcessTransport)


def prefill_engine(model_dir, draft_dir) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), num_kv_blocks=BLOCKS, block_size=BLOCK, max_num_seqs=4,
                          max_num_batched_tokens=32, prompt_draft_model=str(draft_dir),
                          engine_name=f"prefill-{next(_names)}")
    return LLMEngine(config, verbose=False, make_runner=engine_runner(kv_port=TransferAgent))


def decode_engine(model_dir, draft_dir) -> LLMEngine:
    speculative = SpeculativeConfig(method="draft", draft_model=str(draft_dir), num_tokens=4, adaptive=False)
    config = EngineConfig(model=str(model_dir), num_kv_blocks=BLOCKS, block_size=BLOCK, max_num_seqs=4,
                          speculative=speculative, engine_name=f"decode-{next(_names)}")
    return LLMEngine(config, verbose=False, make_runner=engine_runner(kv_port=TransferAgent))


def paired(prefill: LLMEngine, decode: LLMEngine) -> str:
    name = f"draft-pair-{next(_names)}"
    layout = PairLayout(name, 1, 1, prefill.model_config.num_kv_heads, InProcessTransport.name)
    spec = GroupSpec("draft-prompt-kv-tests", name, 2)
    prefill.runner.join_transfer(layout, spec, True)
    decode.runner.join_transfer(layout, spec, False)
    return name


def spans_fed(decode: LLMEngine) -> dict[str, list[tuple[int, int]]]:
    """Per request, the (start, end) of each span the decode engine's draft is fed in a forward
    that feeds whole spans (its first guess after a gap: the prompt, or what it missed)."""
    fed: dict[str, list[tuple[int, int]]] = {}
    run = decode.draft._run_spans

    def logged(spans):
        for span in spans:
            fed.setdefault(span.request.request_id, []).append((span.start, span.end))
        return run(spans)

    decode.draft._run_spans = logged
    return fed


def hand_off(prefill: LLMEngine, decode: LLMEngine, pair: str, request_id: str, prompt: list[int],
             with_draft: bool, tag: int) -> None:
    """The decode engine reserves, the prefill engine computes the prompt (and, ``with_draft``,
    its draft's KV) and sends it, the decode engine receives and admits the first token."""
    first_block, dst = decode.reserve_transfer(request_id, prompt, GREEDY)
    draft_first, draft_blocks = decode.draft_destination(request_id) if with_draft else (None, None)
    tag_base = tag * decode.transfer_layers * TAG_STRIDE
    target = TransferTarget(pair, tag_base, first_block, 10.0, True, draft_first)
    prefill.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        transfer=target)
    first = None
    while prefill.has_unfinished_requests():
        for output in prefill.step():
            first = output.token_ids[0] if output.token_ids else first
    assert prefill.transfer_errors.pop(request_id) is None
    assert decode.receive_transfer(pair, request_id, dst, tag_base, 10.0, draft_blocks) is None
    decode.admit_transfer(request_id, first, draft_first_block=draft_first)


def run_to_end(engine: LLMEngine, cancel: frozenset[str] = frozenset()) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
            if output.request_id in cancel and not output.finished and len(output.token_ids) >= 3:
                engine.abort_request(output.request_id)
    return tokens


def serve(model_dir, draft_dir, prompts, with_draft: bool):
    prefill, decode = prefill_engine(model_dir, draft_dir), decode_engine(model_dir, draft_dir)
    pair, fed = paired(prefill, decode), spans_fed(decode)
    for index, prompt in enumerate(prompts):
        hand_off(prefill, decode, pair, f"r{index}", prompt, with_draft, index)
    tokens = run_to_end(decode)
    return prefill, decode, [tokens[f"r{i}"] for i in range(len(prompts))], fed


def test_a_self_draft_whose_prompt_kv_came_from_the_prefill_engine_keeps_every_guess(checkpoint, reference_model):
    """Prompts of 1 to 3 blocks and over (70: in 3 chunks on the prefill engine), with the draft's
    KV sent and, for comparison, caught up by the decode engine: the tokens of ``transformers``
    both ways, every guess kept, and with it sent no prompt token fed to the decode side's draft."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([5, 16, 33, 70], seed=21)
    expected = [reference_greedy(reference_model(model_dir), p, MAX_TOKENS)[0] for p in prompts]
    for with_draft in (True, False):
        prefill, decode, tokens, fed = serve(model_dir, model_dir, prompts, with_draft)
        assert tokens == expected, with_draft
        stats = decode.stats
        assert stats.proposed_tokens > 50 and stats.accepted_tokens == stats.proposed_tokens
        # The first guess follows the first decode step: the draft is fed the two output tokens so far,
        # after the prompt sent to it, or after the whole prompt caught up on here.
        first_spans = [fed[f"r{i}"][0] for i in range(len(prompts))]
        if with_draft:
            assert first_spans == [(len(p), len(p) + 2) for p in prompts]
            assert prefill.draft.prompt_tokens == sum(len(p) for p in prompts)
        else:
            assert first_spans == [(0, len(p) + 2) for p in prompts]
            assert prefill.draft.prompt_tokens == 0  # not asked for: the prefill engine's draft ran nothing
        assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == BLOCKS


def test_a_smaller_draft_sent_from_the_prefill_engine_gives_the_tokens_of_transformers(
        checkpoint, draft_checkpoint, reference_model):
    """A smaller random draft: most guesses are rejected; the tokens are still the model's, and
    no block is held on either side afterwards."""
    model_dir = checkpoint("llama")
    prompts = random_prompts([9, 40, 64], seed=22)
    expected = [reference_greedy(reference_model(model_dir), p, MAX_TOKENS)[0] for p in prompts]
    prefill, decode, tokens, fed = serve(model_dir, draft_checkpoint("llama"), prompts, with_draft=True)
    assert tokens == expected
    assert decode.stats.proposed_tokens > decode.stats.accepted_tokens  # guesses were rejected
    assert [fed[f"r{i}"][0][0] for i in range(len(prompts))] == [len(p) for p in prompts]
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == BLOCKS


def test_cached_blocks_are_not_sent_again_and_cancelled_and_moved_requests_hold_no_block(checkpoint):
    """A second turn on the same prompt (its full blocks cached on both sides: the draft's KV of
    them too, so only the last block's travels); a third of the requests cancelled mid-stream;
    one request moved (as the ingress moves one from a dead decode worker) to a second decode
    engine with its output so far as prompt: its tokens go on as without the move."""
    model_dir = checkpoint("llama")
    prefill, decode = prefill_engine(model_dir, model_dir), decode_engine(model_dir, model_dir)
    pair, fed = paired(prefill, decode), spans_fed(decode)
    prompt = random_prompts([40], seed=23)[0]
    hand_off(prefill, decode, pair, "first", prompt, True, 0)
    expected = run_to_end(decode)["first"]
    request_blocks = -(-len(prompt) // BLOCK)
    decode.reserve_transfer("again", prompt, GREEDY)
    assert decode.draft_destination("again")[0] == len(prompt) // BLOCK  # its full blocks hold the draft's KV here
    decode.abort_request("again")
    hand_off(prefill, decode, pair, "again", prompt, True, 1)
    assert run_to_end(decode)["again"] == expected
    assert fed["again"][0] == (len(prompt), len(prompt) + 2) and request_blocks == 3

    prompts = random_prompts([12, 30, 45, 20, 50, 8], seed=24)
    for index, p in enumerate(prompts):
        hand_off(prefill, decode, pair, f"c{index}", p, True, 2 + index)
    cancelled = frozenset({"c1", "c4"})
    tokens = run_to_end(decode, cancel=cancelled)
    assert all(len(tokens[c]) < MAX_TOKENS for c in cancelled)
    assert decode.stats.accepted_tokens == decode.stats.proposed_tokens

    # A move: 7 tokens streamed on the first decode engine, the rest on another one.
    moved_to = decode_engine(model_dir, model_dir)
    moved_pair = paired(prefill, moved_to)
    streamed = expected[:7]
    rest = SamplingParams(temperature=0, max_tokens=MAX_TOKENS - 7, ignore_eos=True)
    first_block, dst = moved_to.reserve_transfer("moved", prompt + streamed, rest, resumed_tokens=7)
    draft_first, blocks = moved_to.draft_destination("moved")
    target = TransferTarget(moved_pair, 0, first_block, 10.0, True, draft_first)
    prefill.add_request("moved", prompt + streamed, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        transfer=target)
    first = run_to_end(prefill)["moved"][0]
    assert moved_to.receive_transfer(moved_pair, "moved", dst, 0, 10.0, blocks) is None
    moved_to.admit_transfer("moved", first, draft_first_block=draft_first)
    assert streamed + run_to_end(moved_to)["moved"] == expected
    assert moved_to.stats.accepted_tokens == moved_to.stats.proposed_tokens > 0
    for engine in (prefill, decode, moved_to):
        assert engine.block_manager.num_free_blocks == BLOCKS


def test_an_engine_that_speculates_takes_its_draft_from_speculative_not_prompt_draft_model(checkpoint):
    model_dir = checkpoint("llama")
    with pytest.raises(EngineConfigError, match="prompt_draft_model is for an engine that only prefills"):
        EngineConfig(model=str(model_dir), prompt_draft_model=str(model_dir),
                     speculative=SpeculativeConfig(method="ngram"))
    plain = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=BLOCKS, engine_name="plain-prefill"),
                      verbose=False)
    with pytest.raises(InvalidRequestError, match="^plain-prefill loads no draft model to build the prompt's draft KV"):
        plain.add_request("r", [5, 6, 7], transfer=TransferTarget("p", 0, 0, 1.0, True, 0))
    assert plain.block_manager.num_free_blocks == BLOCKS and not plain.has_unfinished_requests()


def test_a_draft_kv_that_never_arrives_fails_the_receive_by_its_deadline_and_holds_no_block(checkpoint):
    """The decode engine waits for the draft's blocks a prefill engine never sends (it was not
    asked): its receive ends at the deadline with an error naming the draft's KV, after the
    model's KV arrived; the request is then released and no block stays held."""
    model_dir = checkpoint("llama")
    prefill, decode = prefill_engine(model_dir, model_dir), decode_engine(model_dir, model_dir)
    pair = paired(prefill, decode)
    prompt = random_prompts([40], seed=25)[0]
    first_block, dst = decode.reserve_transfer("lost", prompt, GREEDY)
    _, draft_blocks = decode.draft_destination("lost")
    prefill.add_request("lost", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        transfer=TransferTarget(pair, 0, first_block, 10.0, True, None))
    run_to_end(prefill)
    error = decode.receive_transfer(pair, "lost", dst, 0, 0.5, draft_blocks)
    assert error is not None and error.startswith("draft model's KV: ")
    decode.abort_request("lost")
    assert prefill.block_manager.num_free_blocks == decode.block_manager.num_free_blocks == BLOCKS

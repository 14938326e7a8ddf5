"""Where a draft model's KV of a prompt is built, measured: by the prefill engine beside the
model's (sent with it) or by the decode engine catching its draft up at the request's first
guess. One run, side by side, on the default model drafting for itself (the only checkpoint on
hand with its tokenizer), two engines in this process over the in-process transport:

- the prefill engine's draft per prompt token (``DraftProposer.prompt_s_per_token``, what a
  prefill worker reports) and its prefill time with and without the draft's work;
- the decode engine's catch-up forward per prompt token, measured, and what the policy charges
  a catch-up token (``catch_up_s_per_token``);
- the draft's block bytes, and the transfer time they would add at the router's default
  per-block rate for gloo on this CPU (``router/cost_model.py: DEFAULT_PULL_S_PER_BLOCK``, per
  the model's block; scaled by bytes for the draft's);
- what ``draft_prompt_kv: auto`` chooses (``speculative/prompt_kv.py``).

    python benchmarks/draft_prompt_kv.py [--lengths 128,512]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from cluster.default_model import default_model_path
from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.request import TransferTarget
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.speculative.prompt_kv import DraftPromptCosts, build_on_prefill
from cluster.kv_transfer import transports
from cluster.kv_transfer.agent import PairLayout, TransferAgent
from cluster.kv_transfer.in_process_transport import InProcessTransport
from cluster.kv_transfer.sender import TAG_STRIDE
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import engine_runner
from router.cost_model import DEFAULT_PULL_S_PER_BLOCK

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engines(model: str):
    transports.register_transport(InProcessTransport)
    common = dict(model=model, num_kv_blocks=256, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=2048)
    prefill = LLMEngine(EngineConfig(**common, prompt_draft_model=model, engine_name="bench-prefill"), verbose=False,
                        make_runner=engine_runner(kv_port=TransferAgent))
    speculative = SpeculativeConfig(method="draft", draft_model=model, num_tokens=3, adaptive=False)
    decode = LLMEngine(EngineConfig(**common, speculative=speculative, engine_name="bench-decode"), verbose=False,
                       make_runner=engine_runner(kv_port=TransferAgent))
    layout = PairLayout("bench", 1, 1, prefill.model_config.num_kv_heads, InProcessTransport.name)
    spec = GroupSpec("draft-prompt-kv-bench", "bench", 2)
    prefill.runner.join_transfer(layout, spec, True)
    decode.runner.join_transfer(layout, spec, False)
    return prefill, decode


def hand_off(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int], with_draft: bool,
             tag: int) -> tuple[float, float]:
    """Prefill seconds (the prefill engine's steps) and the decode engine's draft seconds until
    the request's first guesses were made."""
    first_block, dst = decode.reserve_transfer(request_id, prompt, GREEDY)
    draft_first, draft_blocks = decode.draft_destination(request_id) if with_draft else (None, None)
    tag_base = tag * decode.transfer_layers * TAG_STRIDE
    prefill.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                        transfer=TransferTarget("bench", tag_base, first_block, 60.0, True, draft_first))
    started, first = time.perf_counter(), None
    while prefill.has_unfinished_requests():
        for output in prefill.step():
            first = output.token_ids[0] if output.token_ids else first
    prefill_s = time.perf_counter() - started
    assert decode.receive_transfer("bench", request_id, dst, tag_base, 60.0, draft_blocks) is None
    decode.admit_transfer(request_id, first, draft_first_block=draft_first)
    draft_before = decode.draft.forward_seconds
    decode.step()  # the first decode step; its guesses are made after it (the catch-up, where there is one)
    draft_s = decode.draft.forward_seconds - draft_before
    while decode.has_unfinished_requests():
        decode.step()
    return prefill_s, draft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="128,512")
    args = parser.parse_args()
    model = str(default_model_path())
    prefill, decode = engines(model)
    import torch

    generator = torch.Generator().manual_seed(0)
    vocab = prefill.model_config.vocab_size
    for warm in range(2):  # warm both engines (and give the decode engine's policy a step cost)
        prompt = torch.randint(10, vocab, (64,), generator=generator).tolist()
        hand_off(prefill, decode, f"warm-{warm}", prompt, warm == 0, 1000 + warm)
    draft_block_bytes = decode.draft.block_bytes
    transfer_bytes_per_s = decode.runner.block_bytes / DEFAULT_PULL_S_PER_BLOCK
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()}); "
          f"model and draft: {os.path.basename(model)}; draft block {draft_block_bytes / 1024:.0f} KiB; "
          f"transfer {transfer_bytes_per_s / 2**20:.0f} MiB/s (the router's default gloo rate)")
    print("| prompt | prefill ms (model / + draft) | draft on prefill ms/token | decode catch-up ms (measured) | "
          "per token | policy's charge/token | draft blocks ms | auto chooses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for index, length in enumerate(int(n) for n in args.lengths.split(",")):
        prompt = torch.randint(10, vocab, (length,), generator=generator).tolist()
        alone_s, caught_up_s = hand_off(prefill, decode, f"local-{length}", prompt, False, 2 * index)
        prompt = torch.randint(10, vocab, (length,), generator=generator).tolist()
        tokens_before, seconds_before = prefill.draft.prompt_tokens, prefill.draft.prompt_seconds
        with_draft_s, first_s = hand_off(prefill, decode, f"sent-{length}", prompt, True, 2 * index + 1)
        per_token = (prefill.draft.prompt_seconds - seconds_before) / (prefill.draft.prompt_tokens - tokens_before)
        blocks = -(-length // BLOCK)
        charge = decode.draft_catch_up_s_per_token()
        costs = DraftPromptCosts(charge, per_token, draft_block_bytes, transfer_bytes_per_s)
        choice = "prefill" if build_on_prefill("auto", length, blocks, costs) else "decode"
        print(f"| {length} | {alone_s * 1e3:.1f} / {with_draft_s * 1e3:.1f} | {per_token * 1e3:.3f} | "
              f"{caught_up_s * 1e3:.1f} (sent: {first_s * 1e3:.1f}) | {caught_up_s / length * 1e3:.3f} | "
              f"{charge * 1e3 if charge is not None else float('nan'):.3f} | "
              f"{blocks * draft_block_bytes / transfer_bytes_per_s * 1e3:.1f} | {choice} |")


if __name__ == "__main__":
    main()

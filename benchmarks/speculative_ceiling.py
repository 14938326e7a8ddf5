"""What n-gram speculation can buy at batch 1 on workload (a) of ``speculative.py``, by replay:
the greedy outputs without speculation, replayed through the n-gram lookup with a step cost per
width measured on this machine in the same run.

1. ``off`` decodes each (a) prompt (``speculative.copy_prompts``) alone, greedy: the tokens to replay.
2. A step's seconds by width (1 + guesses): one request on the longest prompt whose proposer
   guesses a token never kept, widths cycled step by step (1, 2, ..., 1 + max), so the machine's
   load weighs on all of them alike; the median of each width, over the 1-row step's.
3. Replay, each request from its first token: every step the lookup proposes (``NgramIndex``, as
   the engine does), the step checks some of the proposal and emits the kept guesses and one
   token more, and costs its width's measured ratio. Three ways to choose how many guesses:
   ``fixed K`` (the proposal up to K), ``policy`` (the engine's ``plan_guesses`` with its odds
   updated as the engine does, on the measured widths) and ``oracle`` (up to K, knowing how
   many will be kept: no guess that fails is ever checked, the bound of any policy on this lookup).

Reported per K: tokens per step and tokens per step-cost (the tokens/s ratio over ``off`` that
step costs alone allow: per-step Python, sampling of the extra rows and the first token are
left out, so a measured run lands below it).

    .venv/bin/python benchmarks/speculative_ceiling.py                  # up to 8 guesses, 128 tokens
    .venv/bin/python benchmarks/speculative_ceiling.py --max-guesses 4 --max-tokens 32   # quick
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass

from common import machine_rows, median, print_table, use_all_cores
from speculative import chat_token_ids, copy_prompts

NEVER_KEPT = 13  # a guess the greedy model does not follow with: every checked guess is refused
BLOCK_SIZE = 16


class RefusedGuesses:
    """A proposer (``speculative/proposer.py``'s interface) guessing ``widths`` - 1 tokens per
    step, widths taken in turn, every guess a token that is not kept: steps of each width."""

    writes_kv = False

    def __init__(self, widths: range):
        self._widths = itertools.cycle(widths)

    def available(self, requests, rooms):
        width = next(self._widths)
        return [min(width - 1, room) for room in rooms]

    def first_odds(self, requests):
        return [1.0] * len(requests)

    def observe(self, request, proposed, accepted):
        pass

    def catch_up(self, requests):
        return [0] * len(requests)

    def propose(self, step, requests, counts):
        return [[NEVER_KEPT] * n for n in counts]

    def round_cost(self, target):
        return None


def make_llm(model, threads: int, longest: int, max_tokens: int, guesses: int, speculative):
    from cluster.offline.llm import LLM

    length = longest + max_tokens + guesses + BLOCK_SIZE
    return LLM(str(model), verbose=False, device="cpu", num_threads=threads, block_size=BLOCK_SIZE, max_num_seqs=1,
               max_model_len=length, num_kv_blocks=3 * (-(-length // BLOCK_SIZE)), speculative=speculative)


def greedy_outputs(model, threads: int, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from cluster.offline.llm import greedy

    with make_llm(model, threads, max(map(len, prompts)), max_tokens, 0, None) as llm:
        return [list(llm.generate([p], greedy(max_tokens))[0].token_ids) for p in prompts]


def width_costs(model, threads: int, prompt: list[int], guesses: int, steps: int) -> list[float]:
    """Median seconds of a step of 1 .. 1 + ``guesses`` rows over the 1-row step's."""
    from cluster.engine.speculative.config import SpeculativeConfig
    from cluster.offline.llm import greedy

    spec = SpeculativeConfig(num_tokens=guesses, adaptive=False)
    with make_llm(model, threads, len(prompt), steps, guesses, spec) as llm:
        engine = llm.engine
        engine.proposer = RefusedGuesses(range(1, guesses + 2))
        llm.generate([prompt], greedy(2))
        before = engine.stats.num_steps
        llm.generate([prompt], greedy(steps))
        by_width: dict[int, list[float]] = {}
        for record in list(engine.stats.steps)[-(engine.stats.num_steps - before):]:
            if record.num_prefill_tokens == 0:  # decode or verify rows only (the prompt's step has prefill tokens)
                by_width.setdefault(record.num_decode_tokens + record.guess_tokens, []).append(record.seconds)
    base = median(by_width[1])
    return [median(by_width[w]) / base for w in range(1, guesses + 2)]


@dataclass
class Replay:
    tokens: int = 0
    steps: int = 0
    cost: float = 0.0

    def step(self, emitted: int, width: int, ratios: list[float]) -> None:
        self.tokens += emitted
        self.steps += 1
        self.cost += ratios[width - 1]


def kept(proposal: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


def replay(prompts, outputs, ratios: list[float], limit: int, choose: str) -> Replay:
    """``choose``: fixed, policy or oracle (see the module's docstring); guesses up to ``limit``."""
    from cluster.engine.speculative.config import SpeculativeConfig
    from cluster.engine.speculative.ngram import NgramIndex
    from cluster.engine.speculative.policy import (ACCEPTANCE_PRIOR, CONTINUATION_PRIOR, StepCost, plan_guesses,
                                                   update_continuation)
    from cluster.engine.speculative.proposer import MATCH_WEIGHT

    defaults = SpeculativeConfig()
    cost = StepCost(ratios[0], ratios[1] - ratios[0], {w: r for w, r in enumerate(ratios, start=1)})
    first_by_match = {n: ACCEPTANCE_PRIOR for n in range(defaults.ngram_min, defaults.ngram_max + 1)}
    result = Replay()
    for prompt, output in zip(prompts, outputs):
        tokens, made = list(prompt) + output[:1], 1
        index, continuation = NgramIndex(defaults.ngram_min, defaults.ngram_max), CONTINUATION_PRIOR
        while made < len(output):
            room = min(limit, len(output) - made - 1)
            proposal = index.propose(tokens, room) if room > 0 else []
            truth = output[made:]
            if not proposal:
                count = 0
            elif choose == "fixed":
                count = len(proposal)
            elif choose == "oracle":
                count = kept(proposal, truth)
            else:
                odds = first_by_match.get(index.matched, 0.0)
                count = plan_guesses([odds], [continuation], [len(proposal)], 1, cost)[0]
            accepted = kept(proposal[:count], truth)
            if count and choose == "policy":
                continuation = update_continuation(continuation, count, accepted)
                first_by_match[index.matched] += MATCH_WEIGHT * ((1.0 if accepted else 0.0) - first_by_match[index.matched])
            emitted = min(accepted + 1, len(truth))
            tokens.extend(truth[:emitted])
            made += emitted
            result.step(emitted, 1 + count, ratios)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens out of every request, at most")
    parser.add_argument("--max-guesses", type=int, default=8, help="the most guesses a step checks (K)")
    parser.add_argument("--width-steps", type=int, default=400, help="steps timed for the widths, all widths in turn")
    args = parser.parse_args()
    for flag, value, low in (("--max-tokens", args.max_tokens, 2), ("--max-guesses", args.max_guesses, 1),
                             ("--width-steps", args.width_steps, 4 * (args.max_guesses + 1))):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    from cluster.default_model import default_model_path

    threads = use_all_cores()
    model = default_model_path()
    prompts = chat_token_ids(model, [prompt for _, prompt in copy_prompts()])
    outputs = greedy_outputs(model, threads, prompts, args.max_tokens)
    ratios = width_costs(model, threads, max(prompts, key=len), args.max_guesses, args.width_steps)

    print_table("machine", machine_rows())
    print_table("a step's seconds by rows, over one row's (medians, widths taken in turn)",
                [(w, f"{r:.2f}") for w, r in enumerate(ratios, start=1)], ("rows", "seconds vs 1 row"))
    rows = []
    for limit in range(1, args.max_guesses + 1):
        row = [limit]
        for choose in ("fixed", "policy", "oracle"):
            run = replay(prompts, outputs, ratios, limit, choose)
            row += [f"{run.tokens / run.steps:.2f}", f"{run.tokens / run.cost:.2f}x"]
        rows.append(tuple(row))
    print_table(f"replay of ({len(prompts)} requests, {sum(map(len, outputs))} tokens): tokens per step and per "
                "step cost (the tokens/s over off that step costs allow)", rows,
                ("K", "fixed tok/step", "fixed", "policy tok/step", "policy", "oracle tok/step", "oracle"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

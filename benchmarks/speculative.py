"""Speculative decoding (n-gram prompt lookup, and a draft model where one is given) against plain decoding, side by side in one run,
on in-process engines (``tandem.LLM``) of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

Three engines per device (four with a draft), alive together, get the same requests, stepped in
turn (below), so that a change in the machine's load weighs on all of them:

- ``off``: ``speculative=None``, one token per decode step;
- ``ngram``: ``SpeculativeConfig(num_tokens=--num-tokens)``, the adaptive policy sizing each request's guesses
  from the engine's fitted step cost and the request's acceptance (none where they would not pay);
- ``ngram-fixed``: the same with ``adaptive=False``: every proposal checked in full, to show what
  the policy buys.

- ``draft`` (with ``--draft-model PATH``): ``SpeculativeConfig(method="draft", draft_model=PATH,
  num_tokens=--num-tokens)``, adaptive: a smaller checkpoint with the model's tokenizer makes the guesses.

On the CPU every engine takes torch threads for every usable core.

Two workloads, every prompt rendered with the model's chat template, several distinct prompts
each (cycled to fill a batch):

- (a) output that repeats its prompt: a Python module of this repository (60-80 lines) to be
  rewritten with one identifier renamed, alternating with a text of the standard library
  (``heapq.__about__``, sections of the Python reference from ``pydoc_data``) to be summarised
  with quotes or restated sentence by sentence;
- (b) free chat: open questions with nothing to copy.

Greedy, ``--max-tokens`` out (EOS may end a request sooner: the tokens counted are those made).
Per engine and workload, one warm-up generate of every distinct prompt computes their KV, which
the prefix cache then serves: a measured generate is decoding, which speculation changes, and not
the prompts' prefill, which it does not.

Noise (the machine is shared, and its load moves within seconds: on 2 cores a one-row step took
6.6 ms quiet and 45 ms while other processes ran): the engines run together, stepped in turn, each
step given to the engine whose steps have emitted the fewest tokens so far, so that every
configuration goes through the same requests at the same pace and its steps are spread over the
same seconds as the others'; a configuration's time is the sum of its own steps' (the time between
steps is the benchmark's). They are measured in rounds and compared round by round. At batch 1 a
round is ``--single-requests`` requests, one at a time on each engine (``--repeats`` rounds); at a
batch above 1 a round is one batch of that many requests on each engine (``--rounds`` rounds). Each
engine takes the ties first in turn. A round's ratio is a configuration's tokens/s over ``off``'s in
that round (the same requests, the same tokens); the verdicts use the median of the rounds' ratios,
and the table shows their range beside the ratio of the totals, so that a ratio within the rounds'
scatter reads as such.

Reported per workload, batch and configuration: tokens/s (tokens over the seconds of the engine's
steps) and its ratio to ``off`` (of the totals; the rounds' median and range); TPOT p50 (per
request, its engine's step seconds after its first token over its tokens after the first) and its
ratio; the share of guesses kept, tokens per verify (1 + kept guesses per request-step that checked
guesses), decode tokens per request-step and the share of request-steps that guessed
(``llm.engine.stats``, differences over the steps); and the requests whose greedy tokens differ
from ``off``'s (must be 0). Goals (issue 24), for ``ngram``: >= 2x ``off``'s tokens/s at batch 1 on
(a), >= 1.0x at every batch on both workloads (medians of the rounds). A CUDA device, when there
is one, runs the same at ``--gpu-batch`` (default 1, 8, 64).

    .venv/bin/python benchmarks/speculative.py                                  # batches 1, 8, 32; 128 tokens
    .venv/bin/python benchmarks/speculative.py --batch 1,8 --max-tokens 48         # about a minute on 2 cores
    .venv/bin/python benchmarks/speculative.py --workloads a --batch 1 --single-requests 2 --repeats 1 --max-tokens 16  # smoke
"""

from __future__ import annotations

import argparse
import ast
import gc
import heapq
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO_ROOT, machine_rows, median, positive_ints, print_table, use_all_cores

# (a): modules of this repository (60-80 lines each) and prose of the standard library.
CODE_FILES = (
    "cluster/kv_transfer/torch_transport.py",
    "cluster/parallel/group.py",
    "cluster/registry/load.py",
    "cluster/engine/models/source.py",
)
REFERENCE_TOPICS = ("for", "exceptions", "booleans")  # sections of the Python reference (pydoc_data)
HEAPQ_ABOUT_CHARS = 1800  # the first paragraphs of heapq.__about__, up to about this many characters
TEXT_TASKS = (  # (name, instruction), taken in turn
    ("summarise", "Summarise the following text, quoting its key sentences word for word."),
    ("restate", "Restate the following text as a bulleted list, one bullet per sentence, keeping each sentence's "
                "wording."),
)
# (b): open questions, nothing in the prompt to copy.
CHAT_QUESTIONS = (
    "Why do cats purr? Explain in a few paragraphs.",
    "What makes a good teacher?",
    "How do airplanes stay in the air?",
    "Give me some advice for sleeping better.",
    "Why is the sky blue?",
    "What are the benefits of learning a second language?",
    "Describe a walk through a forest in autumn.",
    "How does a refrigerator keep food cold?",
)
COPY, CHAT = "a: edit/summarise", "b: chat"
OFF, NGRAM, NGRAM_FIXED, DRAFT = "off", "ngram", "ngram-fixed", "draft"
CONFIGS = (OFF, NGRAM, NGRAM_FIXED)  # and DRAFT with --draft-model
GOAL_BATCH_ONE = 2.0  # ngram's tokens/s over off's at batch 1 on (a)
GOAL_EVERY_BATCH = 1.0  # ... at every batch on both workloads
WARM_UP_TOKENS = 4  # the warm-up generate: prefill and a few decode steps (and verifies)
MAX_TOKENS_LIMIT = 4096


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- the workloads ------------------------------------------------------------------------------

def code_edit_prompt(path: str) -> str:
    """The module at ``path`` with its first top-level function (else class) to be renamed."""
    file = REPO_ROOT / path
    if not file.is_file():
        raise SystemExit(f"speculative.py: the workload's module {path} is missing; update CODE_FILES")
    source = file.read_text()
    tree = ast.parse(source).body
    names = [n.name for n in tree if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] or \
        [n.name for n in tree if isinstance(n, ast.ClassDef)]
    if not names:
        raise SystemExit(f"speculative.py: {path} defines no top-level function or class to rename; update CODE_FILES")
    return (f"Here is the Python module `{path}`:\n\n```python\n{source}```\n\nRewrite the whole module with "
            f"`{names[0]}` renamed to `{names[0]}_renamed` everywhere. Reply with the complete code only.")


def reference_texts() -> list[tuple[str, str]]:
    """(where from, text): the first paragraphs of ``heapq.__about__``, sections of the Python reference."""
    from pydoc_data.topics import topics

    about = ""
    for paragraph in heapq.__about__.split("\n\n"):
        if about and len(about) + len(paragraph) > HEAPQ_ABOUT_CHARS:
            break
        about += paragraph + "\n\n"
    return [("heapq.__about__", about)] + [(f"Python reference: {name!r}", topics[name]) for name in REFERENCE_TOPICS]


def copy_prompts() -> list[tuple[str, str]]:
    """(what, prompt): code edits alternating with texts to summarise or restate, so that any
    few prompts hold both."""
    edits = [(f"edit {path}", code_edit_prompt(path)) for path in CODE_FILES]
    texts = []
    for i, (source, text) in enumerate(reference_texts()):
        task, instruction = TEXT_TASKS[i % len(TEXT_TASKS)]
        texts.append((f"{task} {source}", f'{instruction}\n\n"""\n{text.strip()}\n"""'))
    return [prompt for pair in zip(edits, texts) for prompt in pair]


def chat_token_ids(model: Path, contents: list[str]) -> list[list[int]]:
    """Each message as a one-turn chat, rendered with the model's template and tokenized."""
    from cluster.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
            for c in contents]


def batch_of(prompts: list[list[int]], size: int, start: int = 0) -> list[list[int]]:
    return [prompts[(start + i) % len(prompts)] for i in range(size)]


# -- the engines --------------------------------------------------------------------------------

def speculative_config(name: str, num_tokens: int | None, draft_model: str | None = None):
    from cluster.engine.speculative.config import SpeculativeConfig

    if name == DRAFT:
        return SpeculativeConfig(method="draft", draft_model=draft_model, num_tokens=num_tokens)
    return {OFF: None, NGRAM: SpeculativeConfig(num_tokens=num_tokens),
            NGRAM_FIXED: SpeculativeConfig(num_tokens=num_tokens, adaptive=False)}[name]


def kv_blocks(workloads: dict[str, list[list[int]]], batch: int, max_tokens: int, num_tokens: int,
              block_size: int) -> int:
    """Room for the largest batch of the longest requests (no sharing counted) and for every
    distinct prompt to stay in the prefix cache between generates."""
    prompts = [p for ps in workloads.values() for p in ps]
    per_request = -(-(max(map(len, prompts)) + max_tokens + num_tokens + 1) // block_size)
    return batch * per_request + sum(-(-len(p) // block_size) for p in prompts)


def make_engines(model: Path, device: str, threads: int, workloads: dict[str, list[list[int]]], batch: int,
                 max_tokens: int, num_tokens: int | None, configs: tuple[str, ...], draft_model: str | None,
                 cpu_matmul_dtype: str = "auto") -> dict:
    """``num_tokens``: each speculating engine's (None: its method's default)."""
    from cluster.offline.llm import LLM

    block_size = 16
    longest = max(len(p) for ps in workloads.values() for p in ps)
    specs = {name: speculative_config(name, num_tokens, draft_model) for name in configs}
    guesses = max([spec.num_tokens for spec in specs.values() if spec is not None], default=0)
    engines = {}
    for name in configs:
        log(f"{device}: loading the {name} engine")
        engines[name] = LLM(str(model), verbose=False, device=device, num_threads=threads, block_size=block_size,
                            max_num_seqs=batch, max_model_len=longest + max_tokens + guesses + block_size,
                            num_kv_blocks=kv_blocks(workloads, batch, max_tokens, guesses, block_size),
                            speculative=specs[name],
                            cpu_matmul_dtype=cpu_matmul_dtype if device == "cpu" else "float32")
    return engines


# -- measuring ----------------------------------------------------------------------------------

@dataclass
class Cell:
    """One configuration's requests at one workload and batch, summed over its generates."""
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    tpots: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    request_steps: int = 0  # decode rows of requests (plain or verifying) over the generates' steps
    round_tokens: list[int] = field(default_factory=list)  # per round (see the module's docstring) ...
    round_seconds: list[float] = field(default_factory=list)  # ... its generates' tokens and seconds

    def start_round(self) -> None:
        self.round_tokens.append(0)
        self.round_seconds.append(0.0)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    def round_rate(self, index: int) -> float:
        seconds = self.round_seconds[index]
        return self.round_tokens[index] / seconds if seconds else float("nan")

    @property
    def tpot(self) -> float:
        return median(self.tpots)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_verify(self) -> float:
        return 1 + self.accepted / self.verifies if self.verifies else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """Tokens after each request's first over the request-steps that decoded them."""
        return (self.tokens - self.requests) / self.request_steps if self.request_steps else float("nan")

    @property
    def guessed_share(self) -> float:
        return self.verifies / self.request_steps if self.request_steps else float("nan")


@dataclass
class Turn:
    """One configuration's part of a round (:func:`run_round`): its engine, the generates it has
    left, and its own clock, the seconds of its own steps this round."""
    cell: Cell
    engine: object
    generates: list[list[list[int]]]
    tag: str
    clock: float = 0.0
    made: int = 0  # tokens its steps emitted this round
    live: dict = field(default_factory=dict)  # request id -> its place in the generate, until it finishes
    outputs: list = field(default_factory=list)  # the current generate's finished outputs, in its order
    first_token_at: dict = field(default_factory=dict)  # request id -> the clock after its first token

    @property
    def busy(self) -> bool:
        return bool(self.live) or bool(self.generates)

    def step(self, max_tokens: int) -> None:
        """Starts the next generate if the last one ended, then one engine step, timed alone."""
        from cluster.offline.llm import greedy

        if not self.live:
            prompts = self.generates.pop(0)
            self.outputs = [None] * len(prompts)
            for index, prompt in enumerate(prompts):
                request_id = f"{self.tag}-{self.cell.requests + index}"
                self.engine.add_request(request_id, prompt, greedy(max_tokens))
                self.live[request_id] = index
        stats = self.engine.stats
        before = (stats.num_steps, stats.proposed_tokens, stats.accepted_tokens, stats.verify_steps)
        started = time.perf_counter()
        outputs = self.engine.step()
        self.clock += time.perf_counter() - started
        cell = self.cell
        if stats.num_steps > before[0]:
            cell.request_steps += stats.steps[-1].num_decode_tokens
        cell.proposed += stats.proposed_tokens - before[1]
        cell.accepted += stats.accepted_tokens - before[2]
        cell.verifies += stats.verify_steps - before[3]
        for output in outputs:
            self.made += len(output.new_token_ids)
            if output.new_token_ids:
                self.first_token_at.setdefault(output.request_id, self.clock)
            if output.finished:
                if output.error:
                    raise RuntimeError(f"a request failed: {output.error}")
                self._finished(output)
        if not self.live:
            for output in self.outputs:
                cell.outputs.append(list(output.token_ids))

    def _finished(self, output) -> None:
        cell, made = self.cell, len(output.token_ids)
        self.outputs[self.live.pop(output.request_id)] = output
        first = self.first_token_at.pop(output.request_id, None)
        cell.requests += 1
        cell.tokens += made
        cell.round_tokens[-1] += made
        if made > 1 and first is not None:
            cell.tpots.append((self.clock - first) / (made - 1))


def run_round(turns: list[Turn], max_tokens: int) -> None:
    """Steps the configurations' engines in turn, always the one whose steps have emitted the
    fewest tokens this round (ties: in ``turns``' order): each goes through its generates at the
    pace of the others, so that every configuration's steps are spread over the same seconds and
    meet the same load (a loaded 2-core machine slowed one-row steps 7-fold, and within seconds).
    A configuration's seconds are its own steps', its TPOT taken on that clock."""
    for turn in turns:
        turn.cell.start_round()
    while True:
        busy = [turn for turn in turns if turn.busy]
        if not busy:
            break
        min(busy, key=lambda turn: turn.made).step(max_tokens)
    for turn in turns:
        turn.cell.seconds += turn.clock
        turn.cell.round_seconds[-1] += turn.clock


@dataclass
class Result:
    device: str
    workload: str
    batch: int
    cells: dict[str, Cell]

    def ratio(self, config: str) -> float:
        """Of the totals."""
        return self.cells[config].rate / self.cells[OFF].rate

    def round_ratios(self, config: str) -> list[float]:
        cell, off = self.cells[config], self.cells[OFF]
        return [cell.round_rate(i) / off.round_rate(i) for i in range(len(off.round_tokens))]

    def median_ratio(self, config: str) -> float:
        return median(self.round_ratios(config))

    def spread(self, config: str) -> str:
        ratios = self.round_ratios(config)
        return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"

    def mismatches(self, config: str) -> int:
        return sum(a != b for a, b in zip(self.cells[config].outputs, self.cells[OFF].outputs))


def rotated(names: tuple[str, ...], index: int) -> tuple[str, ...]:
    """The configurations in the order round ``index`` breaks its ties in (:func:`run_round`):
    each goes first in turn, so that none always steps right after the same other one."""
    shift = index % len(names)
    return names[shift:] + names[:shift]


def measured_rounds(prompts: list[list[int]], batch: int, args) -> list[list[list[list[int]]]]:
    """Per round, its generates (each a list of prompts): at batch 1 ``--single-requests`` requests
    one at a time (``--repeats`` rounds, each starting where the last ended), above it one generate
    of ``batch`` requests (``--rounds`` rounds)."""
    if batch == 1:
        per_round = args.single_requests
        return [[[p] for p in batch_of(prompts, per_round, start=i * per_round)] for i in range(args.repeats)]
    return [[batch_of(prompts, batch, start=i * batch)] for i in range(args.rounds)]


def measure_device(model: Path, device: str, threads: int, workloads: dict[str, list[list[int]]],
                   batches: list[int], args) -> list[Result]:
    """Every workload and batch on the three engines of ``device``; the engines go at the end."""
    from cluster.offline.llm import greedy

    configs = args.configs
    engines = make_engines(model, device, threads, workloads, max(batches), args.max_tokens, args.num_tokens, configs,
                           args.draft_model, args.cpu_matmul_dtype)
    results = []
    try:
        for workload, prompts in workloads.items():
            for name, llm in engines.items():
                log(f"{device}, {workload}: warm-up generate of {len(prompts)} prompts on {name}")
                llm.generate(prompts, greedy(WARM_UP_TOKENS))
            for batch in batches:
                cells = {name: Cell() for name in configs}
                for index, generates in enumerate(measured_rounds(prompts, batch, args)):
                    run_round([Turn(cells[name], engines[name].engine, list(generates), f"{name}-{batch}-{index}")
                               for name in rotated(configs, index)], args.max_tokens)
                    log(f"{device}, {workload}, batch {batch}: round {index + 1} done: " + ", ".join(
                        f"{name} {cells[name].round_rate(index) / cells[OFF].round_rate(index):.2f}x"
                        for name in configs if name != OFF))
                result = Result(device, workload, batch, cells)
                log(f"{device}, {workload}, batch {batch}: " + ", ".join(
                    f"{name} {cell.rate:.1f} tok/s" for name, cell in cells.items())
                    + "; median of rounds: " + ", ".join(f"{name} {result.median_ratio(name):.2f}x"
                                                         for name in configs if name != OFF))
                results.append(result)
    finally:
        for llm in engines.values():
            llm.shutdown()
        engines.clear()
        gc.collect()
    return results


# -- the report ---------------------------------------------------------------------------------

def fmt(value: float, spec: str, suffix: str = "") -> str:
    return "-" if value != value else f"{value:{spec}}{suffix}"  # NaN (nothing to show): a dash


def result_rows(results: list[Result]) -> list[tuple]:
    rows = []
    for result in results:
        off = result.cells[OFF]
        for name, cell in result.cells.items():
            spec = name != OFF
            rows.append((result.workload, result.batch, name, cell.requests, cell.tokens, f"{cell.seconds:.2f}",
                         f"{cell.rate:.1f}", f"{cell.rate / off.rate:.2f}x",
                         f"{result.median_ratio(name):.2f}x" if spec else "-", result.spread(name) if spec else "-",
                         fmt(cell.tpot * 1e3, ".2f"),
                         fmt(cell.tpot / off.tpot, ".2f", "x"),
                         fmt(cell.acceptance * 100, ".0f", "%") if spec else "-",
                         fmt(cell.tokens_per_verify, ".2f") if spec else "-",
                         fmt(cell.tokens_per_step, ".2f"),
                         fmt(cell.guessed_share * 100, ".0f", "%") if spec else "-",
                         result.mismatches(name) if spec else "-"))
    return rows


def verdict(result: Result, config: str, goal: float) -> str:
    """On the median of the rounds' ratios, with their range and how many rounds met the goal.
    The median is cut (not rounded) to three places: rounded, 1.9995x read as 2.00x beside 'NOT met'."""
    ratios, ratio = result.round_ratios(config), result.median_ratio(config)
    shown = math.floor(ratio * 1000) / 1000 if math.isfinite(ratio) else ratio
    return (f"{shown:.3f}x median of {len(ratios)} rounds ({result.spread(config)}, {sum(r >= goal for r in ratios)} "
            f"at or above; totals {result.ratio(config):.2f}x) (goal >= {goal:.1f}x): "
            + ("met" if ratio >= goal else "NOT met"))


def goal_lines(device: str, results: list[Result]) -> list[str]:
    """The goals for ``ngram``, and for reference ``ngram-fixed``'s worst ratio and the greedy check."""
    lines = []
    at_one = [r for r in results if r.workload == COPY and r.batch == 1]
    if at_one:
        lines.append(f"{device}: ngram / off tokens/s at batch 1 on ({COPY}): "
                     + verdict(at_one[0], NGRAM, GOAL_BATCH_ONE))
    else:
        lines.append(f"{device}: ngram / off tokens/s at batch 1 on ({COPY}): not measured (batch 1 was not run)")
    speculating = [name for name in results[0].cells if name != OFF]
    for name in speculating:
        worst = min(results, key=lambda r: r.median_ratio(name))
        where = f"({worst.workload}, batch {worst.batch})"
        lines.append(f"{device}: {name} / off tokens/s, worst of every batch and workload {where}: "
                     + (verdict(worst, name, GOAL_EVERY_BATCH) if name in (NGRAM, DRAFT)
                        else f"{worst.median_ratio(name):.2f}x median of rounds (no adaptive policy; not a goal, "
                             "for reference)"))
    differ = sum(r.mismatches(name) for r in results for name in speculating)
    compared = sum(r.cells[name].requests for r in results for name in speculating)
    lines.append(f"{device}: greedy tokens with speculation that differ from off's: {differ} of {compared} requests"
                 + (" (must be 0)" if differ else ""))
    return lines


def report(results: list[Result], device: str, args) -> None:
    print_table(f"{device}: side by side (greedy, up to {args.max_tokens} tokens per request; batch 1: "
                f"{args.repeats} rounds of {args.single_requests} requests one at a time, above: {args.rounds} rounds "
                "of one generate; ratios over off: of the totals, the rounds' median and range)",
                result_rows(results),
                ("workload", "batch", "config", "requests", "tokens", "seconds", "tok/s", "vs off", "median",
                 "rounds",
                 "TPOT p50 ms", "TPOT vs off", "accepted", "tok/verify", "tok/step", "guessed steps", "differ"))
    print("\n" + "\n".join(goal_lines(device, results)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=positive_ints, default=[1, 8, 32],
                        help="CPU batch sizes, comma-separated (default 1,8,32)")
    parser.add_argument("--gpu-batch", type=positive_ints, default=[1, 8, 64],
                        help="GPU batch sizes when CUDA is available (default 1,8,64)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens out of every request, at most")
    parser.add_argument("--num-tokens", type=int, default=None,
                        help="speculative num_tokens: most guesses per step (default: the method's, 8 for ngram)")
    parser.add_argument("--single-requests", type=int, default=8,
                        help="requests of a round at batch 1, one at a time (default 8: every distinct prompt once)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds at batch 1 (default 3)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds (generates of the batch, every configuration in turn) above batch 1 (default 5)")
    parser.add_argument("--configs", default=",".join(CONFIGS[1:]),
                        help=f"configurations to run besides off, comma-separated (default {','.join(CONFIGS[1:])})")
    parser.add_argument("--draft-model", metavar="PATH",
                        help="a draft checkpoint with the model's tokenizer: adds the draft column")
    parser.add_argument("--cpu-matmul-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the CPU engines' cpu_matmul_dtype (default auto)")
    parser.add_argument("--workloads", choices=["both", "a", "b"], default="both",
                        help="a: edit/summarise (output repeats the prompt), b: free chat")
    args = parser.parse_args()
    if not 2 <= args.max_tokens <= MAX_TOKENS_LIMIT:
        parser.error(f"--max-tokens must be in [2, {MAX_TOKENS_LIMIT}], got {args.max_tokens}")
    for flag, value in (("--single-requests", args.single_requests), ("--repeats", args.repeats),
                        ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    from cluster.engine.speculative.config import SpeculativeConfigError

    try:
        speculative_config(NGRAM, args.num_tokens)
    except SpeculativeConfigError as exc:
        parser.error(f"--num-tokens: {exc}")
    chosen_configs = [c.strip() for c in args.configs.split(",") if c.strip() and c.strip() != OFF]
    unknown = [c for c in chosen_configs if c not in CONFIGS]
    if unknown or not chosen_configs:
        parser.error(f"--configs takes {', '.join(CONFIGS[1:])} (off always runs), got {args.configs!r}")
    args.configs = (OFF, *chosen_configs) + ((DRAFT,) if args.draft_model else ())

    import torch
    from cluster.default_model import default_model_path
    from cluster.engine.speculative.config import DEFAULT_NUM_TOKENS

    defaults = ", ".join(f"{method} {count}" for method, count in DEFAULT_NUM_TOKENS.items())

    threads = use_all_cores()
    model = default_model_path()
    chosen = {"both": (COPY, CHAT), "a": (COPY,), "b": (CHAT,)}[args.workloads]
    sources, contents = {}, {}
    if COPY in chosen:
        sources[COPY], contents[COPY] = zip(*copy_prompts())
    if CHAT in chosen:
        sources[CHAT], contents[CHAT] = CHAT_QUESTIONS, CHAT_QUESTIONS
    workloads = {name: chat_token_ids(model, list(contents[name])) for name in chosen}

    runs = {"cpu": args.batch}
    gpu_note = None
    if torch.cuda.is_available():
        runs["cuda"] = args.gpu_batch
    else:
        gpu_note = "GPU: skipped (no CUDA device here: torch.cuda.is_available() is False)"
    results = {device: measure_device(model, device, threads, workloads, batches, args)
               for device, batches in runs.items()}

    print_table("machine", machine_rows() + [
        ("model file", f"{model} ({model.stat().st_size / 2**20:.0f} MiB)"),
        ("engines", f"{', '.join(args.configs)} (speculative num_tokens {args.num_tokens or 'by method: ' + defaults}), "
                    f"{threads} torch threads each, cpu_matmul_dtype {args.cpu_matmul_dtype}"),
    ] + ([("draft model", args.draft_model)] if args.draft_model else []))
    print_table("prompts (distinct; cycled to fill a batch)",
                [(name, source, len(ids)) for name in workloads for source, ids in zip(sources[name], workloads[name])],
                ("workload", "prompt", "tokens (chat template)"))
    for device in results:
        report(results[device], device, args)
    if gpu_note:
        print(f"\n{gpu_note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

import math

import pytest
import torch

from cluster.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from cluster.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

# Probabilities 0.5, 0.3, 0.15, 0.05 placed at shuffled ids, so that sorting matters.
_IDS_BY_RANK = [3, 0, 4, 1]  # id of the most likely token first; id 2 gets -inf
_PROBS_BY_RANK = [0.5, 0.3, 0.15, 0.05]


def _shuffled_logits() -> torch.Tensor:
    logits = torch.full((5,), float("-inf"))
    for token, p in zip(_IDS_BY_RANK, _PROBS_BY_RANK):
        logits[token] = math.log(p)
    return logits


def _batch(params, vocab, prompts=None, outputs=None, generators=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab,
    )


def _drawn_set(logits_row: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    """The ids drawn by `draws` rows of the same logits, each with its own seeded generator."""
    logits = logits_row.expand(draws, -1).clone()
    batch = _batch([params] * draws, logits.shape[1], generators=[make_generator(i) for i in range(draws)])
    return set(Sampler()(logits, batch).token_ids)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    out = Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * 6, 100))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_all_greedy_and_all_seeded_leave_the_global_rng_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    state = torch.get_rng_state()
    Sampler()(logits, _batch([SamplingParams(temperature=0.0)] * 4, 50))
    assert torch.equal(torch.get_rng_state(), state)
    Sampler()(logits, _batch([SamplingParams(temperature=1.0)] * 4, 50, generators=[make_generator(i) for i in range(4)]))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("temperature", [0.01, 0.5, 1.0, 5.0, 100.0])
def test_top_k_one_equals_greedy(temperature):
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    batch = _batch([SamplingParams(temperature=temperature, top_k=1)] * 8, 300)
    assert Sampler()(logits, batch).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_one_breaks_ties_like_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    batch = _batch([SamplingParams(top_k=1)], 5)
    assert Sampler()(logits, batch).token_ids == [1]


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(2)
    logits = torch.randn(6, 200)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 3
    out = Sampler()(logits, _batch(params, 200))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("params", "expected_ranks"),
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 < 0.7 <= 0.8
        (SamplingParams(top_p=0.85), {0, 1, 2}),  # 0.8 < 0.85 <= 0.95
        (SamplingParams(top_p=0.1), {0}),
        # After top-k the three survivors renormalise to 0.526, 0.316, 0.158: 0.842 >= 0.83.
        (SamplingParams(top_k=3, top_p=0.83), {0, 1}),
        # Temperature 2 flattens to 0.379, 0.294, 0.208, 0.120 before top-p: 0.673 < 0.7.
        (SamplingParams(temperature=2.0, top_p=0.7), {0, 1, 2}),
        (SamplingParams(min_p=0.25), {0, 1, 2}),  # floor 0.125
        (SamplingParams(min_p=0.5), {0, 1}),  # floor 0.25
        (SamplingParams(min_p=0.9), {0}),
        (SamplingParams(top_k=3, min_p=0.1), {0, 1, 2}),
    ],
)
def test_truncation_keeps_exactly_the_expected_tokens(params, expected_ranks):
    expected = {_IDS_BY_RANK[r] for r in expected_ranks}
    assert _drawn_set(_shuffled_logits(), params) == expected


def test_rows_with_different_truncation_in_one_batch():
    logits = _shuffled_logits().expand(4, -1).clone()
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.1), SamplingParams(min_p=0.25), SamplingParams()]
    seen = [set() for _ in params]
    for step in range(200):
        gens = [make_generator(1000 * step + i) for i in range(len(params))]
        for row, token in enumerate(Sampler()(logits, _batch(params, 5, generators=gens)).token_ids):
            seen[row].add(token)
    assert seen == [{3, 0}, {3}, {3, 0, 4}, {3, 0, 4, 1}]


def test_apply_top_k_top_p_masks_to_minus_inf():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    inf = float("-inf")
    assert torch.equal(out, torch.tensor([[inf, 4.0, 3.0, inf], [1.0, 4.0, 3.0, 2.0]]))


def test_build_penalty_tensors():
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=0.5)]
    batch = _batch(params, 6, prompts=[[0, 0, 5], [1]], outputs=[[2, 2, 3], []])
    assert torch.equal(batch.output_counts, torch.tensor([[0, 0, 2, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.int32))
    assert batch.prompt_mask.tolist() == [
        [True, False, True, True, False, True],
        [False, True, False, False, False, False],
    ]
    assert batch.presence_penalty is None
    assert batch.repetition_penalty.tolist() == [2.0, 1.0]
    assert batch.frequency_penalty.tolist() == [0.0, 0.5]


def test_build_without_penalties_or_truncation_builds_nothing():
    batch = _batch([SamplingParams(), SamplingParams(temperature=0.0)], 10, prompts=[[1, 2], [3]], outputs=[[4], [5]])
    assert batch.prompt_mask is None and batch.output_counts is None
    assert batch.repetition_penalty is None and batch.presence_penalty is None and batch.frequency_penalty is None
    assert batch.top_k is None and batch.top_p is None and batch.min_p is None
    assert batch.max_num_logprobs is None
    assert not batch.all_greedy and not batch.all_random


def test_penalties_follow_the_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]] * 4)
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    # Token 0 is only in the prompt; token 1 is in the output twice, token 2 once.
    batch = _batch(params, 5, prompts=[[0]] * 4, outputs=[[1, 1, 2]] * 4)
    before = logits.clone()
    out = apply_penalties(logits, batch)
    expected = torch.tensor(
        [
            [2.0 / 2, -1.0 * 2, 0.5 / 2, -0.5, 3.0],  # positive / p, non-positive * p
            [2.0, -1.0 - (0.5 * 2 + 0.25), 0.5 - (0.5 * 1 + 0.25), -0.5, 3.0],  # output tokens only
            [1.0, -2.0 - 1.25, 0.25 - 0.75, -0.5, 3.0],  # repetition first, then the others
            [2.0, -1.0, 0.5, -0.5, 3.0],
        ]
    )
    assert torch.equal(out, expected)
    assert torch.equal(logits, before)


def test_negative_presence_penalty_raises_the_logit():
    batch = _batch([SamplingParams(presence_penalty=-1.0)], 3, outputs=[[2]])
    assert apply_penalties(torch.zeros(1, 3), batch).tolist() == [[0.0, 0.0, 1.0]]


def test_greedy_uses_penalised_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    batch = _batch([SamplingParams(temperature=0.0, repetition_penalty=2.0)], 3, prompts=[[0]])
    assert Sampler()(logits, batch).token_ids == [1]  # 3/2 = 1.5 < 2


def _run_seeded(logit_steps, row, params, seed, others, vocab):
    """Tokens of a seeded request at `row` of a batch with `others` (params, seed or None) around it."""
    specs = list(others)
    specs.insert(row, (params, seed))
    gens = [make_generator(s) if s is not None else None for _, s in specs]
    tokens = []
    for step_logits in logit_steps:
        logits = step_logits[0].expand(len(specs), -1).clone()
        # Other rows see other logits, so the batch's content really differs.
        for i in range(len(specs)):
            if i != row:
                logits[i] = step_logits[1 + i % (len(step_logits) - 1)]
        batch = _batch([p for p, _ in specs], vocab, generators=gens)
        tokens.append(Sampler()(logits, batch).token_ids[row])
    return tokens


def test_same_seed_same_tokens_alone_or_in_any_batch():
    vocab = 1000
    torch.manual_seed(3)
    steps = [torch.randn(4, vocab) for _ in range(10)]
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=123)
    alone = _run_seeded(steps, 0, params, 123, [], vocab)
    others = [
        (SamplingParams(temperature=1.0, seed=7), 7),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=1.3), None),
        (SamplingParams(temperature=0.7, top_k=5, seed=9), 9),
        (SamplingParams(temperature=1.0, min_p=0.1), None),
        (SamplingParams(temperature=0.5, repetition_penalty=1.2), None),
        (SamplingParams(temperature=2.0, seed=11), 11),
    ]
    for row in (0, 3, 7):
        torch.manual_seed(100 + row)  # the global RNG state must not matter either
        assert _run_seeded(steps, row, params, 123, others, vocab) == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ():
    vocab = 1000
    torch.manual_seed(4)
    steps = [torch.randn(2, vocab) for _ in range(20)]
    params = SamplingParams(temperature=1.0)
    assert _run_seeded(steps, 0, params, 1, [], vocab) != _run_seeded(steps, 0, params, 2, [], vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_raw_and_top_n_is_sorted_per_row(dtype):
    torch.manual_seed(5)
    vocab = 64
    logits = (torch.randn(4, vocab) * 3).to(dtype)
    params = [
        SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5, top_k=10),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0, logprobs=None),
        SamplingParams(temperature=1.0, logprobs=20, frequency_penalty=1.0),
    ]
    batch = _batch(params, vocab, prompts=[[1, 2, 3]] * 4, outputs=[[4, 4]] * 4)
    out = Sampler()(logits, batch)
    expected = logits.float().log_softmax(dim=-1)
    assert batch.max_num_logprobs == 20
    assert out.logprobs == [expected[i, t].item() for i, t in enumerate(out.token_ids)]
    assert [len(top) for top in out.top_logprobs] == [3, 0, 0, 20]
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert [t for t, _ in top] == expected[i].topk(len(top)).indices.tolist()
        assert values == [expected[i, t].item() for t, _ in top]


def test_distribution_of_seeded_draws():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = 2000
    logits = probs.log().expand(draws, -1).clone()
    batch = _batch([SamplingParams(temperature=1.0)] * draws, 3, generators=[make_generator(i) for i in range(draws)])
    counts = torch.bincount(torch.tensor(Sampler()(logits, batch).token_ids), minlength=3)
    freq = counts.float() / draws
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_distribution_with_temperature_global_rng():
    torch.manual_seed(6)
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = 2000
    logits = probs.log().expand(draws, -1).clone()
    out = Sampler()(logits, _batch([SamplingParams(temperature=2.0)] * draws, 3))
    tempered = probs.sqrt() / probs.sqrt().sum()
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / draws
    assert torch.allclose(freq, tempered, atol=0.03), freq


def test_large_batch_runs():
    torch.manual_seed(7)
    rows, vocab = 64, 32000
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16)
    params = [
        SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_k=[0, 50][i % 2],
            top_p=[1.0, 0.9, 0.95][i % 3],
            min_p=[0.0, 0.05][i % 2],
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            logprobs=[None, 5][i % 2],
            seed=i if i % 3 == 0 else None,
        )
        for i in range(rows)
    ]
    prompts = torch.randint(0, vocab, (rows, 512)).tolist()
    outputs = torch.randint(0, vocab, (rows, 128)).tolist()
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, prompts, outputs, gens, vocab)
    out = Sampler()(logits, batch)
    assert len(out.token_ids) == rows
    assert all(0 <= t < vocab for t in out.token_ids)


def test_first_argmax_picks_what_torchs_argmax_picks_ties_nans_and_masked_rows_included():
    from cluster.engine.sampler import first_argmax

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [0.0, inf, inf, 1.0],
                         [1.0, 2.0, nan, 9.0]])
    assert first_argmax(rows).tolist() == rows.argmax(dim=-1).tolist() == [1, 0, 0, 1, 2]
    logits = torch.randn(9, 49152, generator=torch.Generator().manual_seed(5))
    logits[3, 17] = logits[3, 40000] = 1e4  # a tie: the first
    assert first_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert first_argmax(logits).dtype == torch.int64
    half = logits.to(torch.bfloat16)  # not float32: torch's own
    assert first_argmax(half).tolist() == half.argmax(dim=-1).tolist()

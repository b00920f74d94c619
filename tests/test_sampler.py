"""The batched sampler: filters, greedy limit, seeds, penalties and logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.penalties import TokenHistory, apply_penalties
from pyengine.executor.sampler import Sampler
from pyengine.executor.sampling_table import SamplingTable
from pyengine.sampling_params import SamplingParams

VOCAB = 64
DRAWS = 4000


def _sampler(params: list[SamplingParams], seed: int = 0) -> tuple[Sampler, np.ndarray]:
    table = SamplingTable(len(params), torch.device("cpu"))
    rows = np.arange(len(params))
    table.install(rows, params)
    return Sampler(table, torch.Generator().manual_seed(seed)), rows


def _draw(logits_row: torch.Tensor, params: SamplingParams, draws: int = DRAWS) -> torch.Tensor:
    sampler, rows = _sampler([params] * draws)
    logits = logits_row.expand(draws, -1).clone()
    return sampler.sample(logits, rows, torch.zeros(draws, dtype=torch.int64), None).token_ids


@pytest.fixture
def logits_row() -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(1)) * 2


def test_top_k_never_samples_outside_the_k_best(logits_row):
    tokens = _draw(logits_row, SamplingParams(temperature=1.5, top_k=5))
    allowed = set(logits_row.topk(5).indices.tolist())
    assert set(tokens.tolist()) == allowed  # all allowed ones appear, nothing else


def test_top_p_never_samples_outside_the_nucleus(logits_row):
    top_p = 0.6
    probs = logits_row.softmax(-1)
    order = probs.argsort(descending=True)
    cumulative = probs[order].cumsum(0)
    size = int((cumulative < top_p).sum()) + 1  # smallest prefix reaching top_p
    nucleus = set(order[:size].tolist())
    tokens = _draw(logits_row, SamplingParams(top_p=top_p))
    assert set(tokens.tolist()) == nucleus


def test_min_p_never_samples_unlikely_tokens(logits_row):
    probs = logits_row.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    tokens = _draw(logits_row, SamplingParams(min_p=0.2))
    assert set(tokens.tolist()) == allowed


def test_top_k_and_top_p_combine(logits_row):
    tokens = _draw(logits_row, SamplingParams(top_k=10, top_p=0.3, temperature=3.0))
    top10 = logits_row.topk(10)
    probs = (top10.values / 3.0).softmax(-1)
    size = int((probs.cumsum(0) < 0.3).sum()) + 1
    assert set(tokens.tolist()) <= set(top10.indices[:size].tolist())


def test_tiny_temperature_equals_greedy():
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    sampler, rows = _sampler([SamplingParams(temperature=1e-4)] * 32)
    sampled = sampler.sample(logits.clone(), rows, torch.zeros(32, dtype=torch.int64), None).token_ids
    greedy_sampler, _ = _sampler([SamplingParams(temperature=0.0)] * 32)
    greedy = greedy_sampler.sample(logits.clone(), rows, torch.zeros(32, dtype=torch.int64), None).token_ids
    assert torch.equal(sampled, logits.argmax(-1))
    assert torch.equal(greedy, logits.argmax(-1))


def test_sampling_follows_the_distribution(logits_row):
    tokens = _draw(logits_row / 4, SamplingParams(temperature=1.0), draws=20000)
    frequencies = torch.bincount(tokens, minlength=VOCAB).float() / 20000
    expected = (logits_row / 4).softmax(-1)
    assert (frequencies - expected).abs().max() < 0.02


def test_seeded_rows_do_not_depend_on_batch_composition(logits_row):
    seeded = SamplingParams(temperature=1.0, seed=1234)
    logits = logits_row.expand(1, -1).clone()
    alone = []
    for position in range(40):
        sampler, rows = _sampler([seeded], seed=position)
        alone.append(int(sampler.sample(logits.clone(), rows, torch.tensor([position]), None).token_ids[0]))
    mixed = []
    for position in range(40):
        params = [SamplingParams(temperature=1.0)] * 3 + [seeded] + [SamplingParams(temperature=0.5, seed=7)]
        sampler, rows = _sampler(params, seed=1000 + position)
        batch_logits = torch.randn(5, VOCAB)
        batch_logits[3] = logits_row
        positions = torch.tensor([3, 9, 1, position, 5])
        mixed.append(int(sampler.sample(batch_logits, rows, positions, None).token_ids[3]))
    assert alone == mixed
    assert len(set(alone)) > 5  # the seed yields a random sequence, not a constant


def _reference_penalties(logits, prompt, outputs, repetition, presence, frequency):
    result = logits.clone()
    seen = set(prompt) | set(outputs)
    for token in seen:
        value = float(result[token])
        result[token] = value / repetition if value > 0 else value * repetition
    for token in set(outputs):
        count = outputs.count(token)
        result[token] -= frequency * count + presence
    return result


def test_penalties_match_a_direct_implementation():
    generator = torch.Generator().manual_seed(3)
    rows = 3
    logits = torch.randn(rows, VOCAB, generator=generator) * 2
    prompts = [[1, 2, 3, 3], [10, 11], [5]]
    outputs = [[3, 4, 4, 4], [], [5, 6, 6]]
    settings = [(1.3, 0.5, 0.25), (0.8, -0.4, 1.0), (1.0, 1.5, -0.5)]
    history = TokenHistory(rows, VOCAB, torch.device("cpu"))
    for row, (prompt, output) in enumerate(zip(prompts, outputs)):
        history.add_prompt_tokens(torch.full((len(prompt),), row), torch.tensor(prompt))
        if output:
            history.add_output_tokens(torch.full((len(output),), row), torch.tensor(output))
    repetition, presence, frequency = (torch.tensor(column) for column in zip(*settings))
    ours = apply_penalties(
        logits, history.prompt_mask, history.output_counts, repetition, presence, frequency
    )
    for row in range(rows):
        expected = _reference_penalties(logits[row], prompts[row], outputs[row], *settings[row])
        torch.testing.assert_close(ours[row], expected)


def test_logprobs_are_log_softmax_of_processed_logits(logits_row):
    params = [
        SamplingParams(temperature=0.7, top_k=8, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0),
    ]
    sampler, rows = _sampler(params)
    logits = torch.stack([logits_row, logits_row.flip(0), logits_row * 0.5])
    out = sampler.sample(logits.clone(), rows, torch.zeros(3, dtype=torch.int64), None)
    assert out.logprobs is not None
    processed0 = torch.full_like(logits_row, float("-inf"))
    top8 = logits_row.topk(8).indices
    processed0[top8] = logits_row[top8] / 0.7
    expected0 = processed0.log_softmax(-1)
    expected1 = logits[1].log_softmax(-1)
    top0 = expected0.topk(5)
    np.testing.assert_allclose(out.logprobs.top_logprobs[0], top0.values.numpy(), rtol=1e-5, atol=1e-6)
    assert out.logprobs.top_token_ids[0].tolist() == top0.indices.tolist()
    np.testing.assert_allclose(
        out.logprobs.top_logprobs[1, :3], expected1.topk(3).values.numpy(), rtol=1e-5, atol=1e-6
    )
    for row, expected in ((0, expected0), (1, expected1)):
        token = int(out.token_ids[row])
        assert out.logprobs.sampled_logprobs[row] == pytest.approx(float(expected[token]), abs=1e-5)
        assert out.logprobs.sampled_ranks[row] == int((expected > expected[token]).sum()) + 1
    assert out.logprobs.sampled_ranks[1] == 1  # greedy picks the best token
    assert out.logprobs.requested.tolist() == [5, 3, -1]


def _masks_by_sorting(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """Reference top-k / top-p masks from whole sorted rows in float64, and per row whether
    its nucleus boundary is too close to top_p for float32 to settle it."""
    keep, clear = torch.zeros_like(logits, dtype=torch.bool), []
    for row, (values, k, p) in enumerate(zip(logits.double(), top_k.tolist(), top_p.tolist())):
        order = values.argsort(descending=True)
        k = len(values) if k == 0 else min(k, len(values))
        probs = torch.softmax(values[order[:k]], 0)
        above = probs.cumsum(0) - probs
        size = int((above < p).sum())
        keep[row, order[:size]] = True
        clear.append(p >= 1.0 or bool(((above - p).abs() > 1e-5).all()))
    return keep, clear


@pytest.mark.parametrize("candidates", [1024, 16])  # 16: most rows take the sorting path
def test_top_k_top_p_masks_equal_sorting_whole_rows(candidates, monkeypatch):
    from pyengine.executor import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(candidates)
    rows, vocab = 96, 3000
    peaked = -2.2 * (torch.rand(rows // 2, vocab, generator=gen).argsort(-1).float() + 1).log()
    flat = torch.randn(rows // 2, vocab, generator=gen)
    logits = torch.cat([peaked + 0.1 * torch.randn(peaked.shape, generator=gen), flat])
    top_k = torch.tensor([[0, 1, 5, 40, 2000, 3000][i % 6] for i in range(rows)])
    top_p = torch.tensor([[1.0, 0.3, 0.9, 0.999][i % 4] for i in range(rows)])
    masked = sampler_module.apply_top_k_top_p(logits, top_k, top_p)
    expected, clear = _masks_by_sorting(logits, top_k, top_p)
    assert sum(clear) > rows * 0.9
    for row in range(rows):
        if clear[row]:
            assert torch.equal(masked[row] > float("-inf"), expected[row]), row
            assert torch.equal(masked[row][expected[row]], logits[row][expected[row]])


@pytest.mark.parametrize("candidates", [1024, 8])  # 8: wide nuclei draw over the whole vocabulary
@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_p=0.5, temperature=0.7), SamplingParams(top_p=0.97), SamplingParams(top_k=12, top_p=0.9),
     SamplingParams(min_p=0.05, temperature=1.3), SamplingParams(top_p=0.8, min_p=0.2)],
    ids=["narrow_top_p", "wide_top_p", "top_k_top_p", "min_p", "top_p_min_p"],
)
def test_draws_follow_the_filtered_distribution(logits_row, params, candidates, monkeypatch):
    from pyengine.executor import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", candidates)
    draws = 20000
    tokens = _draw(logits_row, params, draws=draws)
    scaled = (logits_row / params.temperature).double()
    keep, _ = _masks_by_sorting(scaled[None].float(), torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    probs = torch.where(keep[0], scaled, float("-inf")).softmax(-1)
    probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    expected = probs / probs.sum()
    frequencies = torch.bincount(tokens, minlength=VOCAB).double() / draws
    assert (frequencies - expected).abs().max() < 0.02
    assert frequencies[expected == 0].sum() == 0


def test_greedy_and_sampling_rows_share_a_batch(logits_row):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=5)]
    sampler, rows = _sampler(params)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    tokens = sampler.sample(logits.clone(), rows, torch.zeros(4, dtype=torch.int64), None).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert all(0 <= int(t) < VOCAB for t in tokens)

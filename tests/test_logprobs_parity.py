"""Log-probabilities as vLLM returns them (``Logprob``: logprob, rank, decoded_token),
checked against Hugging Face transformers' ``log_softmax`` of the same tiny checkpoint's
logits (a reference nobody here wrote)."""

from __future__ import annotations

import pytest
import torch

from pyengine import LLM, Logprob, SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint

ATOL = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("logprobs") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint), max_num_seqs=8) as llm:
        yield llm


def reference_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is the distribution of the token after token_ids[:i + 1]."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_entry_matches(entry: dict[int, Logprob], chosen: int, ref: torch.Tensor, k: int, piece) -> None:
    """``entry``: the chosen token first (its true rank), then the top-k (ranks 1..k)."""
    assert next(iter(entry)) == chosen
    assert entry[chosen].logprob == pytest.approx(float(ref[chosen]), abs=ATOL)
    assert entry[chosen].rank == int((ref > ref[chosen]).sum()) + 1
    top = ref.topk(k)
    others = [t for t in entry if t != chosen]
    assert len(entry) in (k, k + 1) and set(top.indices.tolist()) <= set(entry) | _near_ties(ref, top, ATOL)
    for rank, token in enumerate(top.indices.tolist(), start=1):
        if token in others:
            assert entry[token].logprob == pytest.approx(float(ref[token]), abs=ATOL)
            assert entry[token].rank == rank
    for token, lp in entry.items():
        assert lp.decoded_token == (piece(token) if piece is not None else None)


def _near_ties(ref: torch.Tensor, top, atol: float) -> set[int]:
    """Tokens within ``atol`` of the k-th best: either may be listed."""
    kth = float(top.values[-1])
    return set(torch.nonzero((ref - kth).abs() <= atol).flatten().tolist())


def test_sampled_logprobs_ranks_and_text_match_transformers(llm, hf_model):
    prompt = [11, 42, 7, 99, 3, 250, 18]
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref = reference_logprobs(hf_model, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 12
    ranks = []
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert_entry_matches(entry, token, ref[len(prompt) - 1 + i], 3, lambda t: tokenizer.decode([t]))
        ranks.append(entry[token].rank)
    assert max(ranks) > 3, f"temperature 1 should sample some token outside the top 3: ranks {ranks}"
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_without_detokenize_decoded_token_is_none(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, detokenize=False)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == ""
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1 and all(lp.decoded_token is None for lp in entry.values())
        assert sorted(lp.rank for lp in entry.values()) == [1, 2]

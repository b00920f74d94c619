"""Log-probabilities as vLLM returns them (``Logprob``: logprob, rank, decoded_token),
checked against Hugging Face transformers' ``log_softmax`` of the same tiny checkpoint's
logits (a reference nobody here wrote)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pyengine import LLM, AsyncEngine, EngineConfig, Logprob, SamplingParams, make_engine_client
from pyengine.errors import EngineError, InvalidRequestError
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
    if not len(top.values):
        return set()
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


# ---- prompt logprobs ----

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5, 301, 77, 12, 140, 9, 33, 2, 480, 61, 19, 27, 8, 93, 150, 44, 6]


def assert_prompt_logprobs(prompt_logprobs, prompt: list[int], hf_model, k: int, piece) -> None:
    """vLLM's shape: None for the first prompt token, then per token the token plus top-k."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    ref = reference_logprobs(hf_model, prompt)
    for j in range(1, len(prompt)):
        assert_entry_matches(prompt_logprobs[j], prompt[j], ref[j - 1], k, piece)


def test_prompt_logprobs_match_transformers(llm, hf_model):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=4)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert_prompt_logprobs(out.prompt_logprobs, PROMPT, hf_model, 4, lambda t: tokenizer.decode([t]))
    assert out.outputs[0].logprobs is None  # only what was asked for
    plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


@pytest.mark.parametrize("slice_positions", [1, 5])
def test_prompt_logprobs_in_slices_smaller_than_a_prompt_match_transformers(llm, hf_model, monkeypatch,
                                                                            slice_positions):
    from pyengine.executor import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SLICE_POSITIONS", slice_positions)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, detokenize=False)
    outs = llm.generate([PROMPT, PROMPT[::-1][:11]], params, use_tqdm=False)
    for out, prompt in zip(outs, [PROMPT, PROMPT[::-1][:11]]):
        assert_prompt_logprobs(out.prompt_logprobs, prompt, hf_model, 3, None)


def test_an_lm_head_failing_on_prompt_positions_fails_only_the_asking_request(llm, monkeypatch):
    """The LM head runs out of memory on anything wider than the step's sampled rows (the
    prompt positions' logits, as a 128k vocabulary over a full token budget would): the
    request that asked fails; the one in the same steps goes on."""
    from pyengine.executor import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SLICE_POSITIONS", 4)
    model = llm.engine_core.runner.model
    head = model.compute_logits

    def small_batches_only(hidden):
        if len(hidden) > 2:  # two requests: at most two sampled rows a step
            raise RuntimeError("CUDA out of memory (injected)")
        return head(hidden)

    monkeypatch.setattr(model, "compute_logits", small_batches_only)
    engine = AsyncEngine.from_engine_core(llm.engine_core)

    async def run():
        asking = _last(engine, PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1), "asking-oom")
        other = _last(engine, PROMPT[:5], SamplingParams(max_tokens=3, ignore_eos=True), "other-oom")
        return await asyncio.gather(asking, other, return_exceptions=True)

    failed, fine = asyncio.run(run())
    assert isinstance(failed, EngineError) and "computing prompt logprobs failed" in str(failed)
    assert "out of memory (injected)" in str(failed)
    assert not isinstance(fine, BaseException), fine
    assert len(fine.outputs[0].token_ids) == 3 and fine.prompt_logprobs is None
    assert llm.stats().kv_usage == 0.0


def test_chunked_prefill_preemption_and_prefix_hits_give_the_same_prompt_logprobs(checkpoint, hf_model):
    """Small token budget (the prompt in chunks of at most 8), a KV pool that forces
    preemption, n = 2, and a prompt whose prefix another request cached first."""
    other = PROMPT[:16] + [400, 401, 402]
    with LLM(str(checkpoint), max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=8,
             num_kv_blocks=12, block_size=4) as llm:
        warm = llm.generate([other], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
        plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
        assert plain.num_cached_tokens >= 12, "without prompt_logprobs the shared prefix is a cache hit"
        outs = llm.generate([PROMPT, PROMPT[::-1]] * 2, SamplingParams(
            temperature=0.8, seed=1, n=2, max_tokens=12, ignore_eos=True, prompt_logprobs=0, detokenize=False,
        ), use_tqdm=False)
        stats = llm.stats()
    assert warm.prompt_logprobs is None
    assert stats.preemptions > 0 and stats.scheduler["prefill_tokens_scheduled"] > 0
    for out, prompt in zip(outs, [PROMPT, PROMPT[::-1]] * 2):
        assert out.num_cached_tokens == 0, "a request with prompt_logprobs does not read the prefix cache"
        assert len(out.outputs) == 2
        assert_prompt_logprobs(out.prompt_logprobs, prompt, hf_model, 0, None)


def test_a_one_token_prompt_has_prompt_logprobs_none_only(llm):
    out = llm.generate([[17]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("field,value,match", [
    ("prompt_logprobs", 21, "prompt_logprobs = 21 exceeds max_logprobs = 20"),
    ("prompt_logprobs", -1, "prompt_logprobs = -1 exceeds max_logprobs"),  # the whole vocabulary
    ("prompt_logprobs", -2, "prompt_logprobs must be >= 0, or -1"),
    ("logprobs", 21, "logprobs = 21 exceeds max_logprobs"),
])
def test_bad_logprob_counts_are_refused_naming_the_field(llm, field, value, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([[1, 2, 3]], SamplingParams(**{field: value}), use_tqdm=False)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)[0].finished  # still serving


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary(checkpoint):
    with LLM(str(checkpoint), max_logprobs=100_000) as llm:
        vocab = llm.engine_core.vocab_size
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1, prompt_logprobs=-1, detokenize=False),
                           use_tqdm=False)[0]
    assert [len(e) for e in out.prompt_logprobs[1:]] == [vocab, vocab]
    assert sorted(lp.rank for lp in out.prompt_logprobs[1].values()) == list(range(1, vocab + 1))


def test_a_failure_computing_prompt_logprobs_fails_only_that_request(llm, monkeypatch):
    from pyengine.executor import model_runner

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(model_runner, "compute_prompt_logprobs", broken)
    engine = AsyncEngine.from_engine_core(llm.engine_core)

    async def run():
        asking = _last(engine, PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1), "asking")
        other = _last(engine, PROMPT[:5], SamplingParams(max_tokens=3, ignore_eos=True), "other")
        return await asyncio.gather(asking, other, return_exceptions=True)

    failed, fine = asyncio.run(run())
    assert isinstance(failed, EngineError) and "computing prompt logprobs failed" in str(failed)
    assert len(fine.outputs[0].token_ids) == 3 and fine.prompt_logprobs is None
    assert llm.stats().kv_usage == 0.0


async def _last(engine, prompt, params, rid=None, kind="cumulative"):
    outs = [o async for o in engine.generate(prompt, params, rid, output_kind=kind)]
    return outs[-1]


async def _all(engine, prompt, params, kind):
    return [o async for o in engine.generate(prompt, params, output_kind=kind)]


def test_async_and_multiprocess_engines_deliver_prompt_logprobs(checkpoint, llm):
    """Cumulative outputs carry them once complete, a delta stream once; the multi-process
    engine's (arrays across the link) equal the in-process engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    want = llm.generate([PROMPT], params, use_tqdm=False)[0]
    local = AsyncEngine.from_engine_core(llm.engine_core)
    remote = make_engine_client(EngineConfig.from_kwargs(str(checkpoint), max_num_seqs=8), multiprocess=True)
    try:
        for engine in (local, remote):
            deltas = asyncio.run(_all(engine, PROMPT, params, "delta"))
            carrying = [o for o in deltas if o.prompt_logprobs is not None]
            assert len(carrying) == 1 and carrying[0] is deltas[0]
            assert carrying[0].prompt_logprobs == want.prompt_logprobs
            assert [e for o in deltas for e in o.outputs[0].logprobs] == want.outputs[0].logprobs
            cumulative = asyncio.run(_all(engine, PROMPT, params, "cumulative"))
            assert all(o.prompt_logprobs == want.prompt_logprobs for o in cumulative)
            final = asyncio.run(_last(engine, PROMPT, params, kind="final"))
            assert final.prompt_logprobs == want.prompt_logprobs
            assert final.outputs[0].logprobs == want.outputs[0].logprobs
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):  # refused at the front end
            asyncio.run(_last(remote, [1, 2], SamplingParams(prompt_logprobs=10_000)))
    finally:
        remote.shutdown()

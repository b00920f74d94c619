"""``LLM.beam_search`` equals Hugging Face transformers' ``generate(num_beams=k)`` (the same
checkpoint in transformers: same sequences, same scores), shares blocks through the
prefix cache, leaks none, and refuses bad parameters by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import LLM, BeamSearchParams, SamplingParams
from pyengine.errors import InvalidRequestError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.waits import wait_engine_idle

#: End-of-sequence ids the tiny model emits now and then (in generation_config.json, which
#: transformers and pyengine both read), so that beams end by EOS as well as by length.
EOS = [311, 135]
SCORE_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("beams") / "qwen3", "qwen3", seed=3, eos_token_ids=EOS)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 500, int(rng.integers(2, 40))).tolist() for _ in range(6)]


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(str(checkpoint)) as engine:
        yield engine


def hf_beam_search(model, prompt, k, max_tokens, length_penalty, early_stopping):
    """transformers' k best: (generated tokens up to and including EOS, sequences_scores)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=length_penalty,
                             early_stopping=early_stopping, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0)
    result = []
    for i in range(k):
        tokens = out.sequences[i, len(prompt):].tolist()
        ends = [j for j, t in enumerate(tokens) if t in EOS]
        result.append((tokens[:ends[0] + 1] if ends else tokens, float(out.sequences_scores[i])))
    return result


CASES = [  # beam_width, max_tokens, length_penalty, early_stopping
    (3, 12, 1.0, False),
    (4, 10, 0.0, True),
    (2, 16, 2.0, "never"),
    (3, 9, -0.5, False),
    (5, 8, 1.0, True),
]


@pytest.mark.parametrize("k,max_tokens,length_penalty,early_stopping", CASES)
def test_same_sequences_and_scores_as_transformers(llm, hf_model, prompts, k, max_tokens, length_penalty,
                                                   early_stopping):
    params = BeamSearchParams(beam_width=k, max_tokens=max_tokens, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outs) == len(prompts)
    reasons = set()
    for prompt, out in zip(prompts, outs):
        expected = hf_beam_search(hf_model, prompt, k, max_tokens, length_penalty, early_stopping)
        assert len(out.sequences) == k
        assert out.prompt_token_ids == prompt
        for seq, (tokens, score) in zip(out.sequences, expected):
            assert seq.tokens == prompt + tokens
            assert seq.output_token_ids == tokens
            assert seq.score == pytest.approx(score, abs=SCORE_TOLERANCE)
            assert seq.cum_logprob == pytest.approx(score * len(tokens) ** length_penalty, rel=1e-4, abs=1e-3)
            assert seq.finish_reason == ("stop" if tokens[-1] in EOS else "length")
            assert seq.stop_reason == (tokens[-1] if tokens[-1] in EOS else None)
            assert len(seq.logprobs) == len(tokens)
            assert seq.cum_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(tokens, seq.logprobs)),
                                                    abs=1e-4)
            reasons.add(seq.finish_reason)
        assert [s.score for s in out.sequences] == sorted((s.score for s in out.sequences), reverse=True)
    if (k, max_tokens) == (3, 12):
        assert reasons == {"stop", "length"}, "the EOS ids must end some beams, or EOS handling goes untested"


def test_beam_width_1_is_greedy(llm, prompts):
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=10))
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    for out, ref in zip(outs, greedy):
        assert len(out.sequences) == 1
        assert out.sequences[0].output_token_ids == ref.outputs[0].token_ids


def test_ignore_eos_runs_every_beam_to_max_tokens(llm, prompts):
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    for out in outs:
        assert all(len(s.output_token_ids) == 12 and s.finish_reason == "length" for s in out.sequences)


def test_text_prompts_and_text(llm):
    tokenizer = llm.get_tokenizer()
    outs = llm.beam_search(["hello there", {"prompt": "a cat"}], BeamSearchParams(beam_width=2, max_tokens=6))
    assert [o.prompt for o in outs] == ["hello there", "a cat"]
    for out in outs:
        assert out.prompt_token_ids == llm.engine_core.tokenize(out.prompt)
        for seq in out.sequences:
            shown = seq.output_token_ids[:-1] if seq.finish_reason == "stop" else seq.output_token_ids
            assert seq.text == tokenizer.decode(shown)


def test_include_stop_str_in_output_keeps_the_eos_text(llm, prompts):
    plain = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12))
    kept = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12, include_stop_str_in_output=True))
    stopped = 0
    for a, b in zip(plain, kept):
        for x, y in zip(a.sequences, b.sequences):
            assert x.tokens == y.tokens
            if x.finish_reason == "stop":
                stopped += 1
                assert y.text == x.text + llm.engine_core.decode([x.tokens[-1]], skip_special_tokens=False)
            else:
                assert y.text == x.text
    assert stopped


def test_every_step_is_one_batch_and_beams_hit_the_prefix_cache(llm, prompts):
    """All live beams of all prompts go to the engine together, once per step; each beam's
    sequence finds its parent's blocks in the prefix cache."""
    batches = []
    step = llm._beam_step

    def counting(batch):
        batches.append(len(batch[0]))
        return step(batch)

    llm._beam_step = counting
    before = llm.stats().scheduler
    try:
        long_prompts = [p * 3 for p in prompts]  # several full blocks each
        outs = llm.beam_search(long_prompts, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    finally:
        del llm._beam_step
    assert wait_engine_idle(llm)
    after = llm.stats().scheduler
    assert len(batches) == 12  # one engine batch per step, no more
    assert batches[0] == len(prompts)  # the first step extends each prompt once
    assert all(size == 4 * len(prompts) for size in batches[1:])
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    queried = after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
    computed = after["prefill_tokens_scheduled"] - before["prefill_tokens_scheduled"]
    assert hits / queried > 0.8, (hits, queried)
    # Each step recomputes at most a beam's last, partial block (16 tokens) and its new token.
    assert computed <= sum(len(p) for p in long_prompts) + sum(batches[1:]) * 16
    assert all(len(o.sequences) == 4 for o in outs)


def test_no_blocks_leak(llm, prompts):
    assert wait_engine_idle(llm)
    start = llm.stats().scheduler
    llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=8))
    assert wait_engine_idle(llm), llm.stats()
    end = llm.stats().scheduler
    assert end["kv_blocks_free"] == start["kv_blocks_free"] == end["kv_blocks_total"]


def test_prompt_near_the_model_length_ends_at_it(checkpoint):
    """Beams stop where the model's length ends, as ``generate`` does offline."""
    with LLM(str(checkpoint), max_model_len=32) as small:
        prompt = list(range(10, 38))  # 28 tokens: 4 left
        out = small.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=20, ignore_eos=True))[0]
        assert all(len(s.output_token_ids) == 4 and s.finish_reason == "length" for s in out.sequences)
        with pytest.raises(InvalidRequestError, match="no room"):
            small.beam_search([list(range(10, 42))], BeamSearchParams(beam_width=2, max_tokens=4))
        assert wait_engine_idle(small), small.stats()


@pytest.mark.parametrize("fields,name", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2.5, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
])
def test_bad_params_name_the_field(fields, name):
    with pytest.raises(InvalidRequestError, match=f"^{name} "):
        BeamSearchParams(**fields)


def test_bad_requests_are_refused_and_the_engine_serves_on(llm, prompts):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    params.beam_width = 0  # set after construction: checked again when the search starts
    with pytest.raises(InvalidRequestError, match="^beam_width must be >= 1"):
        llm.beam_search(prompts, params)
    # EOS ids [311, 135]: 3 * beam_width log-probabilities per beam, max_logprobs 20.
    with pytest.raises(InvalidRequestError, match=r"^beam_width must be <= 6"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=7, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="params must be a BeamSearchParams"):
        llm.beam_search(prompts, SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.beam_search([[]], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.beam_search([[5, 10**6]], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4), lora_request=object())
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=4)) == []
    assert wait_engine_idle(llm), llm.stats()
    out = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4))
    assert len(out[0].sequences) == 2


def test_concurrency_limit_gives_the_same_results(llm, prompts):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    together = llm.beam_search(prompts, params)
    in_pairs = llm.beam_search(prompts, params, concurrency_limit=2)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in in_pairs]
    with pytest.raises(InvalidRequestError, match="concurrency_limit"):
        llm.beam_search(prompts, params, concurrency_limit=0)


def test_prefix_caching_off_gives_the_same_results(llm, checkpoint, prompts):
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    with LLM(str(checkpoint), enable_prefix_caching=False) as uncached:
        got = uncached.beam_search(prompts, params)
        assert uncached.stats().scheduler["prefix_cache_hit_tokens"] == 0
    expected = llm.beam_search(prompts, params)
    assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in expected]


def test_temperature_ranks_by_the_tempered_distribution(llm, hf_model, prompts):
    """temperature T ranks candidates by log_softmax(logits / T): transformers' beam search
    given that as its scores (a logits processor) finds the same beams."""
    import transformers

    class Tempered(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.log_softmax(scores / 2.0, dim=-1)  # scores are log_softmax(logits): same shift

    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=8, temperature=2.0))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                                    max_new_tokens=8, logits_processor=transformers.LogitsProcessorList([Tempered()]),
                                    output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        for i, seq in enumerate(out.sequences):
            tokens = ref.sequences[i, len(prompt):].tolist()
            ends = [j for j, t in enumerate(tokens) if t in EOS]
            assert seq.output_token_ids == (tokens[:ends[0] + 1] if ends else tokens)
            assert seq.score == pytest.approx(float(ref.sequences_scores[i]), abs=SCORE_TOLERANCE)


def test_the_searches_hold_a_whole_copy_of_the_parameters():
    """``make_searches`` (the offline and asyncio searches both) copies every field, so a
    caller that changes its ``BeamSearchParams`` afterwards changes no running search."""
    import dataclasses

    from pyengine.beam_search.driver import make_searches

    params = BeamSearchParams(beam_width=3, max_tokens=7, ignore_eos=True, temperature=0.5, length_penalty=0.3,
                              include_stop_str_in_output=True, early_stopping="never")
    texts, searches = make_searches(["ab", [5, 6, 7]], params, lambda text: [ord(c) for c in text], [2], 100)
    assert texts == ["ab", None] and [s.prompt_token_ids for s in searches] == [[97, 98], [5, 6, 7]]
    assert all(s.params is not params and s.params == params for s in searches)
    for field in dataclasses.fields(BeamSearchParams):
        setattr(params, field.name, None)
    assert dataclasses.asdict(searches[0].params) == {
        "beam_width": 3, "max_tokens": 7, "ignore_eos": True, "temperature": 0.5, "length_penalty": 0.3,
        "include_stop_str_in_output": True, "early_stopping": "never"}
    with pytest.raises(InvalidRequestError, match="a prompt is empty"):
        make_searches([[]], BeamSearchParams(beam_width=2, max_tokens=4), list, [2], 100)
    with pytest.raises(InvalidRequestError, match="a prompt has 100 tokens; this engine holds 100"):
        make_searches([[1] * 100], BeamSearchParams(beam_width=2, max_tokens=4), list, [2], 100)

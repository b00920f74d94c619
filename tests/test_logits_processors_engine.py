"""Logits processors through the whole engine: the docs' custom processor end to end,
the built-in fields against transformers' ``generate`` with its own processors on the
same checkpoint, requests finishing and being preempted while others continue, and a
failing custom processor failing only its step's requests."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import LogitsProcessorList, NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

from pyengine import (
    LLM,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    LogitsProcessor,
    SamplingParams,
)
from pyengine.logits_processors.bad_words_tokens import bad_words_token_ids
from pyengine.logits_processors.index_state import update_entries
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import FaultySink

DOC = Path(__file__).resolve().parents[1] / "docs" / "logits_processors.md"
MAX_TOKENS = 12
PROMPTS = [[5 + i, 60 + 3 * i, 7, 300 - i] for i in range(6)]


def load_doc_example() -> types.ModuleType:
    """The docs' custom processor, executed as a module of its own (the page cannot rot)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    source = next(b for b in blocks if "class TargetTokenLogitsProcessor" in b)
    module = types.ModuleType("doc_logits_processor_example")
    sys.modules[module.__name__] = module
    exec(compile(source, str(DOC), "exec"), module.__dict__)
    return module


class ExplodingLogitsProcessor(LogitsProcessor):
    """Raises in ``apply`` while a request with extra_args={"explode": True} is in the batch."""

    def __init__(self, config, device, is_pin_memory):
        self.armed: dict[int, bool] = {}  # batch index -> True, for the requests that asked

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        update_entries(self.armed, batch_update, lambda params, *_: (params.extra_args or {}).get("explode") or None)

    def apply(self, logits):
        if any(i < logits.shape[0] for i in self.armed):
            raise RuntimeError("injected processor fault")
        return logits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("procs") / "qwen3", "qwen3", seed=3)


@pytest.fixture(scope="module")
def example():
    return load_doc_example()


@pytest.fixture(scope="module")
def llm(checkpoint, example):
    engine = LLM(str(checkpoint), max_num_seqs=8, max_num_batched_tokens=64,
                 logits_processors=[example.TargetTokenLogitsProcessor, ExplodingLogitsProcessor])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def hf_greedy(model, prompt, processors, max_tokens=MAX_TOKENS):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList(processors), eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_the_docs_custom_processor_end_to_end(llm):
    plain = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    mixed = [greedy(extra_args={"target_token": 42}) if i % 2 else greedy() for i in range(len(PROMPTS))]
    got = token_ids(llm.generate(PROMPTS, mixed, use_tqdm=False))
    for i, tokens in enumerate(got):
        assert tokens == ([42] * MAX_TOKENS if i % 2 else plain[i])


def test_custom_validate_params_refuses_before_queueing(llm):
    with pytest.raises(InvalidRequestError, match="target_token must be a token id"):
        llm.generate([[1, 2]], greedy(extra_args={"target_token": "x"}), use_tqdm=False)
    assert llm.stats().queue_depths["requests"] == 0


def test_logit_bias_matches_transformers(llm, hf_model):
    rng = np.random.default_rng(3)
    for prompt in PROMPTS[:3]:
        bias = {int(t): float(b) for t, b in zip(rng.choice(512, 40, replace=False), rng.uniform(-100, 100, 40))}
        got = llm.generate([prompt], greedy(logit_bias=bias), use_tqdm=False)[0].outputs[0].token_ids
        reference = hf_greedy(hf_model, prompt, [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])])
        assert got == reference


def test_allowed_token_ids_restrict_the_output(llm, hf_model):
    allowed = [11, 23, 77, 301, 499]
    got = token_ids(llm.generate(PROMPTS, greedy(allowed_token_ids=allowed), use_tqdm=False))
    bias = [[[t], -1e9] for t in range(512) if t not in allowed]  # every other token out of reach
    for prompt, tokens in zip(PROMPTS, got):
        assert set(tokens) <= set(allowed)
        assert tokens == hf_greedy(hf_model, prompt, [SequenceBiasLogitsProcessor(bias)])


def test_bad_words_token_sequences_match_transformers(llm, hf_model):
    plain = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    for prompt, tokens in zip(PROMPTS, plain):
        words = [[tokens[0]], tokens[2:5], [tokens[1], 17]]  # one token, three tokens, a pair
        params = greedy(_bad_words_token_ids=words)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got[0] != tokens[0]
        assert got == hf_greedy(hf_model, prompt, [NoBadWordsLogitsProcessor(words)])


def test_bad_words_strings_are_tokenized_as_vllm_does(llm, checkpoint, hf_model):
    tokenizer = llm.engine_core.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    # "hello": the spaced form has another length, so only the plain one is kept;
    # "world": same length, another first token, so both are kept.
    assert len(encode(" hello")) != len(encode("hello"))
    assert bad_words_token_ids(tokenizer, ["  hello"], 512) == [encode("hello")]
    assert bad_words_token_ids(tokenizer, ["world"], 512) == [encode("world"), encode(" world")]
    plain = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    # A word the model would write: an output token that is a whole word of its own.
    prompt, token = next((p, t) for p, tokens in zip(PROMPTS, plain) for t in tokens
                         if tokenizer.decode([t]).strip() and encode(tokenizer.decode([t]).lstrip()) == [t])
    word = tokenizer.decode([token])
    got = llm.generate([prompt], greedy(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    expected_ids = bad_words_token_ids(tokenizer, [word], 512)
    assert [token] in expected_ids and token not in got
    assert got == hf_greedy(hf_model, prompt, [NoBadWordsLogitsProcessor(expected_ids)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={512: 1.0}), "logit_bias holds token id 512, outside the vocabulary"),
    (dict(allowed_token_ids=[3, 900]), "allowed_token_ids holds token id 900, outside the vocabulary"),
    (dict(_bad_words_token_ids=[[1, 600]]), "bad_words holds token id 600, outside the vocabulary"),
])
def test_token_ids_outside_the_vocabulary_are_refused(llm, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[1, 2]], greedy(**kwargs), use_tqdm=False)


def test_requests_finishing_mid_batch_keep_each_others_state(llm):
    """Requests of different lengths, each with its own bias / minimum / allowed set, run
    together (rows finish and the layout moves) and alone: the same tokens."""
    eos = llm.engine_core.eos_token_ids[0]
    variants = [
        dict(logit_bias={77: 60.0}, max_tokens=3),
        dict(min_tokens=6, max_tokens=9, logit_bias={eos: 100.0}, ignore_eos=False),
        dict(allowed_token_ids=[10, 20, 30], max_tokens=5),
        dict(extra_args={"target_token": 5}, max_tokens=2),
        dict(logit_bias={300: 30.0, 301: 31.0}, max_tokens=11),
        dict(max_tokens=7),
    ]
    params = [SamplingParams(temperature=0.0, **({"ignore_eos": True} | v)) for v in variants]
    alone = [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(PROMPTS, params)]
    together = token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    assert together == alone
    assert together[1] == together[1][:6] + [eos]  # min_tokens held EOS back for 6 tokens


def test_preempted_requests_resume_with_their_processor_state(checkpoint):
    """A KV pool too small for the batch preempts requests; min_tokens counts the outputs
    a resumed request already has, and the results match an unconstrained pool."""
    prompts = [list(range(3 + i, 40 + i)) for i in range(6)]
    eos = None
    results = []
    for blocks in (None, 12):
        args = dict(max_num_seqs=6) | ({"num_kv_blocks": blocks} if blocks else {})
        with LLM(str(checkpoint), **args) as engine:
            eos = engine.engine_core.eos_token_ids[0]
            params = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, logit_bias={eos: 100.0, 9: 5.0})
                      for _ in prompts]
            results.append(token_ids(engine.generate(prompts, params, use_tqdm=False)))
            if blocks:
                assert engine.stats().preemptions > 0
    assert results[0] == results[1]
    assert all(len(t) == 31 and t[-1] == eos and eos not in t[:-1] for t in results[1])


def run_with_sinks(llm, requests):
    sinks = {}
    for rid, prompt, params in requests:
        sinks[rid] = FaultySink(fail_on=0)
        llm.engine_core.add_request(rid, None, prompt, params, sinks[rid])
    for sink in sinks.values():
        assert sink.done.wait(60), "a caller was left waiting"
    return sinks


def test_a_failing_custom_processor_fails_its_step_not_the_engine(llm):
    reference = token_ids(llm.generate(PROMPTS[:2], [greedy(logit_bias={9: 4.0}), greedy()], use_tqdm=False))
    sinks = run_with_sinks(llm, [("boom", [1, 2, 3], greedy(extra_args={"explode": True}))])
    assert isinstance(sinks["boom"].error, EngineError)
    assert "injected processor fault" in str(sinks["boom"].error)
    assert llm.engine_core.is_alive
    # Later requests are served, with the processors' state rebuilt.
    after = token_ids(llm.generate(PROMPTS[:2], [greedy(logit_bias={9: 4.0}), greedy()], use_tqdm=False))
    assert after == reference


def test_a_processor_that_cannot_be_imported_is_a_config_error(checkpoint):
    with pytest.raises(InvalidConfigError, match="cannot import 'no_such_module.Processor'"):
        LLM(str(checkpoint), logits_processors=["no_such_module.Processor"])
    with pytest.raises(InvalidConfigError, match="LogitsProcessor subclass"):
        LLM(str(checkpoint), logits_processors=[dict])


def test_processors_run_on_rank_0_under_tensor_parallelism(llm, checkpoint, example):
    """At tensor-parallel size 2 the processors (built-in and custom) run once, on rank 0
    in this process (the worker gets none), with the tokens of size 1."""
    eos = llm.engine_core.eos_token_ids[0]
    params = [greedy(logit_bias={77: 100.0}), greedy(extra_args={"target_token": 9}),
              greedy(allowed_token_ids=[10, 20], logit_bias={20: 100.0}),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=5, logit_bias={eos: 100.0})]
    single = token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    with LLM(str(checkpoint), tensor_parallel_size=2, max_num_seqs=8, max_num_batched_tokens=64,
             logits_processors=[example.TargetTokenLogitsProcessor]) as tp:
        assert tp.engine_core.runner.batch.logits_pipeline is not None
        got = token_ids(tp.generate(PROMPTS[:4], params, use_tqdm=False))
    assert got == [[77] * MAX_TOKENS, [9] * MAX_TOKENS, [20] * MAX_TOKENS, single[3]] == single
    assert len(got[3]) == 6 and got[3][-1] == eos


class RecordingLogitsProcessor(LogitsProcessor):
    """Keeps what each ``added`` entry carried (per engine: ``seen`` is set by the test)."""

    seen: list = []

    def __init__(self, config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        for _index, params, prompt, outputs in batch_update.added if batch_update else ():
            self.seen.append((params.extra_args["name"], prompt, outputs))

    def apply(self, logits):
        return logits


def test_a_custom_processor_gets_the_prompt_and_the_running_outputs(checkpoint):
    """vLLM's contract for custom processors: the prompt's ids, and the request's own output
    list, appended to after every step (the built-ins alone get neither kept)."""
    seen: list = []
    RecordingLogitsProcessor.seen = seen
    with LLM(str(checkpoint), max_num_seqs=4, logits_processors=[RecordingLogitsProcessor]) as engine:
        out = engine.generate([[5, 6, 7, 8]], greedy(extra_args={"name": "a"}), use_tqdm=False)[0]
    (name, prompt, outputs), = seen
    assert (name, prompt) == ("a", [5, 6, 7, 8])
    assert outputs == out.outputs[0].token_ids  # the list it was handed, appended to after every step

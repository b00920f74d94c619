"""EngineConfig is the one place engine arguments are checked; the executor's and the
scheduler's configs are derived from it, not copied by hand."""

from __future__ import annotations

import dataclasses

import pytest

from pyengine import EngineConfig, InvalidConfigError
from pyengine.executor.config import EXECUTOR_RULES, ExecutorConfig


def test_the_executor_config_takes_every_field_from_the_engine_config():
    config = EngineConfig(block_size=32, max_num_seqs=7, max_model_len=512, max_num_batched_tokens=64,
                          num_kv_blocks=99, seed=5, max_logprobs=3, load_format="dummy")
    executor = config.executor_config()
    for field in dataclasses.fields(ExecutorConfig):
        assert getattr(executor, field.name) == getattr(config, field.name), field.name


def test_the_scheduler_config_carries_the_engine_arguments():
    config = EngineConfig(block_size=32, max_num_seqs=7, max_num_batched_tokens=64, long_prefill_token_threshold=16,
                          enable_prefix_caching=False, scheduling_policy="priority", pipeline_depth=1)
    sched = config.scheduler_config(num_blocks=123, block_size=config.block_size, max_model_len=256)
    assert (sched.num_blocks, sched.max_model_len) == (123, 256)
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                 "enable_prefix_caching", "pipeline_depth"):
        assert getattr(sched, name) == getattr(config, name), name
    assert sched.policy == "priority"


@pytest.mark.parametrize("name, bad", [("block_size", 0), ("max_logprobs", -1), ("gpu_memory_utilization", 1.5),
                                       ("dtype", "int8"), ("attention_backend", "xformers")])
def test_one_rule_refuses_a_bad_setting_in_both_configs(name, bad):
    assert name in {rule[0] for rule in EXECUTOR_RULES}
    with pytest.raises(InvalidConfigError, match=name):
        EngineConfig(**{name: bad})
    with pytest.raises(InvalidConfigError, match=name):
        ExecutorConfig(**{name: bad})


def test_without_max_tokens_a_request_gets_what_the_kv_pool_holds():
    from pyengine import LLM, SamplingParams

    llm = LLM(num_kv_blocks=8, block_size=16, max_num_seqs=4, max_num_batched_tokens=128)
    try:
        assert llm.engine_core.max_request_tokens == 8 * 16 < llm.engine_core.max_model_len
        prompt = [5, 6, 7, 8]
        out = llm.generate([prompt], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 8 * 16 - len(prompt)
        assert out.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_offline_a_request_longer_than_the_model_is_generated_up_to_the_limit():
    # vLLM's offline behaviour: prompt + max_tokens past max_model_len is cut at the limit
    # and ends with "length"; a prompt alone past it is still refused.
    from pyengine import LLM, InvalidRequestError, SamplingParams

    llm = LLM(max_model_len=48, max_num_seqs=4, max_num_batched_tokens=64)
    try:
        prompt = list(range(5, 15))
        out = llm.generate([prompt], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 48 - len(prompt)
        assert out.outputs[0].finish_reason == "length"
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            llm.generate([list(range(5, 55))], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()

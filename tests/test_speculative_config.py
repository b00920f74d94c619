"""speculative_config: vLLM v1's keys, checked once, refused by name when wrong."""

from __future__ import annotations

import pytest

from pyengine.cli.engine_flags import add_engine_flags, engine_kwargs
from pyengine.config import EngineConfig, _scheduler_speculates
from pyengine.errors import InvalidConfigError
from pyengine.speculative_config import SpeculativeConfig


def test_ngram_lookup_bounds_default_as_vllm():
    both = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4})
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert only_max.scheduler_fields() == {"num_speculative_tokens": 4, "speculative_method": "ngram",
                                           "prompt_lookup_min": 3, "prompt_lookup_max": 3}


def test_json_and_dict_give_the_same_config():
    text = '{"method": "suffix", "num_speculative_tokens": 2}'
    assert SpeculativeConfig.from_value(text) == SpeculativeConfig.from_value({"method": "suffix",
                                                                              "num_speculative_tokens": 2})
    assert SpeculativeConfig.from_value(text).scheduler_fields() == {"num_speculative_tokens": 2,
                                                                     "speculative_method": "suffix"}


@pytest.mark.parametrize("value, names", [
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}, "disable_by_batch_size"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 2}, "method is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min must be <="),
    ({"method": "suffix", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model does not apply"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/folder"}, "checkpoint folder"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "checkpoint folder .* for method 'eagle3'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "not supported by pyengine"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel"),
    ("{not json", "not valid JSON"),
    (["ngram"], "must be a dict"),
])
def test_bad_values_are_refused_by_name(value, names):
    with pytest.raises(InvalidConfigError, match=names):
        SpeculativeConfig.from_value(value)


def test_a_model_alone_means_a_draft_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    config = SpeculativeConfig.from_value({"model": str(tmp_path), "num_speculative_tokens": 3})
    assert config.method == "draft_model" and config.proposed_by_executor
    assert config.scheduler_fields() == {"num_speculative_tokens": 3, "speculative_method": "executor"}


def test_engine_config_takes_the_dict_and_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    names = add_engine_flags(parser)
    ns = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    kwargs = engine_kwargs(ns, names)
    assert kwargs == {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}'}
    assert _scheduler_speculates()
    config = EngineConfig(**kwargs)
    assert config.speculative_config == SpeculativeConfig("ngram", 3)
    scheduler = config.scheduler_config(64, 16, 256)
    assert scheduler.num_speculative_tokens == 3
    assert scheduler.speculative_method == "ngram"
    assert (scheduler.prompt_lookup_min, scheduler.prompt_lookup_max) == (5, 5)


def test_speculation_off_by_default():
    assert EngineConfig().speculative_config is None


def test_the_config_crosses_to_an_engine_core_process():
    """pyengine core --config-json: the nested SpeculativeConfig travels as its dict."""
    import json

    from pyengine.multiprocess.processes import config_json

    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    fields = json.loads(config_json(config))
    assert fields["speculative_config"]["method"] == "ngram"
    assert EngineConfig(**fields).speculative_config == config.speculative_config

"""Engine arguments users pass as they would to vLLM: dtype aliases, the accepted no-op
arguments, hub revision / download folder, task / runner, generation_config."""

from __future__ import annotations

import pytest
import torch

from pyengine import EngineConfig, InvalidConfigError
from pyengine.executor.config import ExecutorConfig
from pyengine.models.loader import resolve_dtype


def test_an_unknown_argument_is_still_an_error_naming_it():
    with pytest.raises(InvalidConfigError, match="no_such_argument"):
        EngineConfig.from_kwargs(None, no_such_argument=1)


@pytest.mark.parametrize("given, canonical", [
    ("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("float32", "float32"), ("auto", "auto"), ("HALF", "float16"),
    (torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
])
def test_dtype_aliases_are_stored_as_the_canonical_name(given, canonical):
    assert EngineConfig.from_kwargs(None, dtype=given).dtype == canonical
    assert EngineConfig(dtype=given).executor_config().dtype == canonical
    assert ExecutorConfig(dtype=given).dtype == canonical
    if canonical != "auto":
        assert resolve_dtype(given, torch.device("cpu")) == getattr(torch, canonical)


@pytest.mark.parametrize("bad", ["int8", torch.int8, 16])
def test_a_dtype_that_is_no_alias_is_an_error_naming_dtype(bad):
    with pytest.raises(InvalidConfigError, match="dtype"):
        EngineConfig.from_kwargs(None, dtype=bad)


# ---- accepted arguments: no-ops, tokenizer, hub revision / download folder, task / runner ----

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from pyengine.testing.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", seed=3)


@pytest.mark.parametrize("name", ["trust_remote_code", "enforce_eager", "disable_log_stats"])
def test_flags_vllm_takes_are_accepted(name):
    assert getattr(EngineConfig.from_kwargs(None, **{name: True}), name) is True
    assert getattr(EngineConfig(), name) is False


def test_trust_remote_code_warns_that_remote_code_is_not_run(tmp_path, tiny, caplog):
    import json
    import shutil

    folder = tmp_path / "remote"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="pyengine.config"):
        EngineConfig.from_kwargs(str(folder), trust_remote_code=True, load_format="dummy")
    assert "never runs remote code" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pyengine.config"):
        EngineConfig.from_kwargs(str(tiny), trust_remote_code=True, load_format="dummy")  # no auto_map
        EngineConfig.from_kwargs(str(folder), load_format="dummy")  # not asked to trust it
    assert "remote code" not in caplog.text


def test_tokenizer_the_model_itself_is_the_models_own(tmp_path, tiny):
    # (a separate tokenizer: tests/test_tokenizer_argument.py)
    config = EngineConfig.from_kwargs(str(tiny), tokenizer=str(tiny), load_format="dummy")
    assert config.tokenizer == str(tiny)
    with pytest.raises(InvalidConfigError, match="tokenizer .*other-tok.*is not a folder"):
        EngineConfig.from_kwargs(str(tiny), tokenizer=str(tmp_path / "other-tok"), load_format="dummy")
    with pytest.raises(InvalidConfigError, match="tokenizer .*hub id"):
        EngineConfig(tokenizer="org/tokenizer")


def test_revision_and_download_dir_reach_the_hub_resolution(tmp_path, monkeypatch, tiny):
    from pyengine.models import hub

    seen = {}

    def resolve(model, *, revision=None, cache_dir=None, need_weights=True):
        seen.update(model=model, revision=revision, cache_dir=cache_dir)
        return tiny

    monkeypatch.setattr(hub, "resolve_model", resolve)
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_kwargs("some-org/some-model", revision="v1.0", download_dir=str(tmp_path / "dl"))
    assert seen == {"model": "some-org/some-model", "revision": "v1.0", "cache_dir": str(tmp_path / "dl")}
    assert (config.model, config.revision, config.download_dir) == (tiny, "v1.0", str(tmp_path / "dl"))


def test_download_dir_is_the_hub_cache_read(tmp_path, monkeypatch, tiny):
    # A populated hub cache in download_dir (not HF_HUB_CACHE) resolves the id offline.
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = tmp_path / "dl" / "models--tiny-org--tiny-qwen3"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in tiny.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_kwargs("tiny-org/tiny-qwen3", download_dir=str(tmp_path / "dl"))
    assert config.model == snapshot


@pytest.mark.parametrize("name, value", [("task", "auto"), ("task", "generate"), ("task", "embed"),
                                         ("runner", "auto"), ("runner", "generate"), ("runner", "pooling")])
def test_task_and_runner_take_vllms_values(name, value):
    assert getattr(EngineConfig.from_kwargs(None, **{name: value}), name) == value


@pytest.mark.parametrize("name, value", [("task", "transcription"), ("runner", "draft"), ("task", "pooling")])
def test_another_task_or_runner_is_an_error_naming_the_value(name, value):
    with pytest.raises(InvalidConfigError, match=f"{name} .*{value}"):
        EngineConfig.from_kwargs(None, **{name: value})


# ---- generation_config: the checkpoint's sampling defaults ----

@pytest.fixture(scope="module")
def tiny_with_defaults(tmp_path_factory):
    import json

    from pyengine.testing.checkpoints import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "qwen3", "qwen3", seed=5)
    generation = json.loads((folder / "generation_config.json").read_text())
    generation.update(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.1,
                      max_new_tokens=48, do_sample=True, pad_token_id=None)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_the_loader_exposes_the_sampling_defaults(tiny_with_defaults, tiny):
    from pyengine.models.loader import load_model

    loaded = load_model(tiny_with_defaults, load_format="dummy")
    assert loaded.generation_config == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                        "repetition_penalty": 1.1, "max_new_tokens": 48}
    assert len(loaded.eos_token_ids) == 2  # the same file still gives the EOS ids
    assert load_model(tiny, load_format="dummy").generation_config == {}  # eos/bos only: no defaults


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_generation_config_defaults_reach_get_default_sampling_params(tiny_with_defaults, mode):
    from pyengine import LLM, SamplingParams

    kwargs = {} if mode == "auto" else {"generation_config": "vllm"}  # "auto" is the default
    llm = LLM(str(tiny_with_defaults), num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64, **kwargs)
    try:
        params = llm.get_default_sampling_params()
        if mode == "auto":
            assert params == SamplingParams(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                                            repetition_penalty=1.1, max_tokens=48)
        else:
            assert params == SamplingParams()
    finally:
        llm.shutdown()


def test_a_generation_config_that_is_no_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(InvalidConfigError, match="generation_config .*'/some/folder'"):
        EngineConfig.from_kwargs(None, generation_config="/some/folder")
    (tmp_path / "no-file").mkdir()
    with pytest.raises(InvalidConfigError, match="generation_config .*no-file"):
        EngineConfig.from_kwargs(None, generation_config=str(tmp_path / "no-file"))


def test_generation_config_may_name_another_folder(tiny_with_defaults, tiny):
    from pyengine import LLM, SamplingParams

    llm = LLM(str(tiny), generation_config=str(tiny_with_defaults), num_kv_blocks=16, max_num_seqs=2,
              max_num_batched_tokens=64)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(
            temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.1, max_tokens=48)
    finally:
        llm.shutdown()


# ---- the server: the same defaults for what a request leaves unset (vLLM's rule) ----

@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_server_requests_take_the_generation_defaults(tiny_with_defaults, mode):
    from pyengine import AsyncEngine
    from pyengine.server import ServerArgs
    from pyengine.server.app import build_context
    from pyengine.server.protocol import CompletionRequest
    from pyengine.server.sampling import default_max_tokens, sampling_params

    engine = AsyncEngine(str(tiny_with_defaults), generation_config=mode, num_kv_blocks=16, max_num_seqs=2,
                         max_num_batched_tokens=64)
    try:
        ctx = build_context(engine, ServerArgs(stats_interval=0))
        unset = sampling_params(ctx, CompletionRequest(prompt="x", max_tokens=None), max_tokens=None, logprobs=None)
        given = sampling_params(ctx, CompletionRequest(prompt="x", temperature=0.0, top_k=-1, max_tokens=500),
                                max_tokens=500, logprobs=None)
        if mode == "auto":
            assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (0.6, 0.95, 20, 1.1)
            assert default_max_tokens(ctx, [10]) == 48  # max_new_tokens: the default...
        else:
            assert (unset.temperature, unset.top_p, unset.top_k, unset.repetition_penalty) == (1.0, 1.0, 0, 1.0)
            assert default_max_tokens(ctx, [10]) == ctx.max_model_len - 10
        assert (given.temperature, given.top_k, given.top_p) == (0.0, -1, 0.95 if mode == "auto" else 1.0)
        assert given.max_tokens == 500  # ...never a cap on a request's own
    finally:
        engine.shutdown()

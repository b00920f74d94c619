"""``tokenizer=``: a tokenizer folder (or hub id) other than the model's, used wherever the
engine, the front ends and the server tokenize, detokenize or read the chat template; and
its failures (no tokenizer.json, more tokens than the model's vocabulary, a hub id
neither cached nor downloadable), each an error naming the argument."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pyengine import LLM, AsyncEngine, EngineConfig, LinkOptions, SamplingParams, make_engine_client
from pyengine.errors import InvalidConfigError, ModelLoadError
from pyengine.testing.checkpoints import make_tiny_checkpoint

WORDS = ["hello", "world", "[user]", "[assistant]", "one", "two", "three"]
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
LIMITS = dict(num_kv_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)


def write_word_tokenizer(folder: Path, words: list[str], template: str = TEMPLATE) -> Path:
    """A whitespace word-level tokenizer (ids 0 <unk>, 1 <eos>, then ``words``): nothing
    like the checkpoint's byte-level BPE, so which one ran shows in every id."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", seed=11)


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    return write_word_tokenizer(tmp_path_factory.mktemp("tok") / "words", WORDS)


@pytest.fixture(scope="module")
def llm(model, words):
    llm = LLM(str(model), tokenizer=str(words), **LIMITS)
    yield llm
    llm.shutdown()


def test_prompts_are_tokenized_with_the_given_tokenizer(llm):
    out = llm.generate("hello world two", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == [2, 3, 7]


def test_outputs_are_detokenized_with_the_given_tokenizer(llm, model):
    # Greedy ids of the same model with its own tokenizer's ids as the prompt: the same ids,
    # the text each tokenizer makes of them.
    ids = {"prompt_token_ids": [2, 3, 6]}
    out = llm.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    own = LLM(str(model), **LIMITS)
    try:
        reference = own.generate(ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                 use_tqdm=False)[0]
    finally:
        own.shutdown()
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids  # the model is the same
    words = Tokenizer.from_file(str(Path(llm.config.tokenizer) / "tokenizer.json"))
    assert out.outputs[0].text == words.decode(out.outputs[0].token_ids)


def test_get_tokenizer_and_chat_use_the_tokenizer_folder(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("hello world") == [2, 3]
    assert tokenizer.eos_token_id == 1
    conversation = [{"role": "user", "content": "hello"}]
    out = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == "[user] hello [assistant] "  # the folder's chat_template.jinja
    assert out.prompt_token_ids == [4, 2, 5]
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) == out.prompt


def test_the_server_renders_the_tokenizer_folders_template(model, words):
    from pyengine.server import ServerArgs
    from pyengine.server.app import build_context

    engine = AsyncEngine(str(model), tokenizer=str(words), **LIMITS)
    try:
        ctx = build_context(engine, ServerArgs(stats_interval=0))
        assert ctx.chat_template_origin == "chat_template.jinja"
        assert engine.tokenizer_path == str(words)
        assert engine.tokenize("one two three") == [6, 7, 8]
        assert engine.decode([2, 3]) == "hello world"
    finally:
        engine.shutdown()


def test_the_multiprocess_front_end_learns_the_tokenizer_folder(llm, words):
    from pyengine.multiprocess import wire
    from pyengine.multiprocess.core_loop import core_info

    codec = wire.Codec(wire.Hello)
    ready = codec.decode([bytes(f) for f in codec.encode(wire.Ready(0, core_info(llm.engine_core, 1),
                                                                       wire.PROTOCOL_VERSION))])
    assert ready.info.tokenizer_path == str(words)
    assert Tokenizer.from_str(ready.info.tokenizer_json).encode("hello").ids == [2]


def test_tokenizer_equal_to_the_model_is_the_models_own(model):
    config = EngineConfig.from_kwargs(str(model), tokenizer=str(model), load_format="dummy")
    assert config.tokenizer == str(model)


def test_a_folder_without_tokenizer_json_is_an_error_naming_it(model, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidConfigError, match="tokenizer .*empty.* has no tokenizer.json"):
        EngineConfig.from_kwargs(str(model), tokenizer=str(tmp_path / "empty"), load_format="dummy")
    with pytest.raises(InvalidConfigError, match="tokenizer .*nowhere.* is not a folder"):
        EngineConfig.from_kwargs(str(model), tokenizer=str(tmp_path / "nowhere"), load_format="dummy")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(model, tmp_path):
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    big = write_word_tokenizer(tmp_path / "big", [f"w{i}" for i in range(vocab_size)])
    with pytest.raises(InvalidConfigError, match=f"tokenizer .*big.* has {vocab_size + 2} tokens, more than"):
        LLM(str(model), tokenizer=str(big), **LIMITS)


def test_a_hub_tokenizer_resolves_from_the_cache(model, words, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = tmp_path / "hub" / "models--tok-org--words"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in words.iterdir():  # a tokenizer repository: no config.json, no weights
        (snapshot / path.name).write_bytes(path.read_bytes())
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_kwargs(str(model), tokenizer="tok-org/words", load_format="dummy")
    assert Path(config.tokenizer) == snapshot
    with pytest.raises(ModelLoadError, match="tokenizer 'tok-org/missing' is not a local folder.*HF_HUB_OFFLINE"):
        EngineConfig.from_kwargs(str(model), tokenizer="tok-org/missing", load_format="dummy")


def test_serve_and_generate_take_tokenizer_flags(model, words):
    from pyengine.cli.generate import build_parser
    from pyengine.server.cli import parse

    _, engine_kwargs, _ = parse([str(model), "--tokenizer", str(words), "--generation-config", "vllm"])
    assert engine_kwargs["tokenizer"] == str(words) and engine_kwargs["generation_config"] == "vllm"
    parser, _ = build_parser()
    ns = parser.parse_args(["--tokenizer", str(words), "--generation-config", str(model)])
    assert (ns.tokenizer, ns.generation_config) == (str(words), str(model))


def test_an_engine_core_process_and_its_front_end_use_the_given_tokenizer(model, words, tmp_path):
    import asyncio
    import shutil

    # generation_config.json defaults ride the link too: a copy of the model with some.
    with_defaults = tmp_path / "model"
    shutil.copytree(model, with_defaults)
    generation = json.loads((with_defaults / "generation_config.json").read_text())
    (with_defaults / "generation_config.json").write_text(json.dumps({**generation, "top_k": 7}))
    engine = make_engine_client(EngineConfig.from_kwargs(str(with_defaults), tokenizer=str(words), **LIMITS),
                                multiprocess=True, link=LinkOptions(start_timeout=120))
    try:
        assert engine.tokenizer_path == str(words)
        assert engine.tokenize("hello world") == [2, 3]
        assert engine.generation_defaults == {"top_k": 7}

        async def run():
            final = None
            async for out in engine.generate("one two", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)):
                final = out
            return final

        out = asyncio.run(asyncio.wait_for(run(), 60))
        assert out.prompt_token_ids == [6, 7]
        assert out.outputs[0].text == Tokenizer.from_file(str(words / "tokenizer.json")).decode(out.outputs[0].token_ids)
    finally:
        engine.shutdown()

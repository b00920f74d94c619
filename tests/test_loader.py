"""Loading checkpoints: formats, dtypes, tokenizer, EOS ids, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyengine.models.config import parse_decoder_config
from pyengine.models.default_model import default_tiny_model
from pyengine.models.errors import ModelLoadError, UnsupportedModelError, WeightMismatchError
from pyengine.models.loader import load_model, resolve_dtype
from pyengine.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _copy(source, target):
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(qwen3, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single, split = load_model(qwen3).model.state_dict(), load_model(sharded).model.state_dict()
    assert single.keys() == split.keys()
    for name in single:
        assert torch.equal(single[name], split[name]), name


def test_missing_tensor_is_named(qwen3, tmp_path):
    folder = _copy(qwen3, tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(
        WeightMismatchError, match=r"missing tensors \(1\): model.layers.1.mlp.up_proj.weight"
    ) as info:
        load_model(folder)
    assert info.value.missing == ["model.layers.1.mlp.up_proj.weight"]


def test_wrong_shape_and_unexpected_tensor_are_named(qwen3, tmp_path):
    folder = _copy(qwen3, tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    tensors["model.extra.weight"] = torch.ones(2)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightMismatchError) as info:
        load_model(folder)
    message = str(info.value)
    assert "model.norm.weight expected [64] got [3]" in message
    assert "unexpected tensors (1): model.extra.weight" in message
    assert isinstance(info.value, ModelLoadError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}), "rope_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(use_sliding_window=True, sliding_window=128, layer_types=["linear_attention"] * 2), "layer_types"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(qwen3, tmp_path, changes, field):
    folder = _copy(qwen3, tmp_path / "unsupported")
    _edit_config(folder, **changes)
    with pytest.raises(UnsupportedModelError, match=field):
        load_model(folder)


def test_mistral_sliding_window_is_read_for_every_layer():
    raw = {
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
    }
    assert parse_decoder_config(raw).layer_windows == (4096,)
    assert parse_decoder_config({**raw, "sliding_window": None}).layer_windows == ()


def test_legacy_rope_scaling_fields_are_read():
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
    }
    rope = parse_decoder_config(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)


def test_missing_folder_and_weights_raise_model_load_error(qwen3, tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    folder = _copy(qwen3, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(folder)


def test_dtypes_and_auto():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype(torch.float16, cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cpu)


def test_bfloat16_load_and_dummy_weights(qwen3):
    loaded = load_model(qwen3, dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.rotary.cos_table.dtype == torch.float32
    dummy = load_model(qwen3, load_format="dummy", seed=3)
    again = load_model(qwen3, load_format="dummy", seed=3)
    real = load_model(qwen3)
    name = "layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(dummy.model.state_dict()[name], again.model.state_dict()[name])
    assert not torch.equal(dummy.model.state_dict()[name], real.model.state_dict()[name])


def test_tokenizer_eos_ids_and_chat_template(qwen3):
    loaded = load_model(qwen3)
    tokenizer = loaded.tokenizer
    text = "Hello 世界 🚀 ok"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    eos = tokenizer.token_to_id("<|eos|>")
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert loaded.eos_token_ids == (eos, im_end)
    assert "im_start" in loaded.tokenizer_config["chat_template"]
    assert loaded.config.eos_token_ids == (eos,)


def test_default_tiny_model_is_built_once(tmp_path):
    first = default_tiny_model(cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_tiny_model(cache_dir=tmp_path) == first
    default_tiny_model.cache_clear()
    assert default_tiny_model(cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

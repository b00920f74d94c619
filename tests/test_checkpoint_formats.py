"""PyTorch ``.bin`` checkpoints (single and sharded) load like safetensors ones and agree
with transformers; safetensors win when both exist; a truncated or corrupt weights file
of either format is a ModelLoadError naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pyengine import LLM, SamplingParams
from pyengine.models import checkpoint as checkpoint_module
from pyengine.models.errors import ModelLoadError
from pyengine.models.loader import load_model
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.transformers_reference import reference_greedy_tokens

MAX_TOKENS = 12


def _copy_without_weights(source, target):
    target.mkdir()
    for path in source.iterdir():
        if path.suffix not in (".safetensors", ".bin") and not path.name.endswith(".index.json"):
            (target / path.name).write_bytes(path.read_bytes())
    return target


def to_bin(source, target, *, shards: int = 1):
    """A copy of the safetensors checkpoint ``source`` with its weights as pytorch_model*.bin."""
    folder = _copy_without_weights(source, target)
    tensors = load_file(source / "model.safetensors")
    if shards == 1:
        torch.save(tensors, folder / "pytorch_model.bin")
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {name: tensors[name] for name in names[i::shards]}
        torch.save(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return folder


@pytest.fixture(scope="module")
def safetensors_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("st") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def bin_ckpt(safetensors_ckpt, tmp_path_factory):
    return to_bin(safetensors_ckpt, tmp_path_factory.mktemp("bin") / "qwen3")


@pytest.fixture(scope="module")
def sharded_bin_ckpt(safetensors_ckpt, tmp_path_factory):
    return to_bin(safetensors_ckpt, tmp_path_factory.mktemp("bin3") / "qwen3", shards=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(1, 30, 6)]


def _greedy(folder, prompts):
    with LLM(str(folder), max_num_seqs=8, max_model_len=128, num_kv_blocks=64) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_bin_checkpoints_load_the_same_weights(safetensors_ckpt, bin_ckpt, sharded_bin_ckpt):
    assert not list(bin_ckpt.glob("*.safetensors"))
    assert len(list(sharded_bin_ckpt.glob("*.bin"))) == 3
    reference = load_model(safetensors_ckpt).model.state_dict()
    for folder in (bin_ckpt, sharded_bin_ckpt):
        state = load_model(folder).model.state_dict()
        assert state.keys() == reference.keys()
        for name in reference:
            assert torch.equal(state[name], reference[name]), (folder, name)


def test_bin_greedy_tokens_match_safetensors_and_transformers(safetensors_ckpt, bin_ckpt, sharded_bin_ckpt,
                                                              prompts):
    expected = _greedy(safetensors_ckpt, prompts)
    assert _greedy(bin_ckpt, prompts) == expected
    assert _greedy(sharded_bin_ckpt, prompts) == expected
    assert reference_greedy_tokens(bin_ckpt, prompts, MAX_TOKENS, ignore_eos=False) == expected
    assert reference_greedy_tokens(sharded_bin_ckpt, prompts, MAX_TOKENS, ignore_eos=False) == expected


def test_bin_is_read_weights_only_and_memory_mapped(bin_ckpt, monkeypatch):
    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "load", recording_load)
    load_model(bin_ckpt)
    assert calls and all(c.get("weights_only") is True and c.get("map_location") == "cpu" for c in calls)
    assert all(c.get("mmap") is True for c in calls)


def test_bin_holding_code_is_refused(safetensors_ckpt, tmp_path):
    import collections

    folder = _copy_without_weights(safetensors_ckpt, tmp_path / "evil")
    torch.save({"x": torch.zeros(1), "y": collections.OrderedDict(a=print)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin.*weights_only=True"):
        load_model(folder)


def test_safetensors_are_preferred_and_trainer_files_ignored(safetensors_ckpt, tmp_path):
    folder = tmp_path / "both"
    folder.mkdir()
    for path in safetensors_ckpt.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    # A .bin that would fail to load: read, it would raise.
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    (folder / "training_args.bin").write_bytes(b"not weights either")
    assert checkpoint_module.checkpoint_files(folder) == [folder / "model.safetensors"]
    load_model(folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors or \*.bin"):
        load_model(folder)


def test_safetensors_load_format_refuses_bin(bin_ckpt):
    with pytest.raises(ModelLoadError, match="found pytorch_model.bin: load_format='auto' reads them"):
        load_model(bin_ckpt, load_format="safetensors")


@pytest.mark.parametrize("fmt", ["safetensors", "bin", "sharded_bin"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_weights_file_is_named(fmt, damage, safetensors_ckpt, bin_ckpt, sharded_bin_ckpt, tmp_path):
    source = {"safetensors": safetensors_ckpt, "bin": bin_ckpt, "sharded_bin": sharded_bin_ckpt}[fmt]
    folder = tmp_path / "damaged"
    folder.mkdir()
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    victim = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))[-1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00garbage" * 64)
    with pytest.raises(ModelLoadError, match="truncated or corrupt|refused") as info:
        load_model(folder)
    assert str(victim) in str(info.value)
    assert "\n" not in str(info.value)

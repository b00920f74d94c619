"""GPTQ and AWQ checkpoint folders loaded through the real loader, against transformers
running the float weights their integers stand for (transformers runs neither format on
CPU: its GPTQ and AWQ paths need CUDA kernels). The folders are packed by
``pyengine.testing.gptq_checkpoint`` from the formats' specs: prefill logits within
float32 rounding of the reference, greedy tokens equal."""

from __future__ import annotations

import json

import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.loader import load_model
from pyengine.models.quantization.packed import QuantizationError
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.dequantized import write_reference_checkpoint
from pyengine.testing.gptq_checkpoint import write_quantized
from pyengine.testing.hand_plan import prefill_alone
from pyengine.testing.quantized_parity import greedy_tokens
from pyengine.testing.transformers_reference import reference_greedy_tokens, reference_logits

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13], [8, 9, 10]]
CASES = [
    dict(method="gptq", bits=4, sym=False, desc_act=False),
    dict(method="gptq", bits=4, sym=True, desc_act=True),
    dict(method="gptq", bits=8, sym=False, desc_act=False),
    dict(method="awq", bits=4, sym=False, desc_act=False),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def quantized(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    folder = make_tiny_checkpoint(root / "float", "qwen3", tie_word_embeddings=False, **SHAPE)
    case = request.param
    reference = write_quantized(folder, root / "quantized", case["method"], bits=case["bits"], group_size=32,
                                sym=case["sym"], desc_act=case["desc_act"])
    return root / "quantized", write_reference_checkpoint(folder, reference, root / "reference"), case


def test_prefill_logits_match_the_dequantized_reference(quantized):
    path, reference_folder, case = quantized
    runner = ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64))
    layer = runner.model.layers[0]
    down = layer.mlp.down_proj.quantized.weight
    assert down.bits == case["bits"] and down.group_size == 32
    assert (down.input_perm is not None) == case["desc_act"]
    # act-order: q/k/v (and gate/up) each have their own permutation, so they load as float
    assert (layer.self_attn.qkv_proj.quantized is None) == case["desc_act"]
    prompt = list(range(3, 60))
    _, ours = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, reference_logits(reference_folder, prompt), atol=ATOL, rtol=RTOL)


def test_greedy_tokens_equal_the_dequantized_reference(quantized):
    path, reference_folder, _ = quantized
    assert greedy_tokens(path, PROMPTS, 10) == reference_greedy_tokens(reference_folder, PROMPTS, 10)


@pytest.mark.parametrize("settings, message", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "compressed-tensors needs config_groups"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ bits=3 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ bits=4, version='gemv' is not supported"),
])
def test_unsupported_quantization_configs_are_named(tmp_path, settings, message):
    folder = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = settings
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=message):
        ModelRunner.from_pretrained(folder, ExecutorConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=8))


def test_a_quantized_folder_off_the_cpu_is_refused_before_loading(quantized):
    folder, _, case = quantized
    with pytest.raises(QuantizationError, match=f"{case['method']} checkpoints .* CPU only yet.*'cuda'"):
        load_model(folder, device="cuda")

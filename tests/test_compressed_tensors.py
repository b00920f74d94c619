"""compressed-tensors checkpoints (as llm-compressor writes them) loaded through the real
loader, against transformers running the float weights their values stand for.

The folders are written by the ``compressed-tensors`` package itself
(``pyengine.testing.compressed_checkpoint``: its ``ModelCompressor`` packs, its
decompression gives the reference weights). transformers' own compressed-tensors loading
is the reference only where it runs the folder on CPU (symmetric weight-only
pack-quantized); it refuses an asymmetric one (the packed zero points' shape) and would
quantize W8A8 / FP8 activations, so elsewhere transformers runs the dequantized float folder. Prefill logits
within 1e-4 (float32 rounding: the products run the same values in another order), greedy
tokens equal; W8A8 and FP8 run their weights with unquantized activations (weight-only),
which is what the reference does too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

from pyengine.executor.config import ExecutorConfig  # noqa: E402
from pyengine.executor.model_runner import ModelRunner  # noqa: E402
from pyengine.models.loader import load_model  # noqa: E402
from pyengine.models.quantization.checkpoint_config import checkpoint_quantization  # noqa: E402
from pyengine.models.quantization.compressed_folder import keeps_fp8  # noqa: E402
from pyengine.models.quantization.kernels import KernelTarget  # noqa: E402
from pyengine.models.quantization.packed import QuantizationError  # noqa: E402
from pyengine.testing.checkpoints import make_tiny_checkpoint  # noqa: E402
from pyengine.testing.compressed_checkpoint import write_compressed  # noqa: E402
from pyengine.testing.dequantized import write_reference_checkpoint  # noqa: E402
from pyengine.testing.hand_plan import prefill_alone  # noqa: E402
from pyengine.testing.quantized_parity import greedy_tokens  # noqa: E402
from pyengine.testing.tp_ranks import check_two_ranks_match_one  # noqa: E402
from pyengine.testing.transformers_reference import reference_greedy_tokens, reference_logits  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13], [8, 9, 10]]
# (scheme, ignore list, architecture): lm_head ignored as llm-compressor's recipes do, once
# quantized; once k_proj ignored (float), which makes the merged q/k/v linear float.
CASES = [
    ("w4a16-group-asym", ("lm_head",), "qwen3"),
    ("w4a16-group-sym", (), "qwen3"),
    ("w8a16-channel-sym", ("lm_head",), "llama"),
    ("w8a16-group-asym", ("lm_head", "re:.*k_proj"), "qwen3"),
    ("w8a8-int", ("lm_head",), "qwen3"),
    ("fp8-tensor", ("lm_head",), "qwen3"),
    ("fp8-channel", ("lm_head",), "llama"),
    ("fp8-block", ("lm_head",), "qwen3"),
]


def _float_folder(root, arch):
    shape = SHAPE if arch == "qwen3" else dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                               num_key_value_heads=2)
    return make_tiny_checkpoint(root / "float", arch, tie_word_embeddings=False, **shape)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[2]}-ignore-{len(c[1])}")
def compressed(request, tmp_path_factory):
    scheme, ignore, arch = request.param
    root = tmp_path_factory.mktemp("ct")
    folder = _float_folder(root, arch)
    reference = write_compressed(folder, root / "quantized", scheme, ignore=ignore)
    return root / "quantized", write_reference_checkpoint(folder, reference, root / "reference"), request.param


def test_prefill_logits_match_the_dequantized_reference(compressed):
    path, reference_folder, (scheme, ignore, _) = compressed
    runner = ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64))
    layer = runner.model.layers[0]
    down = layer.mlp.down_proj.quantized
    if scheme.startswith("fp8"):
        assert down is None  # FP8 loads dequantized (no exact integer form, no CPU FP8 kernel)
    else:
        bits = 4 if scheme.startswith("w4") else 8
        assert down.weight.bits == bits
        assert (down.weight.biases is None) == (bits == 8 and "asym" not in scheme)
        assert (layer.self_attn.qkv_proj.quantized is None) == any("k_proj" in i for i in ignore)
        assert (runner.model.quantized_head is None) == ("lm_head" in ignore)
    prompt = list(range(3, 60))
    _, ours = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, reference_logits(reference_folder, prompt), atol=ATOL, rtol=RTOL)


def test_greedy_tokens_equal_the_dequantized_reference(compressed):
    path, reference_folder, _ = compressed
    assert greedy_tokens(path, PROMPTS, 10) == reference_greedy_tokens(reference_folder, PROMPTS, 10)


@pytest.mark.parametrize("scheme", ["w4a16-group-sym", "w8a16-channel-sym"])
def test_symmetric_weight_only_folders_match_transformers_running_the_folder_itself(tmp_path, scheme):
    """Where transformers runs the format on CPU (symmetric weight-only pack-quantized: its
    compressed-tensors integration decompresses the weights on the first forward), it is
    the reference itself: prefill logits within 1e-4, greedy tokens equal."""
    folder = _float_folder(tmp_path, "qwen3")
    write_compressed(folder, tmp_path / "quantized", scheme)
    path = tmp_path / "quantized"
    prompt = list(range(3, 40))
    runner = ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=4, max_model_len=128, num_kv_blocks=32))
    _, ours = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, reference_logits(path, prompt), atol=ATOL, rtol=RTOL)
    assert greedy_tokens(path, PROMPTS, 10, max_model_len=128) == reference_greedy_tokens(path, PROMPTS, 10)


def test_w4a16_tensor_parallel_two_ranks_give_the_logits_of_one(tmp_path):
    folder = _float_folder(tmp_path, "qwen3")
    write_compressed(folder, tmp_path / "quantized", "w4a16-group-asym")
    path = tmp_path / "quantized"
    check_two_ranks_match_one(path, tmp_path, PROMPTS, 6, timeout=300.0, atol=ATOL, rtol=RTOL)


def _group(fmt, weights, inputs=None):
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}}}


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize("settings, message", [
    (_group("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}),
     r"config_groups.group_0 \(format nvfp4-pack-quantized\) is not supported"),
    (_group("sparse-24-bitmask", W4), r"format sparse-24-bitmask\) is not supported"),
    ({**_group("pack-quantized", W4), "sparsity_config": {"format": "sparse-24-bitmask"}},
     "compressed-tensors sparsity_config is not supported"),
    ({**_group("pack-quantized", W4), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    (_group("pack-quantized", {**W4, "num_bits": 2}), "num_bits=2 strategy='group'.* is not supported"),
    (_group("pack-quantized", {**W4, "actorder": None, "strategy": "tensor"}), "strategy='tensor'"),
    (_group("pack-quantized", W4, {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "input_activations int 8-bit token dynamic is not supported"),
    (_group("int-quantized", {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}),
     "symmetric=False is not supported"),
    ({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {
        "a": {"targets": ["re:.*mlp.*"], "weights": W4, "format": "pack-quantized"},
        "b": {"targets": ["re:.*self_attn.*"], "weights": {**W4, "num_bits": 8}, "format": "pack-quantized"}}},
     "several weight schemes"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fp8 fmt='e5m2'"),
    ({**_group("pack-quantized", W4), "quantization_status": "frozen"}, "quantization_status='frozen'"),
])
def test_unsupported_compressed_tensors_configs_are_named(tmp_path, settings, message):
    folder = make_tiny_checkpoint(tmp_path / "m", "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = settings
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=message):
        ModelRunner.from_pretrained(folder, ExecutorConfig(max_num_seqs=2, max_model_len=64, num_kv_blocks=8))


DEEPSEEK_MOE = dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    n_shared_experts=1, n_group=1, topk_group=1)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_deepseek_fp8_block_checkpoint_matches_its_dequantized_weights(tmp_path, arch):
    """DeepSeek-V3's own layout (``quant_method: fp8``, ``weight_scale_inv`` per 128 x 128
    block; Qwen3-FP8 ships the same), written here from its published description: no
    library writes it. On a DeepSeek-V3 with latent attention and routed experts too."""
    if arch == "qwen3":
        folder = _float_folder(tmp_path, arch)
    else:
        folder = make_tiny_checkpoint(tmp_path / "float", arch, **DEEPSEEK_MOE)
    tensors, reference = {}, {}
    # the file's tensors (per expert, as published), not transformers' fused state dict
    for name, w in load_file(str(folder / "model.safetensors")).items():
        w = w.to(torch.float32)
        if name.endswith(".weight") and w.dim() == 2 and "embed" not in name and "lm_head" not in name:
            n, k = w.shape
            blocks = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128)).view(-(-n // 128), 128, -(-k // 128), 128)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            fp8 = (w / full).to(torch.float8_e4m3fn)
            tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = fp8, scale
            reference[name] = fp8.to(torch.float32) * full
        else:
            tensors[name] = reference[name] = w
    target = write_reference_checkpoint(folder, tensors, tmp_path / "fp8")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (target / "config.json").write_text(json.dumps(config))
    reference_path = write_reference_checkpoint(folder, reference, tmp_path / "ref")
    prompt = PROMPTS[0]
    runner = ModelRunner.from_pretrained(target, ExecutorConfig(max_num_seqs=4, max_model_len=128, num_kv_blocks=32))
    _, logits = prefill_alone(runner, prompt)
    torch.testing.assert_close(logits, reference_logits(reference_path, prompt), atol=ATOL, rtol=RTOL)
    assert (greedy_tokens(target, [prompt], 8, max_model_len=128)
            == reference_greedy_tokens(reference_path, [prompt], 8))


def test_a_quantized_layer_missing_its_packed_tensor_is_named(tmp_path):
    folder = _float_folder(tmp_path, "qwen3")
    write_compressed(folder, tmp_path / "quantized", "w4a16-group-sym")
    path = tmp_path / "quantized" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight_packed"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match="model.layers.1.mlp.up_proj has a weight_scale but no weight_packed"):
        load_model(tmp_path / "quantized")


def test_off_the_cpu_only_fp8_folders_load_and_per_row_fp8_stays_fp8(compressed):
    """The decision for a CUDA device, taken at the decision level (no GPU here): integer
    formats are refused before loading, per-tensor / per-channel FP8 stays FP8 on compute
    capability 8.9+ (an error naming it below), block-scaled FP8 loads dequantized."""
    folder, _, (scheme_name, _, _) = compressed
    scheme = checkpoint_quantization(json.loads((folder / "config.json").read_text()))
    hopper, ampere = KernelTarget("cuda", (9, 0)), KernelTarget("cuda", (8, 0))
    if not scheme_name.startswith("fp8"):
        with pytest.raises(QuantizationError, match="compressed-tensors checkpoints .* CPU only yet.*'cuda'"):
            keeps_fp8(scheme, hopper)
    elif scheme_name == "fp8-block":
        assert not keeps_fp8(scheme, hopper) and not keeps_fp8(scheme, ampere)
    else:
        assert keeps_fp8(scheme, hopper)
        with pytest.raises(QuantizationError, match="'fp8'.*compute capability 8.9.*8.0"):
            keeps_fp8(scheme, ampere)
    assert not keeps_fp8(scheme, KernelTarget("cpu"))  # CPU default: dequantized (or packed integers)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_quantized_act_order_g_idx_becomes_the_input_permutation(bits):
    """Older llm-compressor checkpoints (actorder "group") carry ``weight_g_idx``; the
    library no longer writes it, so the tensors are packed here with its ``pack_to_int32``."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from pyengine.models.quantization.compressed_config import CompressedTensorsScheme
    from pyengine.models.quantization.ct_weights import pack_quantized_weight
    from pyengine.models.quantization.fill import _as_float

    generator = torch.Generator().manual_seed(3)
    n, k, group = 48, 128, 32
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(low, high + 1, (n, k), generator=generator, dtype=torch.int8)
    zero = torch.randint(low, high + 1, (n, k // group), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=generator) + 0.01
    g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=generator)].to(torch.int32)
    expected = (q.float() - zero.float()[:, g_idx.long()]) * scale[:, g_idx.long()]
    scheme = CompressedTensorsScheme("compressed-tensors", "pack-quantized", bits, "group", group_size=group,
                                     symmetric=False)
    weight = pack_quantized_weight(pack_to_int32(q, bits), scale, torch.tensor([n, k]),
                                   pack_to_int32(zero, bits, packed_dim=0), g_idx, scheme, "layer")
    assert weight.input_perm is not None
    torch.testing.assert_close(_as_float(weight), expected, atol=1e-5, rtol=1e-5)

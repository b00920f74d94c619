"""The torch kernels behind quantized weights (``quantization/kernels.py``), on CPU, and
the kernel choice for CUDA at the decision level (no GPU here: the CUDA kernels
themselves are checked by ``benches/cuda_quantized.py`` where one is lent).

- ``scaled_mm`` (FP8 weights, per-token FP8 activations): the product within float32
  rounding of the same arithmetic in plain torch (``emulated_fp8_linear``), alone and as
  the whole model's logits (1e-4); against transformers on the dequantized weights the
  logits differ by the activations' e4m3 rounding (3 mantissa bits): the test holds the
  RMS of that difference to FP8_RMS of the logits' standard deviation (measured 9% on the
  tiny model, where the weights' own e4m3 rounding moves them by 10%) and the top token
  to agree wherever the reference's leads its second by more than FP8_MARGIN (five times
  the measured RMS difference, 0.1).
- ``int8pack`` / ``int4pack``: weight-only, so the model's logits are within float32
  rounding (1e-4) of transformers on the dequantized weights. ``dequantize()`` of the
  repacked weights equals the PackedWeight's own (an independent reading of the
  integers) to 1e-6, checked first.
"""

from __future__ import annotations

import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.loader import load_model
from pyengine.models.quantization.fp8 import Fp8Weight, emulated_fp8_linear, fp8_linear, quantize_fp8
from pyengine.models.quantization.kernels import KernelTarget, choose_kernel, prepare_weight
from pyengine.models.quantization.linear import QuantizedMatmul
from pyengine.models.quantization.online import check_method, quantize_weight
from pyengine.models.quantization.packed import QuantizationError, reference_matmul
from pyengine.models.quantization.torch_kernels import Int4PackWeight, Int8PackWeight
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.dequantized import write_dequantized_checkpoint, write_reference_checkpoint
from pyengine.testing.hand_plan import prefill_alone
from pyengine.testing.transformers_reference import reference_logits

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
ATOL, RTOL = 1e-4, 1e-4
# FP8 activations: each row rounded to e4m3 (3 mantissa bits) before every product.
FP8_RMS, FP8_MARGIN = 0.15, 0.5
CONFIG = ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64)
HOPPER, AMPERE, TURING = KernelTarget("cuda", (9, 0)), KernelTarget("cuda", (8, 0)), KernelTarget("cuda", (7, 5))
CPU = KernelTarget("cpu")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("k"), "qwen3", tie_word_embeddings=request.param, **SHAPE)


def _runner(path, method, kernel):
    return ModelRunner(load_model(path, quantization=method, quantization_kernel=kernel), CONFIG)


def _assert_fp8_logits(runner, reference, prompt, monkeypatch):
    """``runner``'s FP8 logits: those of the same model with the products emulated in
    float32 torch (1e-4), and transformers' on the dequantized weights within the FP8
    activations' rounding (see the module docstring)."""
    _, ours = prefill_alone(runner, prompt)
    with monkeypatch.context() as patch:
        patch.setattr("pyengine.models.quantization.linear.fp8_linear", emulated_fp8_linear)
        _, emulated = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, emulated, atol=ATOL, rtol=RTOL)
    theirs = reference_logits(reference, prompt)
    rms = float((ours - theirs).pow(2).mean().sqrt() / theirs.std())
    assert rms <= FP8_RMS, rms
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > FP8_MARGIN
    assert int(clear.sum()) >= 10  # the check has positions to hold
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


# --- the products ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_gives_the_emulated_fp8_product(dtype):
    torch.manual_seed(0)
    w, x, bias = torch.randn(96, 256), torch.randn(7, 256).to(dtype), torch.randn(96).to(dtype)
    fp8 = quantize_fp8(w)
    ours, emulated = fp8_linear(x, fp8, bias), emulated_fp8_linear(x, fp8, bias)
    assert ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), emulated.float(), atol=tol, rtol=tol)
    # The weights alone: e4m3 per channel is within 2^-4 of each value (relative, before the scale).
    assert bool(((fp8.dequantize() - w).abs() <= w.abs() * 2 ** -4 + fp8.scales * 2 ** -9).all())


@pytest.mark.parametrize("method, kernel, cls", [("int8", "int8pack", Int8PackWeight),
                                                 ("int4", "int4pack", Int4PackWeight)])
def test_torch_integer_kernels_give_the_dequantized_product(method, kernel, cls):
    torch.manual_seed(1)
    w, x, bias = torch.randn(96, 256), torch.randn(5, 256), torch.randn(96)
    packed = quantize_weight(w, method)
    matmul = QuantizedMatmul(prepare_weight(packed, kernel))
    assert isinstance(matmul.weight, cls) and not matmul.native
    torch.testing.assert_close(matmul(x, bias), reference_matmul(x, packed, bias), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(matmul.weight.dequantize(), packed.dequantize(), atol=1e-6, rtol=0)


def test_fp8_weight_cuts_and_merges_like_the_float_weight():
    fp8 = quantize_fp8(torch.randn(32, 64))
    dense = fp8.dequantize()
    torch.testing.assert_close(fp8.rows(8, 16).dequantize(), dense[8:24])
    torch.testing.assert_close(fp8.columns(16, 16).dequantize(), dense[:, 16:32])
    torch.testing.assert_close(Fp8Weight.concat_rows([fp8.rows(0, 8), fp8.rows(8, 24)]).dequantize(), dense)
    with pytest.raises(QuantizationError, match="Fp8Weight.scales must be float32"):
        Fp8Weight(fp8.qweight, torch.ones(32))


# --- through the loader ---------------------------------------------------------------

@pytest.mark.parametrize("method, kernel", [("int8", "int8pack"), ("int4", "int4pack")])
def test_torch_integer_kernels_match_the_dequantized_reference(checkpoint, method, kernel, tmp_path):
    runner = _runner(checkpoint, method, kernel)
    reference = write_dequantized_checkpoint(runner.model, checkpoint, tmp_path / "dequantized")
    down = runner.model.layers[0].mlp.down_proj.quantized
    assert isinstance(down.weight, Int8PackWeight if method == "int8" else Int4PackWeight)
    prompt = list(range(3, 73))
    _, ours = prefill_alone(runner, prompt)
    torch.testing.assert_close(ours, reference_logits(reference, prompt), atol=ATOL, rtol=RTOL)


def test_online_fp8_matches_the_dequantized_reference_within_activation_rounding(checkpoint, tmp_path, monkeypatch):
    runner = _runner(checkpoint, "fp8", None)  # CPU default for fp8: scaled_mm
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj.quantized.weight, Fp8Weight)
    assert isinstance(runner.model.quantized_head.weight, Fp8Weight)
    reference = write_dequantized_checkpoint(runner.model, checkpoint, tmp_path / "dequantized")
    _assert_fp8_logits(runner, reference, list(range(3, 73)), monkeypatch)


def test_fp8_checkpoints_stay_fp8_with_scaled_mm(tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    from pyengine.testing.compressed_checkpoint import write_compressed

    folder = make_tiny_checkpoint(tmp_path / "float", "qwen3", tie_word_embeddings=False, **SHAPE)
    for scheme in ("fp8-tensor", "fp8-channel"):
        dequantized = write_compressed(folder, tmp_path / scheme, scheme)
        reference = write_reference_checkpoint(folder, dequantized, tmp_path / f"{scheme}-reference")
        default = ModelRunner(load_model(tmp_path / scheme), CONFIG)
        assert default.model.layers[0].mlp.down_proj.quantized is None  # CPU default: dequantized
        runner = ModelRunner(load_model(tmp_path / scheme, quantization_kernel="scaled_mm"), CONFIG)
        qkv = runner.model.layers[0].self_attn.qkv_proj.quantized
        assert isinstance(qkv.weight, Fp8Weight)  # q, k, v of different per-tensor scales merged
        torch.testing.assert_close(qkv.weight.dequantize().split([256, 128, 128])[1],
                                   dequantized["model.layers.0.self_attn.k_proj.weight"], atol=0, rtol=0)
        _assert_fp8_logits(runner, reference, list(range(3, 60)), monkeypatch)


# --- the choice ------------------------------------------------------------------------

def test_each_device_and_format_gets_its_kernel():
    assert [choose_kernel(m, CPU) for m in ("int8", "int4", "fp8")] == ["native", "native", "scaled_mm"]
    assert [choose_kernel(m, HOPPER) for m in ("int8", "int4", "fp8")] == ["int8pack", "int4pack", "scaled_mm"]
    assert choose_kernel("fp8", KernelTarget("cuda", (8, 9))) == "scaled_mm"  # Ada
    assert [choose_kernel(m, AMPERE) for m in ("int8", "int4")] == ["int8pack", "int4pack"]
    assert choose_kernel("int8", TURING) == "int8pack"
    assert choose_kernel("int8", CPU, "int8pack") == "int8pack"
    assert check_method("int4", torch.device("cpu"), "int4pack") == "int4pack"
    assert check_method("fp8", torch.device("cuda"), target=HOPPER) == "scaled_mm"


@pytest.mark.parametrize("method, target, kernel, message", [
    ("fp8", AMPERE, None, r"'fp8' \(torch._scaled_mm.*needs CUDA compute capability 8.9.*8.0\) is older.*'int8'"),
    ("int4", TURING, None, r"'int4'.*tinygemm.*capability 8.0.*7.5"),
    ("int8", HOPPER, "native", r"kernel 'native'.*CPU only.*'cuda'"),
    ("int8", CPU, "int4pack", r"'int8': kernel 'int4pack'.*does not take int8 weights"),
    ("fp8", CPU, "native", r"'fp8': kernel 'native'.*takes: scaled_mm"),
    ("int8", CPU, "marlin", r"kernel 'marlin' does not exist"),
    ("int4", KernelTarget("mps"), None, r"'int4' is not supported on device 'mps'"),
])
def test_what_cannot_run_is_an_error_naming_method_and_device(method, target, kernel, message):
    with pytest.raises(QuantizationError, match=message):
        choose_kernel(method, target, kernel)


def test_mixture_of_experts_and_bad_kernel_requests_are_refused_at_load(tmp_path):
    with pytest.raises(QuantizationError, match="kernel 'scaled_mm' given without a quantization method"):
        check_method(None, torch.device("cpu"), "scaled_mm")
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(QuantizationError, match="mixture-of-experts.*native CPU kernels only"):
        load_model(moe, quantization="fp8")

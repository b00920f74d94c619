"""``PackedWeight`` (the shared quantized form): layout, validation, shards, and online
quantization at load."""

from __future__ import annotations

import pytest
import torch

from pyengine.models.quantization.online import check_method, quantize_weight
from pyengine.models.quantization.packed import PackedWeight, QuantizationError, reference_matmul


def _int4(n=4, k=256, g=128, seed=0, biases=True) -> PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return PackedWeight(bits=4, group_size=g, in_features=k, out_features=n, qweight=packed,
                        scales=torch.rand(n, k // g, generator=gen) + 0.1,
                        biases=torch.randn(n, k // g, generator=gen) if biases else None)


def test_int4_low_nibble_is_the_even_column():
    q = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)  # columns 1, 2, 3, 4
    w = PackedWeight(bits=4, group_size=2, in_features=4, out_features=1, qweight=q,
                     scales=torch.tensor([[1.0, 10.0]]), biases=torch.tensor([[-8.0, 0.5]]))
    assert w.dequantize().tolist() == [[1 - 8.0, 2 - 8.0, 30.5, 40.5]]


def test_int8_dequantizes_per_group():
    q = torch.tensor([[-128, 127, 3, -1]], dtype=torch.int8)
    w = PackedWeight(bits=8, group_size=2, in_features=4, out_features=1, qweight=q,
                     scales=torch.tensor([[0.5, 2.0]]))
    assert w.dequantize().tolist() == [[-64.0, 63.5, 6.0, -2.0]]


@pytest.mark.parametrize("field, value, match", [
    ("bits", 3, "bits must be 8 or 4"),
    ("group_size", 96, "group_size 96 must divide in_features 256"),
    ("qweight", torch.zeros(4, 256, dtype=torch.uint8), r"qweight of a 4-bit weight must be torch.uint8 \[4, 128\]"),
    ("scales", torch.zeros(4, 2, dtype=torch.float16), "scales"),
    ("biases", torch.zeros(4, 3), "biases"),
    ("input_perm", torch.arange(256, dtype=torch.int32), "input_perm"),
])
def test_invalid_fields_are_errors_naming_them(field, value, match):
    fields = {name: getattr(_int4(), name) for name in PackedWeight.__dataclass_fields__}
    with pytest.raises(QuantizationError, match=match):
        PackedWeight(**{**fields, field: value})


def test_shards_and_merges_match_the_dense_weight():
    w = _int4(n=6, k=512)
    dense = w.dequantize()
    torch.testing.assert_close(w.rows(2, 3).dequantize(), dense[2:5], rtol=0, atol=0)
    torch.testing.assert_close(w.columns(256, 128).dequantize(), dense[:, 256:384], rtol=0, atol=0)
    merged = PackedWeight.concat_rows([w.rows(0, 2), w.rows(2, 4)])
    torch.testing.assert_close(merged.dequantize(), dense, rtol=0, atol=0)
    with pytest.raises(QuantizationError, match="group boundaries"):
        w.columns(64, 128)


def test_reference_matmul_applies_the_input_permutation():
    w = _int4(n=3, k=256)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(1))
    permuted = PackedWeight(**{**{n: getattr(w, n) for n in PackedWeight.__dataclass_fields__}, "input_perm": perm})
    x = torch.randn(5, 256)
    torch.testing.assert_close(reference_matmul(x, permuted), x[:, perm] @ w.dequantize().T)


@pytest.mark.parametrize("method, bits, tolerance", [("int8", 8, 1 / 254), ("int4", 4, 1 / 30)])
def test_online_quantization_error_is_within_half_a_step(method, bits, tolerance):
    weight = torch.randn(64, 384, generator=torch.Generator().manual_seed(2))
    packed = quantize_weight(weight, method)
    assert packed.bits == bits
    error = (packed.dequantize() - weight).abs()
    # Half a quantization step: the step is range / 254 (int8, symmetric) or range / 15 (int4, per group).
    span = weight.abs().amax(dim=1, keepdim=True) * 2 if bits == 8 else (
        weight.view(64, 3, 128).amax(-1) - weight.view(64, 3, 128).amin(-1)).repeat_interleave(128, dim=1)
    assert bool((error <= span * tolerance * 1.001 + 1e-7).all())


def test_unsupported_methods_are_errors_naming_them():
    with pytest.raises(QuantizationError, match="'awq' is not supported; supported: 'int8'"):
        check_method("awq", torch.device("cpu"))
    with pytest.raises(QuantizationError, match="'int4'.*not supported on device 'mps'"):
        check_method("int4", torch.device("mps"))
    with pytest.raises(QuantizationError, match="divisible by 128"):
        quantize_weight(torch.randn(4, 96), "int4")

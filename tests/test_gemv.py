"""The native decode-sized products (``pyengine.models.gemv``: float32, int8 and int4
weights read as stored) against torch on the same weights, and their argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine import _kernels
from pyengine.errors import KernelError
from pyengine.models import gemv
from pyengine.models.quantization.online import quantize_weight
from pyengine.models.quantization.packed import PackedWeight, reference_matmul


def _close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # float32 rounding of a k-term sum, relative to the sum of |terms|
    scale = x.abs() @ w.abs().T
    assert bool(((got - want).abs() <= 2e-6 * scale + 1e-6).all()), float((got - want).abs().max())


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32, 48])
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_equals_torch(rows, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(83, 160, generator=gen), torch.randn(rows, 160, generator=gen), torch.randn(83)
    assert gemv.applies(x)
    _close(gemv.float_linear(x, w, bias), torch.nn.functional.linear(x, w, bias), x, w)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 32])
def test_packed_equals_the_dequantized_product(method, rows):
    gen = torch.Generator().manual_seed(rows)
    packed = quantize_weight(torch.randn(37, 384, generator=gen), method)
    x = torch.randn(rows, 384, generator=gen)
    assert gemv.weight_fits(packed)
    _close(gemv.packed_linear(x, packed), reference_matmul(x, packed), x, packed.dequantize())


def test_int8_groups_with_biases_and_a_permutation():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (20, 256), generator=gen, dtype=torch.int8)
    packed = PackedWeight(bits=8, group_size=32, in_features=256, out_features=20, qweight=q,
                          scales=torch.rand(20, 8, generator=gen), biases=torch.randn(20, 8, generator=gen),
                          input_perm=torch.randperm(256, generator=gen))
    x = torch.randn(6, 256, generator=gen)
    _close(gemv.packed_linear(x, packed), reference_matmul(x, packed), x[:, packed.input_perm],
           packed.dequantize())


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_prepared_products_equal_the_functions_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    dense, bias = torch.randn(40, 256, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(rows, 256, generator=gen)
    threads = torch.get_num_threads()
    assert torch.equal(gemv.PreparedProduct(dense, bias)(x, threads), gemv.float_linear(x, dense, bias))
    for method in ("int8", "int4"):
        packed = quantize_weight(dense, method)
        assert torch.equal(gemv.PreparedProduct(packed)(x, threads), gemv.packed_linear(x, packed))
    permuted = PackedWeight(bits=8, group_size=32, in_features=256, out_features=40,
                            qweight=torch.randint(-128, 128, (40, 256), generator=gen, dtype=torch.int8),
                            scales=torch.rand(40, 8, generator=gen), input_perm=torch.randperm(256, generator=gen))
    assert torch.equal(gemv.PreparedProduct(permuted, bias)(x, threads), gemv.packed_linear(x, permuted, bias))


@pytest.mark.parametrize("magnitude", [1e-20, 1.0, 1e7, 1e9])
def test_int4_at_any_activation_magnitude(magnitude):
    # Past 2^27 (1.3e8) the AVX-512 plane loops, where they run, hand over to the others;
    # tiny activations keep their relative precision (no absolute slack here).
    gen = torch.Generator().manual_seed(5)
    packed = quantize_weight(torch.randn(24, 256, generator=gen), "int4")
    x = torch.randn(3, 256, generator=gen) * magnitude
    x[1, 7] = 3.0 * magnitude
    got = gemv.packed_linear(x, packed)
    assert torch.isfinite(got).all()
    want, scale = reference_matmul(x, packed), x.abs() @ packed.dequantize().abs().T
    assert bool(((got - want).abs() <= 2e-6 * scale).all()), float(((got - want).abs() / scale).max())


def test_what_the_native_path_takes():
    assert not gemv.applies(torch.randn(gemv.MAX_ROWS + 1, 64))  # prefill: the GEMM paths
    assert not gemv.applies(torch.randn(1, 24))  # not a multiple of 16
    assert not gemv.applies(torch.randn(1, 64, dtype=torch.bfloat16))
    assert not gemv.weight_fits(quantize_weight(torch.randn(4, 8), "int8"))


def test_bad_arguments_are_kernel_errors():
    out, x = np.zeros((1, 4), np.float32), np.zeros((1, 32), np.float32)
    with pytest.raises(KernelError, match="weight"):
        _kernels.gemv_f32(out, x, np.zeros((4, 16), np.float32))
    with pytest.raises(KernelError, match="qweight must be int8"):
        _kernels.gemv_quantized(out, x, np.zeros((4, 32), np.int16), np.ones((4, 1), np.float32), None, 32)
    with pytest.raises(KernelError, match="scales"):
        _kernels.gemv_quantized(out, x, np.zeros((4, 32), np.int8), np.ones((4, 2), np.float32), None, 32)
    with pytest.raises(KernelError, match="one row per row of x"):
        _kernels.gemv_f32(np.zeros((2, 4), np.float32), x, np.zeros((4, 32), np.float32))
    with pytest.raises(KernelError, match="multiples of 16"):
        _kernels.gemv_f32(out, np.zeros((1, 24), np.float32), np.zeros((4, 24), np.float32))

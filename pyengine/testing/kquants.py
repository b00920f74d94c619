"""Q4_K and Q6_K quantizers written from llama.cpp's block layout, for tests and benches.

The ``gguf`` package reads every GGML type but writes only the simple ones (Q8_0, Q4_0,
F16, BF16...); K-quant files come from llama.cpp's C code. These quantizers make valid
blocks the plain way (min/max per sub-block, six-bit scales rounded to nearest) rather
than llama.cpp's searched scales: a file's bytes are what pyengine's loader is tested
on, and ``gguf.quants.dequantize`` (an independent reader) checks them.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def quantize_q4_k(weight: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K // 256 * 144] Q4_K blocks."""
    n, k = weight.shape
    x = weight.astype(np.float32).reshape(n, k // QK_K, 8, 32)
    low = np.minimum(x.min(axis=-1), 0.0)
    step = (x.max(axis=-1) - low) / 15.0
    d = step.max(axis=-1, keepdims=True) / 63.0
    dmin = (-low).max(axis=-1, keepdims=True) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(step, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-low, dmin)), 0, 63).astype(np.uint8)
    scale = d * sc
    offset = dmin * mn
    q = np.clip(np.rint(_safe_div(x + offset[..., None], scale[..., None])), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate([
        (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6),
        (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
    ], axis=-1)
    chunks = q.reshape(n, k // QK_K, 4, 2, 32)
    qs = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(n, k // QK_K, 128)
    blocks = np.concatenate([d16.view(np.uint8), dmin16.view(np.uint8), packed_scales, qs], axis=-1)
    return blocks.reshape(n, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K // 256 * 210] Q6_K blocks."""
    n, k = weight.shape
    x = weight.astype(np.float32).reshape(n, k // QK_K, 16, 16)
    step = np.abs(x).max(axis=-1) / 31.0
    d16 = (step.max(axis=-1, keepdims=True) / 127.0).astype(np.float16)
    d = d16.astype(np.float32)
    sc = np.clip(np.rint(_safe_div(step, d)), -128, 127).astype(np.int8)
    scale = d * sc
    q = (np.clip(np.rint(_safe_div(x, scale[..., None])), -32, 31) + 32).astype(np.uint8)
    halves = q.reshape(n, k // QK_K, 2, 4, 32)  # [half, run r, l]: value l + 32 r of the half
    ql = np.concatenate([(halves[..., 0, :] & 0x0F) | ((halves[..., 2, :] & 0x0F) << 4),
                         (halves[..., 1, :] & 0x0F) | ((halves[..., 3, :] & 0x0F) << 4)], axis=-1)
    top = halves >> 4
    qh = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    blocks = np.concatenate([ql.reshape(n, k // QK_K, 128), qh.reshape(n, k // QK_K, 64),
                             sc.view(np.uint8), d16.view(np.uint8)], axis=-1)
    return blocks.reshape(n, -1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))

"""GGUF tensors (llama.cpp's formats) converted into pyengine's weights.

A GGUF tensor is a row-major matrix [N out, K in] whose rows are runs of fixed-size
blocks; each supported block type becomes a :class:`PackedWeight` at load, its integers
repacked (vectorised numpy, one pass over the tensor) into the layout the CPU kernels read:

| type | block | PackedWeight | bits/weight on disk -> in memory |
| --- | --- | --- | --- |
| Q8_0 | 32 int8 + fp16 scale | int8, group 32 | 8.5 -> 9 (scales widen to float32) |
| Q4_0 | 32 nibbles + fp16 scale, q - 8 | uint4, group 32, biases -8 * scale | 4.5 -> 6 |
| Q4_K | 256: 8 x 32 nibbles, 6-bit scales/mins under fp16 d/dmin | uint4, group 32, scales d*sc, biases -dmin*m | 4.5 -> 6 |
| Q6_K | 256: 16 x 16 six-bit values, int8 scales under fp16 d | int8 (q - 32), group 16 | 6.56 -> 10 |

F32, F16 and BF16 tensors are float: they load in the engine's dtype. Any other type
(Q4_1, Q5_*, Q2_K/Q3_K/Q5_K, the IQ and TQ types...) is refused by name.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import torch

from pyengine.models.quantization.packed import PackedWeight, QuantizationError

QK_K = 256
#: GGML type name -> (elements per block, bytes per block) of the block types read here.
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (QK_K, 144), "Q6_K": (QK_K, 210)}
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(BLOCKS)


def convert_tensor(type_name: str, data: np.ndarray, shape: tuple[int, ...], name: str) -> Union[torch.Tensor, PackedWeight]:
    """One GGUF tensor: a float tensor of ``shape`` (float types), else a PackedWeight.

    ``data`` is the tensor's bytes as ``gguf.GGUFReader`` maps them (a view of the file);
    ``shape`` is the tensor's shape in row-major order ([N, K] for a matrix). Quantized
    tensors must be matrices."""
    if type_name in FLOAT_TYPES:
        return _float_tensor(type_name, data, shape)
    if type_name not in BLOCKS:
        raise QuantizationError(
            f"GGUF tensor {name}: type {type_name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    if len(shape) != 2:
        raise QuantizationError(f"GGUF tensor {name}: a {type_name} tensor of shape {list(shape)} is not a matrix")
    n, k = shape
    per_block, block_bytes = BLOCKS[type_name]
    if k % per_block:
        raise QuantizationError(f"GGUF tensor {name}: {k} columns are not whole {type_name} blocks of {per_block}")
    raw = np.ascontiguousarray(data).view(np.uint8)
    if raw.size != n * (k // per_block) * block_bytes:
        raise QuantizationError(f"GGUF tensor {name}: {raw.size} bytes do not hold a {type_name} [{n}, {k}] matrix")
    blocks = raw.reshape(n, k // per_block, block_bytes)
    return _CONVERTERS[type_name](blocks, n, k)


def _float_tensor(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    raw = np.ascontiguousarray(data)
    if type_name == "BF16":
        bits = raw.view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(shape))
    dtype = np.float32 if type_name == "F32" else np.float16
    return torch.from_numpy(raw.view(dtype).reshape(shape).copy())


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 at byte ``offset`` of every block, as float32 [N, blocks]."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _pack_nibbles(q: np.ndarray) -> torch.Tensor:
    """uint8 [N, K] in 0..15 -> uint8 [N, K // 2], the even column in the low nibble."""
    return torch.from_numpy(np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)))


def _q8_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    scales = _half(blocks, 0)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return PackedWeight(bits=8, group_size=32, in_features=k, out_features=n,
                        qweight=torch.from_numpy(q), scales=torch.from_numpy(scales))


def _q4_0(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    # A block's 16 bytes hold element j in the low nibble and j + 16 in the high one.
    scales = _half(blocks, 0)
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return PackedWeight(bits=4, group_size=32, in_features=k, out_features=n, qweight=_pack_nibbles(q),
                        scales=torch.from_numpy(scales), biases=torch.from_numpy(-8.0 * scales))


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of each super-block's 12 bytes [..., 12]."""
    d, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _q4_k(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    # Layout: d fp16, dmin fp16, 12 bytes of scales/mins, 128 bytes of nibbles. The nibbles
    # come in 4 chunks of 32 bytes: the low nibbles are sub-block 2c, the high ones 2c + 1.
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]
    sc, mins = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, k)
    scales = (d * sc).reshape(n, k // 32)
    biases = (-dmin * mins).reshape(n, k // 32)
    return PackedWeight(bits=4, group_size=32, in_features=k, out_features=n, qweight=_pack_nibbles(q),
                        scales=torch.from_numpy(scales), biases=torch.from_numpy(biases))


def _q6_k(blocks: np.ndarray, n: int, k: int) -> PackedWeight:
    # Layout: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, fp16 d.
    # Each half (128 values) reads 64 low-nibble bytes and 32 high bytes: value l + 32 * j
    # of the half is nibble (j // 2) of ql[l + 32 * (j % 2)] plus bits 2j..2j+1 of qh[l].
    ql = blocks[..., :128].reshape(n, -1, 2, 2, 32)  # [half, byte run, l]
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)  # [half, 1, l]
    low = np.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int16) - 32
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks, 208)[..., None]
    return PackedWeight(bits=8, group_size=16, in_features=k, out_features=n,
                        qweight=torch.from_numpy(q.reshape(n, k).astype(np.int8)),
                        scales=torch.from_numpy((d * sc).reshape(n, k // 16)))


_CONVERTERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q6_K": _q6_k}

"""Building blocks of a Llama-family decoder layer.

Linears are tensor-parallel aware: a column-parallel linear owns a slice of the output
features (merged projections such as q/k/v or gate/up keep one slice of each part), a
row-parallel linear owns a slice of the input features and all-reduces its output. Each
linear also says which checkpoint tensors fill which rows of its parameters
(:class:`WeightTarget`), so the loader can check names and shapes without knowing layers.
On CPU float32, ``pack_for_cpu`` switches the linears to oneDNN-packed weights
(:mod:`pyengine.models.cpu_linear`) once the weights are loaded, keeping the dense weight
for decode-sized inputs (up to 48 rows), which the native skinny kernels read once
(:mod:`pyengine.models.gemv`). A linear given a
:class:`~pyengine.models.quantization.packed.PackedWeight` (``set_packed_weight``: online
quantization at load, or a quantized checkpoint) multiplies by it instead
(:mod:`pyengine.models.quantization.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.models import cpu_linear, gemv
from pyengine.models.config import DecoderConfig
from pyengine.models.parallel import ParallelContext, Shard
from pyengine.models.quantization.kernels import LinearWeight
from pyengine.models.quantization.linear import QuantizedMatmul
from pyengine.models.quantization.packed import QuantizationError
from pyengine.models.rope import apply_rotary


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes.

    The checkpoint holds the full (unsharded) tensor of shape ``checkpoint_shape``; this
    rank keeps rows ``[shard.start, shard.start + shard.size)`` of it along ``shard_dim``
    (None: the whole tensor, replicated) and copies them into ``parameter`` rows
    ``[row_offset, row_offset + rows)`` (the whole parameter when ``row_offset`` is None).

    ``parts`` describes a fused checkpoint tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``):
    its rows are the parts one after another (``part.full`` rows each), and this rank
    keeps rows ``[part.start, part.start + part.size)`` of every part, in order
    (:meth:`kept_rows`); such a tensor is read whole and cut by :func:`rank_rows`.
    A target that keeps no rows (``held`` False: expert parallelism, another rank's
    expert) names a tensor the checkpoint must have but this rank does not read.
    """

    parameter: torch.nn.Parameter
    checkpoint_shape: tuple[int, ...]
    shard_dim: Optional[int] = None
    row_offset: Optional[int] = None
    shard: Optional[Shard] = None
    parts: tuple[Shard, ...] = ()

    @property
    def held(self) -> bool:
        """Whether this rank keeps any of the tensor."""
        return self.shard is None or self.shard.size > 0

    def kept_rows(self) -> list[tuple[int, int]]:
        """(first row, rows) of the fused checkpoint tensor this rank keeps, per part."""
        rows, start = [], 0
        for part in self.parts:
            rows.append((start + part.start, part.size))
            start += part.full
        return rows


def rank_rows(dest: WeightTarget, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a fused checkpoint tensor (``dest.parts``), in the parameter's
    order; ``tensor`` itself when the target is not fused."""
    if not dest.parts:
        return tensor
    return torch.cat([tensor.narrow(0, start, size) for start, size in dest.kept_rows()])


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends, beyond ``softmax(q k^T / sqrt(head_dim)) v`` over the whole
    causal context: the backends read it per call, so a model mixes layer kinds freely.

    ``scale`` replaces ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``);
    ``window`` limits each query to the last ``window`` positions, itself included
    (transformers' sliding window: key ``j`` is seen by query ``i`` when ``i - window < j <= i``),
    and the backends then read only those positions' K/V; ``softcap`` maps every score to
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2).
    """

    scale: Optional[float] = None
    window: Optional[int] = None
    softcap: Optional[float] = None

    def score_scale(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale


FULL_ATTENTION = LayerAttention()


class AttentionOp(Protocol):
    """What a model layer calls to attend: write this step's K/V, return attention output."""

    def attend(
        self,
        layer_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        ...

    def fused_decode(self) -> Optional["FusedDecodeAttention"]:
        """The step's attention for the native decode path (``decode_path``), when the
        backend has one for this step (every token a decode row, float32 on CPU); else None."""
        ...


class FusedDecodeAttention(Protocol):
    """Decode attention over a layer's fused q/k/v rows (see ``AttentionOp.fused_decode``)."""

    def attend_fused(self, layer_index: int, qkv: torch.Tensor, num_heads: int, spec: LayerAttention) -> torch.Tensor:
        """``qkv`` [rows, (num_heads + 2 kv_heads) * head_dim], q/k normed and rotated;
        writes K and V into the cache and returns [rows, num_heads * head_dim]."""
        ...

    def layer_inputs(self, layer_index: int, spec: LayerAttention) -> tuple:
        """One layer's cache arrays and the step's rows as ``_kernels.DecodeLayer.run``
        takes them: (keys, values, slots, block tables, context lengths, window or 0)."""
        ...


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementations do.

    On contiguous float32 CPU tensors it runs the native kernel
    (``pyengine._kernels.rms_norm``): one pass per row instead of five operators.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def kernel_weight(self) -> torch.Tensor:
        """The weight the native kernel multiplies by (Gemma's norms: ``1 + weight``)."""
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _native_float32(x) and _native_float32(self.kernel_weight()):
            return self._native(x, None)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` in place, then the norm of the sum (one pass on CPU float32)."""
        if _native_float32(x) and _native_float32(residual) and _native_float32(self.kernel_weight()):
            return self._native(x, residual)
        residual.add_(x)
        return self(residual)

    def _native(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        return native_rms_norm(x, self.kernel_weight().numpy(), self.eps, residual, _threads())

    def weight_targets(self, name: str) -> dict[str, WeightTarget]:
        return {name: WeightTarget(self.weight, tuple(self.weight.shape))}


def native_rms_norm(x: torch.Tensor, weight: np.ndarray, eps: float, residual: Optional[torch.Tensor],
                    threads: int) -> torch.Tensor:
    """The native kernel's RMSNorm of ``x`` (of ``residual += x``, in place, when
    ``residual`` is given) times ``weight``, the norm's kernel weight as a numpy array;
    every tensor float32, CPU and contiguous. A new tensor."""
    out = torch.empty_like(x)
    stream = None if residual is None else residual.numpy()
    _kernels.rms_norm(out.numpy(), x.numpy(), weight, eps, stream, threads)
    return out


def _native_float32(t: torch.Tensor) -> bool:
    """Whether the native CPU kernels take ``t``: float32, on the CPU, contiguous, and not
    part of an autograd graph (the kernels are for inference)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


def _threads() -> int:
    return torch.get_num_threads()


class ColumnParallelLinear(torch.nn.Module):
    """y = x W^T (+ b) where this rank owns a slice of every part of the output features.

    ``parts`` are the merged projections (q, k, v or gate, up) with the rows of each this
    rank holds (:class:`~pyengine.models.parallel.Shard`): an even split, or a replicated
    KV head when a model has fewer KV heads than ranks.
    """

    def __init__(self, input_size: int, parts: list[Shard], bias: bool, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.parts = list(parts)
        self.local_sizes = [part.size for part in parts]
        self.input_size = input_size
        self.weight = torch.nn.Parameter(torch.empty(sum(self.local_sizes), input_size))
        self.bias = torch.nn.Parameter(torch.empty(sum(self.local_sizes))) if bias else None
        self.packed: Optional[torch.Tensor] = None
        self.quantized: Optional[QuantizedMatmul] = None
        # The dense float32 weight the decode-sized kernels read once packed (see gemv.py).
        self.gemv_weight: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized(x, self.bias)
        if self.gemv_weight is not None and gemv.applies(x):
            return gemv.float_linear(x, self.gemv_weight, self.bias)
        if self.packed is not None:
            return cpu_linear.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def set_packed_weight(self, weight: LinearWeight) -> None:
        """Multiply by ``weight`` (this rank's rows, the parts in order) from now on; the
        dense weight is released."""
        self.quantized = _quantized_for(self, weight)

    def pack_for_cpu(self) -> None:
        """Use a oneDNN-packed weight from now on (see ``cpu_linear``); no-op off CPU float32."""
        self.packed = self.packed if self.packed is not None else _pack_weight_of(self)

    def weight_targets(self, names: list[str]) -> dict[str, WeightTarget]:
        """Checkpoint tensor names of each output part ("<prefix>" without .weight/.bias)."""
        targets = {}
        offset = 0
        for name, part in zip(names, self.parts):
            targets[f"{name}.weight"] = WeightTarget(
                self.weight, (part.full, self.input_size), shard_dim=0, row_offset=offset, shard=part
            )
            if self.bias is not None:
                targets[f"{name}.bias"] = WeightTarget(
                    self.bias, (part.full,), shard_dim=0, row_offset=offset, shard=part
                )
            offset += part.size
        return targets

    def fused_weight_targets(self, name: str) -> dict[str, WeightTarget]:
        """The checkpoint tensors of a checkpoint that stores the parts fused, one tensor
        ``<name>.weight`` (and ``.bias``) with the parts' rows in order (Phi-3)."""
        parts = tuple(self.parts)
        full = sum(part.full for part in parts)
        targets = {f"{name}.weight": WeightTarget(self.weight, (full, self.input_size), parts=parts)}
        if self.bias is not None:
            targets[f"{name}.bias"] = WeightTarget(self.bias, (full,), parts=parts)
        return targets


class RowParallelLinear(torch.nn.Module):
    """y = x W^T where this rank owns a slice of the input features; the partial outputs
    are summed over the ranks by one all-reduce (``forward``), or by the caller
    (``partial``)."""

    def __init__(self, input_size: int, output_size: int, parallel: ParallelContext, what: str) -> None:
        super().__init__()
        self.parallel = parallel
        self.input_size = input_size
        self.input_shard = parallel.split(input_size, what)
        self.weight = torch.nn.Parameter(torch.empty(output_size, self.input_shard.size))
        self.packed: Optional[torch.Tensor] = None
        self.quantized: Optional[QuantizedMatmul] = None
        self.gemv_weight: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the sum (the whole result at world size 1)."""
        if self.quantized is not None:
            return self.quantized(x)
        if self.gemv_weight is not None and gemv.applies(x):
            return gemv.float_linear(x, self.gemv_weight)
        if self.packed is not None:
            return cpu_linear.linear(x, self.packed)
        return F.linear(x, self.weight)

    def pack_for_cpu(self) -> None:
        """Use a oneDNN-packed weight from now on (see ``cpu_linear``); no-op off CPU float32."""
        self.packed = self.packed if self.packed is not None else _pack_weight_of(self)

    def set_packed_weight(self, weight: LinearWeight) -> None:
        """Multiply by ``weight`` (this rank's input columns, ``PackedWeight.columns`` of the
        whole) from now on; the dense weight is released."""
        self.quantized = _quantized_for(self, weight)

    def weight_targets(self, name: str) -> dict[str, WeightTarget]:
        shape = (self.weight.shape[0], self.input_size)
        return {f"{name}.weight": WeightTarget(self.weight, shape, shard_dim=1, shard=self.input_shard)}


class GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up merged into one matmul.

    A large step (a prefill burst) runs in slices of ``token_chunk`` tokens: the
    ``[tokens, 2 * intermediate]`` activation of a whole 8192-token step spills out of the
    CPU caches; in slices of 2048, 8192-token steps ran 15% faster on 2 CPU cores (median
    of 6; 16 x 512 and 32 x 256 prompts, hidden 256, intermediate 768). Each token's
    result is the same. The slices' partial sums are all-reduced once, together, so a
    step has one all-reduce here whatever its size.
    """

    token_chunk = 2048

    def __init__(
        self,
        config: DecoderConfig,
        parallel: ParallelContext,
        intermediate_size: Optional[int] = None,
        what: str = "intermediate_size",
    ) -> None:
        """``intermediate_size`` (default: the config's) and its field name ``what`` for
        errors: an MoE layer's shared expert has a size of its own."""
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma); else SiLU
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        part = parallel.split(inter, what)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [part, part], bias=False, parallel=parallel)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, parallel, what)
        self.parallel = parallel
        # Packed gate and up weights (CPU float32): silu and the product run inside the matmuls.
        self.packed_gate_up: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output (the caller all-reduces it, e.g. with an MoE
        layer's routed experts)."""
        if x.shape[0] <= self.token_chunk:
            return self._forward(x)
        return torch.cat([self._forward(part) for part in x.split(self.token_chunk)])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        decode_sized = self.gate_up_proj.gemv_weight is not None and gemv.applies(x)
        if self.packed_gate_up is not None and not decode_sized:
            gate, up = self.packed_gate_up
            activated = cpu_linear.linear_gelu_tanh(x, gate) if self.gelu else cpu_linear.linear_silu(x, gate)
            return self.down_proj.partial(cpu_linear.linear_times(x, up, activated))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # the native kernel when decode-sized
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj.partial(activated * up)

    def pack_for_cpu(self) -> None:
        """Pack gate, up and down for oneDNN (see ``cpu_linear``); no-op off CPU float32."""
        weight = self.gate_up_proj.weight
        if self.packed_gate_up is None and cpu_linear.can_pack(weight):
            inter = self.gate_up_proj.local_sizes[0]
            self.packed_gate_up = (cpu_linear.pack(weight[:inter]), cpu_linear.pack(weight[inter:]))
            self.gate_up_proj.gemv_weight = _gemv_copy(weight)
            cpu_linear.release_dense(self.gate_up_proj)
        self.down_proj.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **self.gate_up_proj.weight_targets([f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
            **self.down_proj.weight_targets(f"{prefix}.down_proj"),
        }


class DecoderAttention(torch.nn.Module):
    """Self-attention with GQA, optional qkv bias (Qwen2) and q/k RMSNorm (Qwen3, Gemma 3);
    the layer's window, scale and soft-cap (``spec``) go to the backend with every call."""

    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.spec = LayerAttention(
            config.attention_scale, config.layer_window(layer_index), config.attn_logit_softcap
        )
        self.head_dim = config.head_dim
        heads = parallel.split(config.num_attention_heads, "num_attention_heads")
        kv_heads = parallel.kv_heads(config.num_key_value_heads)
        self.num_heads = heads.size
        self.num_kv_heads = kv_heads.size
        dim = config.head_dim
        q_part = Shard(heads.full * dim, heads.start * dim, heads.size * dim)
        kv_part = Shard(kv_heads.full * dim, kv_heads.start * dim, kv_heads.size * dim)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], config.qkv_bias, parallel)
        self.o_proj = RowParallelLinear(heads.full * dim, config.hidden_size, parallel, "num_attention_heads x head_dim")
        norm = self.norm_class
        self.q_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self._split = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionOp
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.project(hidden, cos, sin)
        out = attention.attend(self.layer_index, q, k, v, self.spec)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim], q/k normed and rotated:
        what the layer attends with (an EAGLE-3 head also writes k, v alone)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        native = self._native_qk_norm_rope(qkv, cos, sin)
        q, k, v = qkv.split(self._split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if not native:
            if self.q_norm is not None and self.k_norm is not None:
                q = self.q_norm(q)
                k = self.k_norm(k)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        return q, k, v

    def project_kv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, kv_heads, head_dim] as ``project`` computes them (k normed and rotated),
        without the queries where the fused weight's K/V rows can be read alone (a dense
        weight): an EAGLE-3 head's mirror writes K/V for every committed token and reads no
        query (over a prompt, the query rows are half the head's projection)."""
        q_width = self._split[0]
        dense = self.qkv_proj.gemv_weight
        if dense is None and self.qkv_proj.packed is None and self.qkv_proj.quantized is None:
            dense = self.qkv_proj.weight
        if dense is None:
            _, k, v = self.project(hidden, cos, sin)
            return k, v
        weight = dense[q_width:]  # the K and V rows: a contiguous view of the row-major weight
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[q_width:]
        kv = gemv.float_linear(hidden, weight, bias) if gemv.applies(hidden) else F.linear(hidden, weight, bias)
        native = self._native_qk_norm_rope(kv, cos, sin, q_heads=0)
        tokens = hidden.shape[0]
        k, v = kv.split(self._split[1:], dim=-1)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        if not native:
            if self.k_norm is not None:
                k = self.k_norm(k)
            k = apply_rotary(k, cos, sin)
        return k, v.view(tokens, self.num_kv_heads, self.head_dim)

    def _native_qk_norm_rope(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: Optional[int] = None
    ) -> bool:
        """q/k norm and rotary on ``qkv`` in place by the native kernel (one pass, see
        ``rust_sched/kernels/src/norm.rs``); False, with nothing done, where it does not apply.
        ``q_heads``: the query heads each row starts with (default: the layer's; 0 for rows
        of keys and values alone, ``project_kv``)."""
        norms = [self.q_norm, self.k_norm] if self.q_norm is not None and self.k_norm is not None else []
        weights = [norm.kernel_weight() for norm in norms]
        tensors = [qkv, cos, sin, *weights]
        if not all(_native_float32(t) for t in tensors):
            return False
        tokens = qkv.shape[0]
        _kernels.qk_norm_rope(
            qkv.numpy(),
            cos.view(tokens, self.head_dim).numpy(),
            sin.view(tokens, self.head_dim).numpy(),
            self.num_heads if q_heads is None else q_heads,
            self.num_kv_heads,
            weights[0].numpy() if weights else None,
            weights[1].numpy() if weights else None,
            norms[0].eps if norms else 0.0,
            _threads(),
        )
        return True

    def pack_for_cpu(self) -> None:
        self.qkv_proj.pack_for_cpu()
        self.o_proj.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        names = [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]
        targets = {**self.qkv_proj.weight_targets(names), **self.o_proj.weight_targets(f"{prefix}.o_proj")}
        if self.q_norm is not None and self.k_norm is not None:
            targets.update(self.q_norm.weight_targets(f"{prefix}.q_norm.weight"))
            targets.update(self.k_norm.weight_targets(f"{prefix}.k_norm.weight"))
        return targets


def _quantized_for(linear: torch.nn.Module, weight: LinearWeight) -> QuantizedMatmul:
    """``weight`` checked against ``linear``'s dense shape, the dense weight released."""
    out_features, in_features = linear.weight.shape
    if (weight.out_features, weight.in_features) != (out_features, in_features):
        raise QuantizationError(
            f"packed weight is [{weight.out_features}, {weight.in_features}], the layer's is "
            f"[{out_features}, {in_features}]"
        )
    cpu_linear.release_dense(linear)
    linear.packed = None
    return QuantizedMatmul(weight)


def _pack_weight_of(linear: torch.nn.Module) -> Optional[torch.Tensor]:
    """``linear.weight`` packed for oneDNN, its dense copy released; None where unsupported."""
    if not cpu_linear.can_pack(linear.weight):
        return None
    packed = cpu_linear.pack(linear.weight)
    linear.gemv_weight = _gemv_copy(linear.weight)
    cpu_linear.release_dense(linear)
    return packed


def _gemv_copy(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The dense float32 weight kept for the decode-sized kernels (``gemv``): oneDNN's
    packed layout is opaque, and its GEMM reads a weight at about half the memory
    bandwidth on one row. None where the kernels do not take it."""
    if weight.dtype != torch.float32 or weight.shape[1] % gemv.CHUNK:
        return None
    return weight.detach().contiguous()

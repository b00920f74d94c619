"""The native decode path: a decode step of a Llama-family model without its module plumbing.

At batch 1 a decode step reads every weight once, and the native kernels
(``gemv``, ``rms_norm``, ``qk_norm_rope``, ``paged_decode_attention``) already run at the
memory's pace. What is left is the plumbing between them: per layer some 25 module calls,
views, splits, ``empty`` and ``index_copy_`` calls and eligibility checks, about 6 ms of an
80 ms float32 step (and of a 30 ms int8 one) on the 2-core development machine, and more
while the weights stream through the caches the interpreter also needs.

This path runs the same kernels in the same order, on the same tensors, so its results are
bit-identical to the modules' (``tests/test_decode_path.py`` compares them): everything
that can be looked up once (which kernel a linear takes, the norms' weights as arrays, the
heads) is looked up when the path is built, after the weights are final
(``DecoderForCausalLM.pack_for_cpu``), and a step hands each layer's fused q/k/v rows to the
attention backend's ``FusedDecodeAttention``, which writes K/V and attends in one go.

Where nothing needs Python between them (one tensor-parallel rank, a dense MLP, no
permuted inputs), a layer's kernels up to its MLP's gate/up projection run as one native
call, ``_kernels.DecodeLayer.run`` (``rust_sched/kernels/src/decode_layer.rs``): the
input norm, q/k/v projection, q/k norm and rotary embedding, the K/V write, attention,
the output projection and the post-attention norm, the same kernels in the same order.
Only the activation and the down projection are left to Python.

It runs when every token of the step is a decode row (no prefill chunk, no draft
verification), there are at most ``gemv.MAX_ROWS`` of them, the activations are float32
on the CPU, and the backend offers ``fused_decode`` (SDPA on CPU; not flash-attn). The
model qualifies when its layers are the plain ``DecoderLayer`` / ``DecoderAttention`` /
``RMSNorm`` (Llama, Mistral, Qwen2, Qwen3; not Gemma or Phi-3, whose layers differ) and
every linear takes the native kernels (float32, or packed weights they read). A layer
whose MLP is not the dense gated one (mixture of experts) calls that module. Tensor
parallelism all-reduces where the modules do. Anything else runs the modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn.functional as F

from pyengine import _kernels
from pyengine.models import gemv
from pyengine.models.layers import (
    ColumnParallelLinear,
    DecoderAttention,
    FusedDecodeAttention,
    GatedMLP,
    RMSNorm,
    RowParallelLinear,
    native_rms_norm,
)

if TYPE_CHECKING:
    from pyengine._kernels import DecodeLayer

AnyLinear = ColumnParallelLinear | RowParallelLinear


class NativeLinear:
    """One linear as the decode-sized kernels multiply by it (its ``quantized`` product's
    packed weight or its ``gemv_weight``), the kernel's arrays looked up once."""

    __slots__ = ("product",)

    def __init__(self, linear: AnyLinear) -> None:
        weight = linear.quantized.weight if linear.quantized is not None else linear.gemv_weight
        assert weight is not None  # fits() checked it
        self.product = gemv.PreparedProduct(weight, getattr(linear, "bias", None))

    @staticmethod
    def fits(linear: AnyLinear) -> bool:
        """Whether every decode-sized product of ``linear`` goes to the native kernels."""
        bias = getattr(linear, "bias", None)
        if bias is not None and not _float32_cpu(bias):
            return False
        if linear.quantized is not None:
            return linear.quantized.native and linear.quantized.weight.in_features % gemv.CHUNK == 0
        return linear.gemv_weight is not None and linear.gemv_weight.shape[1] % gemv.CHUNK == 0

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        return self.product(x, threads)


class NativeNorm:
    """An RMSNorm's weight as the kernel reads it, and its epsilon."""

    __slots__ = ("weight", "eps")

    def __init__(self, norm: RMSNorm) -> None:
        self.weight = norm.kernel_weight().detach().numpy()
        self.eps = norm.eps

    @staticmethod
    def fits(norm: Optional[RMSNorm]) -> bool:
        return norm is None or (type(norm) is RMSNorm and _float32_cpu(norm.weight))

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor], threads: int) -> torch.Tensor:
        """The norm of ``x`` (of ``residual += x`` when given, in place)."""
        return native_rms_norm(x, self.weight, self.eps, residual, threads)


class _LayerProgram:
    """One ``DecoderLayer``'s decode step: what ``DecoderLayer.forward`` computes."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attention: DecoderAttention = layer.self_attn
        self.layer_index = attention.layer_index
        self.input_norm = NativeNorm(layer.input_layernorm)
        self.post_norm = NativeNorm(layer.post_attention_layernorm)
        self.qkv = NativeLinear(attention.qkv_proj)
        self.o = NativeLinear(attention.o_proj)
        q_norm, k_norm = attention.q_norm, attention.k_norm
        self.q_norm = None if q_norm is None else q_norm.kernel_weight().detach().numpy()
        self.k_norm = None if k_norm is None else k_norm.kernel_weight().detach().numpy()
        self.qk_eps = q_norm.eps if q_norm is not None else 0.0
        self.num_heads = attention.num_heads
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim
        self.spec = attention.spec
        self.parallel = attention.o_proj.parallel
        self.uses_local_rope = layer.uses_local_rope
        mlp = layer.mlp
        self.dense_mlp = type(mlp) is GatedMLP and dense_mlp_fits(mlp)
        self.mlp = mlp
        self.native: Optional["DecodeLayer"] = None
        if self.dense_mlp:
            self.gate_up = NativeLinear(mlp.gate_up_proj)
            self.down = NativeLinear(mlp.down_proj)
            self.gelu = bool(mlp.gelu)
            self.native = self._native_layer()

    def _native_layer(self) -> Optional["DecodeLayer"]:
        """The layer's front as one native call (see the module docstring), or None where a
        step needs Python between its kernels."""
        parts = [linear.product.native_parts() for linear in (self.qkv, self.o, self.gate_up)]
        if self.parallel.world_size != 1 or any(part is None for part in parts):
            return None
        qkv, o, gate_up = parts
        return _kernels.DecodeLayer(
            self.input_norm.weight, self.input_norm.eps, self.post_norm.weight, self.post_norm.eps, qkv, o, gate_up,
            self.q_norm, self.k_norm, self.qk_eps, self.num_heads, self.num_kv_heads, self.head_dim,
            self.spec.score_scale(self.head_dim), softcap=self.spec.softcap or 0.0,
        )

    @staticmethod
    def fits(layer: torch.nn.Module, layer_type: type) -> bool:
        if type(layer) is not layer_type or type(layer.self_attn) is not DecoderAttention:
            return False
        attention = layer.self_attn
        norms = (layer.input_layernorm, layer.post_attention_layernorm, attention.q_norm, attention.k_norm)
        return (
            all(NativeNorm.fits(norm) for norm in norms)
            and (attention.q_norm is None) == (attention.k_norm is None)
            and NativeLinear.fits(attention.qkv_proj)
            and NativeLinear.fits(attention.o_proj)
        )

    def run(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: np.ndarray,
        sin: np.ndarray,
        attention: FusedDecodeAttention,
        threads: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.native is not None:
            gate_up, residual = self._native_front(hidden, residual, cos, sin, attention, threads)
            return self._mlp_rest(gate_up, threads), residual
        if residual is None:
            residual, normed = hidden, self.input_norm(hidden, None, threads)
        else:
            normed = self.input_norm(hidden, residual, threads)
        qkv = self.qkv(normed, threads)
        _kernels.qk_norm_rope(
            qkv.numpy(), cos, sin, self.num_heads, self.num_kv_heads, self.q_norm, self.k_norm, self.qk_eps, threads
        )
        attended = attention.attend_fused(self.layer_index, qkv, self.num_heads, self.spec)
        normed = self.post_norm(self.parallel.all_reduce(self.o(attended, threads)), residual, threads)
        if not self.dense_mlp:
            return self.mlp(normed), residual
        return self._mlp_rest(self.gate_up(normed, threads), threads), residual

    def _native_front(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: np.ndarray,
        sin: np.ndarray,
        attention: FusedDecodeAttention,
        threads: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_kernels.DecodeLayer.run``: the MLP's gate/up projection and the residual
        stream after attention (a new tensor on the first layer, else ``residual`` itself)."""
        assert self.native is not None  # run() checked
        first = residual is None
        if residual is None:
            residual = torch.empty_like(hidden)
        gate_up = torch.empty(hidden.shape[0], self.gate_up.product.out_features, dtype=torch.float32)
        keys, values, slots, tables, seq_lens, window = attention.layer_inputs(self.layer_index, self.spec)
        self.native.run(gate_up.numpy(), residual.numpy(), hidden.numpy(), first, cos, sin, keys, values, slots,
                        tables, seq_lens, threads, window)
        return gate_up, residual

    def _mlp_rest(self, gate_up: torch.Tensor, threads: int) -> torch.Tensor:
        """The activation and down projection after the gate/up projection."""
        return self.parallel.all_reduce(activate_and_down(gate_up, self.down, self.gelu, threads))


class NativeDecodePath:
    """A model's decode steps through ``_LayerProgram``s (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = [_LayerProgram(layer) for layer in model.layers]
        self.final_norm = NativeNorm(model.norm)

    @classmethod
    def build(cls, model: torch.nn.Module, layer_type: type) -> Optional["NativeDecodePath"]:
        """The path for ``model`` (a ``DecoderForCausalLM`` whose plain layers are
        ``layer_type``), or None where its layers or weights do not qualify."""
        if getattr(model, "scales_embeddings", True) or not _embeds_float32_cpu(model):
            return None
        if not NativeNorm.fits(model.norm) or not all(_LayerProgram.fits(layer, layer_type) for layer in model.layers):
            return None
        return cls(model)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: object,
        context_lens: Optional[torch.Tensor],
        aux_layers: tuple[int, ...] = (),
        captured: Optional[list[torch.Tensor]] = None,
    ) -> Optional[torch.Tensor]:
        """Final-normed hidden states [T, hidden] as ``DecoderForCausalLM.forward`` computes
        them, or None (nothing done) when this step is not one the path takes. With
        ``aux_layers``, the residual stream entering each of those layers is appended to
        ``captured`` (``DecoderForCausalLM.forward_capturing``)."""
        rows = input_ids.shape[0]
        fused_decode = getattr(attention, "fused_decode", None)
        if not 0 < rows <= gemv.MAX_ROWS or fused_decode is None:
            return None
        fused = fused_decode()
        if fused is None:
            return None
        model = self.model
        hidden = model.embed_tokens(input_ids)
        cos, sin = rope_rows(model.rotary.cos_sin(positions, hidden.dtype, context_lens), rows)
        local = None
        if model.local_rotary is not None:
            local = rope_rows(model.local_rotary.cos_sin(positions, hidden.dtype), rows)
        threads = torch.get_num_threads()
        residual: Optional[torch.Tensor] = None
        for index, program in enumerate(self.layers):
            if captured is not None and index in aux_layers:
                captured.append(hidden.clone() if residual is None else hidden + residual)
            layer_cos, layer_sin = local if local is not None and program.uses_local_rope else (cos, sin)
            hidden, residual = program.run(hidden, residual, layer_cos, layer_sin, fused, threads)
        return self.final_norm(hidden, residual, threads)


def rope_rows(cos_sin: tuple[torch.Tensor, torch.Tensor], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The rotary tables [T, 1, head_dim] as the kernel's [T, head_dim] arrays."""
    cos, sin = cos_sin
    return cos.reshape(rows, -1).contiguous().numpy(), sin.reshape(rows, -1).contiguous().numpy()


def _embeds_float32_cpu(model: torch.nn.Module) -> bool:
    """Whether the embeddings come out float32 on the CPU (a quantized tied embedding
    looks its rows up in the packed head: asked, not read off a weight)."""
    with torch.inference_mode():
        probe = model.embed_tokens(torch.zeros(1, dtype=torch.int64))
    return probe.dtype == torch.float32 and probe.device.type == "cpu"


def activate_and_down(gate_up: torch.Tensor, down: NativeLinear, gelu: bool, threads: int) -> torch.Tensor:
    """A gated MLP after its gate/up product [rows, 2 * inter]: the activation of the gate
    (GeLU-tanh or SiLU) times the up half, through ``down`` (this rank's term)."""
    inter = gate_up.shape[1] // 2
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    activated = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return down(activated.mul_(up), threads)


def dense_mlp_fits(mlp: GatedMLP) -> bool:
    """Whether both of a dense gated MLP's products go to the native kernels."""
    return NativeLinear.fits(mlp.gate_up_proj) and NativeLinear.fits(mlp.down_proj)


def _float32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()

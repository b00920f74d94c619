"""The Llama-family decoder: one implementation, four architectures here.

Llama 2/3, Mistral, Qwen2 and Qwen3 differ only in flags read from the config (qkv bias,
q/k norm, explicit head_dim, rope scaling, tied embeddings, sliding windows), so they
share this module; the per-architecture classes exist so ``architectures`` maps names to
types, as users expect. Families whose layers differ (Gemma: ``gemma.py``, Phi-3:
``phi3.py``) swap the layer, attention or MLP class through the ``*_class`` attributes.

The forward pass takes a flat batch of tokens (no padding): ``input_ids`` and
``positions`` of shape [T], plus an :class:`~pyengine.models.layers.AttentionOp` that owns
the KV cache layout. Logits are computed only for the rows the caller asks for.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from pyengine.models import cpu_linear, gemv
from pyengine.models.config import DecoderConfig
from pyengine.models.decode_path import NativeDecodePath
from pyengine.models.layers import AttentionOp, DecoderAttention, RMSNorm, WeightTarget
from pyengine.models.moe import build_mlp, mlp_checkpoint_name
from pyengine.models.parallel import ParallelContext
from pyengine.models.quantization.kernels import LinearWeight
from pyengine.models.quantization.linear import QuantizedMatmul
from pyengine.models.quantization.packed import QuantizationError
from pyengine.models.rope import RotaryEmbedding
from pyengine.models.vocab_parallel import VocabParallelEmbedding, vocab_target, zero_vocab_padding


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention block followed by a pre-norm gated MLP block (or experts)."""

    attention_class: type[torch.nn.Module] = DecoderAttention

    def __init__(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, layer_index, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.build_mlp(config, layer_index, parallel)
        # Gemma 3's sliding layers rotate with their own base (``config.local_rope``).
        self.uses_local_rope = config.local_rope is not None and config.layer_window(layer_index) is not None

    def build_mlp(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> torch.nn.Module:
        """The layer's MLP block: gated, or experts where the config puts them."""
        return build_mlp(config, layer_index, parallel)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionOp,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: ``residual`` is the sum so far (None before the
        first layer, whose input is the embeddings) and ``hidden`` the previous block's output,
        not yet added. Returns the MLP's output and the stream, updated in place."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed = self.input_layernorm.add_and_norm(hidden, residual)
        attended = self.self_attn(normed, cos, sin, attention)
        normed = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.mlp(normed), residual

    def pack_for_cpu(self) -> None:
        self.self_attn.pack_for_cpu()
        self.mlp.pack_for_cpu()

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {
            **self.input_layernorm.weight_targets(f"{prefix}.input_layernorm.weight"),
            **self.self_attn.weight_targets(f"{prefix}.self_attn"),
            **self.post_attention_layernorm.weight_targets(f"{prefix}.post_attention_layernorm.weight"),
            **self.mlp.weight_targets(f"{prefix}.{mlp_checkpoint_name(self.mlp)}"),
        }


# Checkpoint tensors that carry no weights we need (precomputed rope tables).
_IGNORED_CHECKPOINT_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


class DecoderForCausalLM(torch.nn.Module):
    """Embeddings, decoder layers, final norm and the LM head."""

    layer_class: type[DecoderLayer] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm
    scales_embeddings = False  # Gemma: embeddings times sqrt(hidden_size)

    def __init__(self, config: DecoderConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext()
        self.config = config
        self.parallel = parallel
        # Embedding and LM head: this rank's slice of the vocabulary (see vocab_parallel).
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = torch.nn.ModuleList(
            self.build_layer(config, index, parallel) for index in range(config.num_hidden_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # A tied model has no LM head parameter of its own (see ``output_embedding``).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else torch.nn.Linear(config.hidden_size, parallel.vocab_rows(config.vocab_size), bias=False)
        )
        self.rotary: RotaryEmbedding
        self.local_rotary: RotaryEmbedding | None
        self.build_rope_tables()
        self.packed_head: torch.Tensor | None = None
        self.quantized_head: QuantizedMatmul | None = None
        self.gemv_head: torch.Tensor | None = None
        # Decode steps without the module plumbing, once the weights are final (pack_for_cpu).
        self.decode_path: NativeDecodePath | None = None

    def build_layer(self, config: DecoderConfig, layer_index: int, parallel: ParallelContext) -> torch.nn.Module:
        """One decoder layer (an architecture with other layers overrides this)."""
        return self.layer_class(config, layer_index, parallel)

    def build_rope_tables(self) -> None:
        """(Re)compute the rotary tables (float32 on the current default device): the
        loader calls it after allocating the weights, as the tables are not loaded."""
        config = self.config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        local = config.local_rope
        self.local_rotary = (
            None if local is None else RotaryEmbedding(local, config.head_dim, config.max_position_embeddings)
        )

    def finish_loading(self) -> None:
        """Called once the weights are final: modules that precompute from their weights
        (Gemma's ``1 + weight`` norms) do it now."""
        for module in self.modules():
            if module is not self and hasattr(module, "finish_loading"):
                module.finish_loading()

    @property
    def output_embedding(self) -> torch.Tensor:
        """The LM head matrix [vocab, hidden] (the input embedding when tied); at tensor
        parallel size > 1, this rank's rows of it."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (what the KV cache must store per layer)."""
        return self.layers[0].self_attn.num_kv_heads

    @property
    def num_heads(self) -> int:
        return self.layers[0].self_attn.num_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionOp,
        context_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a flat batch of tokens.

        ``context_lens`` [T] (each token's sequence length after this step) matters only
        to longrope (``rotary.needs_context_lens``); see ``rope.py``."""
        return self.forward_capturing(input_ids, positions, attention, context_lens)[0]

    def forward_capturing(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionOp,
        context_lens: torch.Tensor | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, and with ``aux_layers`` (ascending layer indices) the residual stream
        entering each of those layers, concatenated per token [T, len(aux_layers) * hidden]
        (EAGLE-3's auxiliary hidden states: layer 0's input is the embeddings); None without."""
        captured: list[torch.Tensor] | None = [] if aux_layers else None
        if self.decode_path is not None:  # decode steps on CPU: the same kernels, no plumbing
            decoded = self.decode_path.forward(input_ids, positions, attention, context_lens, aux_layers, captured)
            if decoded is not None:
                return decoded, _concat(captured)
        hidden = self.embed_tokens(input_ids)
        if self.scales_embeddings:  # the multiplier in the weights' dtype, as transformers rounds it
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, context_lens)
        local = None if self.local_rotary is None else self.local_rotary.cos_sin(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            if captured is not None and index in aux_layers:
                captured.append(hidden.clone() if residual is None else hidden + residual)
            layer_cos, layer_sin = local if local is not None and layer.uses_local_rope else (cos, sin)
            hidden, residual = layer(hidden, residual, layer_cos, layer_sin, attention)
        out = self.norm(hidden) if residual is None else self.norm.add_and_norm(hidden, residual)
        return out, _concat(captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given hidden states [N, hidden] (gathered
        from every rank at tensor parallel size > 1: a collective, all ranks call it)."""
        return self.parallel.all_gather_vocab(self.local_logits(hidden), self.config.vocab_size)

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of this rank's vocabulary slice [N, vocab_rows] (padding columns
        past the vocabulary's end are zeros; every column at world size 1)."""
        if self.quantized_head is not None:
            logits = self.quantized_head(hidden).float()
        elif self.gemv_head is not None and gemv.applies(hidden):
            logits = gemv.float_linear(hidden, self.gemv_head)
        elif self.packed_head is not None:
            logits = cpu_linear.linear(hidden, self.packed_head)
        else:
            logits = F.linear(hidden, self.output_embedding).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), column by column
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def zero_padding(self) -> None:
        """Zero the vocabulary padding rows of the embedding and LM head (last rank only
        has any), so that weights loaded or filled leave nothing undefined."""
        zero_vocab_padding(self.embed_tokens.weight, self.config.vocab_size, self.parallel)
        if self.lm_head is not None:
            zero_vocab_padding(self.lm_head.weight, self.config.vocab_size, self.parallel)

    def pack_for_cpu(self) -> None:
        """Run every matmul through oneDNN with packed weights (see ``cpu_linear``).

        A no-op unless the weights are float32 on CPU, and when already packed. Call it
        after the weights are final: the dense linear weights are released. A tied LM head
        is packed as a copy, as the input embedding still needs the dense matrix (vocab x
        hidden more memory).
        """
        for layer in self.layers:
            layer.pack_for_cpu()
        self._pack_head()
        self.decode_path = NativeDecodePath.build(self, DecoderLayer)

    def _pack_head(self) -> None:
        if self.packed_head is not None or self.quantized_head is not None:
            return
        if not cpu_linear.can_pack(self.output_embedding):
            return
        self.packed_head = cpu_linear.pack(self.output_embedding)
        if self.output_embedding.shape[1] % gemv.CHUNK == 0:
            self.gemv_head = self.output_embedding.detach()  # tied: the embedding itself, no copy
        if self.lm_head is not None:
            cpu_linear.release_dense(self.lm_head)

    def set_packed_head(self, weight: LinearWeight) -> None:
        """Multiply by ``weight`` (this rank's vocabulary rows) in the LM head from now on.
        When tied, the embedding looks its rows up in it too, and no dense copy is kept."""
        rows, hidden = self.output_embedding.shape
        if (weight.out_features, weight.in_features) != (rows, hidden):
            raise QuantizationError(
                f"packed LM head is [{weight.out_features}, {weight.in_features}], the model's is [{rows}, {hidden}]"
            )
        self.quantized_head = QuantizedMatmul(weight)
        self.packed_head = None
        if self.lm_head is None:
            self.embed_tokens.use_packed(self.quantized_head)
        else:
            cpu_linear.release_dense(self.lm_head)

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Every checkpoint tensor the model needs, by Hugging Face name."""
        targets = dict(self.embed_tokens.weight_targets("model.embed_tokens.weight"))
        for index, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"model.layers.{index}"))
        targets.update(self.norm.weight_targets("model.norm.weight"))
        if self.lm_head is not None:
            targets["lm_head.weight"] = vocab_target(self.lm_head.weight, self.config.vocab_size, self.parallel)
        return targets

    def is_ignorable_checkpoint_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may carry that the model does not need."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return True
        return _IGNORED_CHECKPOINT_TENSORS.match(name) is not None


def _concat(captured: list[torch.Tensor] | None) -> torch.Tensor | None:
    return None if captured is None else torch.cat(captured, dim=-1)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2 / 3 (rope scaling ``llama3`` or ``linear``)."""


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral (``sliding_window`` on every layer when set)."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 (bias on q/k/v projections)."""


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense (RMSNorm on q and k, explicit head_dim)."""

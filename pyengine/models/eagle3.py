"""The EAGLE-3 head (Li et al., 2025), loaded from a checkpoint as its authors publish it.

Tensors (no ``model.`` prefix): ``fc.weight`` [H, 3H] (the three auxiliary hidden states
of the target to one), ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
.weight``, ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v read 2H inputs: the
token's embedding beside the hidden state), ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] (int64: draft
id ``i`` is target id ``i + d2t[i]``), ``t2d`` (its inverse mask, not needed here), and
sometimes ``embed_tokens.weight``; without it the head shares the target's embedding.

One head step at position ``p``: ``e`` = input_layernorm(embedding of the token at
``p + 1``), ``h`` the hidden state at ``p`` (the target's, through ``fc``, or the head's
own previous output), ``x`` = [e, hidden_norm(h)] -> attention (own paged cache, the
target's rope) -> + h -> post-attention norm -> MLP -> + residual = the next hidden state
(``prenorm``), and ``norm`` of it -> ``lm_head`` -> the draft-vocabulary logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pyengine.models import gemv
from pyengine.models.checkpoint import (
    check_names_and_shapes,
    checkpoint_files,
    checkpoint_shapes,
    iterate_tensors,
)
from pyengine.models.eagle3_config import NUM_AUX_LAYERS, Eagle3HeadConfig
from pyengine.models.eagle3_decode import HeadDecodeProgram
from pyengine.models.errors import ModelLoadError
from pyengine.models.greedy import greedy_tokens
from pyengine.models.layers import (
    AttentionOp,
    ColumnParallelLinear,
    DecoderAttention,
    GatedMLP,
    RMSNorm,
    WeightTarget,
)
from pyengine.models.loader import copy_into_target
from pyengine.models.parallel import ParallelContext
from pyengine.models.rope import RotaryEmbedding

_IGNORED = ("t2d",)


class Eagle3Head(torch.nn.Module):
    """The head's one layer, its fc, norm, LM head and vocabulary map (module docstring)."""

    def __init__(self, config: Eagle3HeadConfig, own_embedding: bool) -> None:
        super().__init__()
        layer = config.layer
        hidden = layer.hidden_size
        parallel = ParallelContext()
        self.config = config
        self.fc = torch.nn.Linear(NUM_AUX_LAYERS * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.self_attn = DecoderAttention(layer, 0, parallel)
        # q/k/v read [embedding, hidden state]: twice the width of a plain layer's input
        self.self_attn.qkv_proj = ColumnParallelLinear(2 * hidden, self.self_attn.qkv_proj.parts, layer.qkv_bias,
                                                       parallel)
        self.post_attention_layernorm = RMSNorm(hidden, layer.rms_norm_eps)
        self.mlp = GatedMLP(layer, parallel)
        self.norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.lm_head = torch.nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.embed_tokens = torch.nn.Embedding(layer.vocab_size, hidden) if own_embedding else None
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
        self.rotary: Optional[RotaryEmbedding] = None
        # Decode-row steps through the native kernels (``eagle3_decode``), set at load.
        self.decode_program: Optional[HeadDecodeProgram] = None

    def build_rope_tables(self, max_positions: int) -> None:
        """The rotary tables (float32, current default device) for ``max_positions``."""
        layer = self.config.layer
        self.rotary = RotaryEmbedding(layer.rope, layer.head_dim, max(max_positions, layer.max_position_embeddings))

    @property
    def num_kv_heads(self) -> int:
        return self.self_attn.num_kv_heads

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states [T, 3H] to the head's input hidden states [T, H]."""
        return self.fc(aux_hidden)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attention: AttentionOp
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step for a flat batch: ``embeds`` [T, H] of the tokens at ``positions + 1``,
        ``hidden`` [T, H] the states at ``positions``. Returns the final-normed output (for
        the logits) and the pre-norm one (the next step's ``hidden``)."""
        if self.decode_program is not None:  # proposal steps on CPU: the same kernels, no plumbing
            stepped = self.decode_program.forward(embeds, hidden, positions, attention)
            if stepped is not None:
                return stepped
        assert self.rotary is not None  # build_rope_tables ran at load
        e = self.input_layernorm(embeds)
        if self.config.norm_before_residual:
            h = self.hidden_norm(hidden)
            residual = h.clone()
        else:
            residual = hidden.clone()
            h = self.hidden_norm(hidden)
        x = torch.cat([e, h], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        attended = self.self_attn(x, cos, sin, attention)
        normed = self.post_attention_layernorm.add_and_norm(attended, residual)
        out = self.norm.add_and_norm(self.mlp(normed), residual)
        return out, residual

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Only the K/V ``forward`` would write for these tokens, into ``keys`` / ``values``
        (the cache's slots view) at ``slots``: the head's cache entries of committed
        positions, whose outputs nobody reads."""
        assert self.rotary is not None
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        k, v = self.self_attn.project_kv(x, *self.rotary.cos_sin(positions, x.dtype))
        keys.index_copy_(0, slots, k)
        values.index_copy_(0, slots, v)

    def draft_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """Each row's greedy draft, as a target token id [N] (int64)."""
        weight = self.lm_head.weight
        on_cpu = weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
        if on_cpu and gemv.applies(out):
            logits = gemv.float_linear(out, weight)  # a proposal step's rows: the decode-sized kernel
        else:
            logits = F.linear(out, weight)
        return self.draft_to_target[greedy_tokens(logits)]

    def _targets(self) -> dict[str, WeightTarget]:
        """Every tensor the checkpoint must hold (``d2t`` aside), by its published name."""
        targets = {
            **self.input_layernorm.weight_targets("midlayer.input_layernorm.weight"),
            **self.hidden_norm.weight_targets("midlayer.hidden_norm.weight"),
            **self.self_attn.weight_targets("midlayer.self_attn"),
            **self.post_attention_layernorm.weight_targets("midlayer.post_attention_layernorm.weight"),
            **self.mlp.weight_targets("midlayer.mlp"),
            **self.norm.weight_targets("norm.weight"),
        }
        for name, module in (("fc", self.fc), ("lm_head", self.lm_head), ("embed_tokens", self.embed_tokens)):
            if module is not None:
                targets[f"{name}.weight"] = WeightTarget(module.weight, tuple(module.weight.shape))
        return targets


def load_eagle3_head(folder: Path, config: Eagle3HeadConfig, dtype: torch.dtype, device: torch.device,
                     max_positions: int) -> Eagle3Head:
    """The head in ``folder`` (safetensors or .bin), names and shapes checked all at once;
    ``d2t`` is required when the draft vocabulary is smaller than the target's."""
    files = checkpoint_files(folder)
    shapes = checkpoint_shapes(files)
    own_embedding = "embed_tokens.weight" in shapes
    with torch.device("meta"):
        head = Eagle3Head(config, own_embedding)
    head = head.to_empty(device=device).to(dtype)
    head.draft_to_target = torch.arange(config.draft_vocab_size, device=device)  # identity unless d2t says
    with torch.device(device):
        head.build_rope_tables(max_positions)
    targets = head._targets()
    needs_map = config.draft_vocab_size < config.layer.vocab_size
    d2t_wrong = ([("d2t", (config.draft_vocab_size,), shapes["d2t"])]
                 if "d2t" in shapes and tuple(shapes["d2t"]) != (config.draft_vocab_size,) else [])
    check_names_and_shapes(targets, shapes, lambda name: name in ("d2t", *_IGNORED),
                           extra_missing=["d2t"] if needs_map and "d2t" not in shapes else [], extra_wrong=d2t_wrong)
    with torch.no_grad():
        for name, tensor in iterate_tensors(files):
            if name in targets:
                copy_into_target(targets[name], tensor)
            elif name == "d2t":
                head.draft_to_target = _target_ids(tensor, config, folder).to(device)
    head.eval().requires_grad_(False)
    head.self_attn.pack_for_cpu()
    head.mlp.pack_for_cpu()
    head.decode_program = HeadDecodeProgram.build(head)
    return head


def _target_ids(d2t: torch.Tensor, config: Eagle3HeadConfig, folder: Path) -> torch.Tensor:
    """``d2t``'s offsets as absolute target ids, each checked to be in the vocabulary."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ModelLoadError(f"{folder}: d2t must hold integers (offsets to target ids), got {d2t.dtype}")
    ids = torch.arange(config.draft_vocab_size, dtype=torch.int64) + d2t.to(torch.int64)
    vocab = config.layer.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ModelLoadError(f"{folder}: d2t maps draft ids outside the target's vocabulary (0 to {vocab - 1})")
    return ids

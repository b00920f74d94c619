"""YaRN rotary scaling against transformers: the frequencies and attention factor of the
published DeepSeek-V3 rope_scaling, and a Llama-family model (Qwen2) with a yarn
rope_parameters, logits for logits."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.config import parse_decoder_config
from pyengine.models.rope import rope_attention_factor, rope_inverse_frequencies
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner


def test_published_v3_yarn_tables_match_transformers():
    scaling = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096, "type": "yarn"}
    fields = dict(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=64,
                  kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
                  max_position_embeddings=163840, rope_scaling=scaling, rope_theta=10000)
    hf_config = transformers.DeepseekV3Config(**fields)
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    ours = parse_decoder_config({**fields, "architectures": ["DeepseekV3ForCausalLM"]})
    torch.testing.assert_close(rope_inverse_frequencies(ours.rope, ours.head_dim), theirs)
    assert rope_attention_factor(ours.rope) == their_factor != 1.0


def test_qwen2_with_yarn_matches_transformers(tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen2_yarn", "qwen2", rope_parameters=rope)
    runner = ModelRunner.from_pretrained(checkpoint, ExecutorConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=16))
    prompt = np.random.default_rng(1).integers(0, 512, 60).tolist()
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=4)
    planner.add(prompt)
    out = runner.execute(planner.next_plan(), return_hidden=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(runner.model.compute_logits(out.hidden_states), theirs, atol=2e-5, rtol=1e-5)

"""Mixture-of-experts models quantized at load (``quantization="int8"`` / ``"int4"``): the
routed experts are quantized with the linears (the routers stay float), and the model
matches Hugging Face transformers running the dequantized weights: prefill logits within
float32 rounding, greedy tokens equal (decode steps run the native integer kernels); at
tensor parallel size 2 the logits of size 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pyengine import LLM, SamplingParams
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.moe import SparseMoeBlock
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.dequantized import write_dequantized_checkpoint
from pyengine.testing.hand_plan import HandPlanner
from pyengine.testing.tp_ranks import generate_on_rank, run_ranks

# Every input width a multiple of 128 (int4's group): hidden, expert and shared sizes.
SHAPES = {
    "qwen3_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64),
    "qwen2_moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}
ATOL, RTOL = 1e-4, 1e-4
PROMPTS = [[5, 17, 300, 42, 7, 99, 100, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8, 9, 10]]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **SHAPES[request.param])


def _runner(path, method) -> ModelRunner:
    return ModelRunner.from_pretrained(path, ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                                                            quantization=method))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prefill_logits_match_the_dequantized_reference(checkpoint, method, tmp_path):
    runner = _runner(checkpoint, method)
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts.quantized is not None and b.experts.gate_up.device.type == "meta" for b in blocks)
    assert all(b.experts.quantized.gate_up_weight.bits == int(method[-1]) for b in blocks)
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, tmp_path / "dequantized")
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()
    prompt = list(range(3, 73))
    planner = HandPlanner(block_size=16, num_blocks=runner.num_kv_blocks, max_rows=8)
    planner.add(prompt)
    out = runner.execute(planner.next_plan(), return_hidden=True)
    ours = runner.model.compute_logits(out.hidden_states)
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0]
        original = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)(
            torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
    # The quantized model is a different model: further from the float one than the tolerance.
    assert float((ours - original).abs().max()) > 10 * ATOL


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_greedy_tokens_equal_the_dequantized_reference(checkpoint, method, tmp_path):
    runner = _runner(checkpoint, method)
    reference_path = write_dequantized_checkpoint(runner.model, checkpoint, tmp_path / "dequantized")
    del runner
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [reference.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
                  for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(checkpoint), quantization=method, max_model_len=256) as llm:
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert ours == theirs


def test_int4_experts_at_tensor_parallel_two_give_the_logits_of_one(tmp_path):
    """Each rank quantizes its slice of every expert; with every rank's share of the
    experts' (and attention's, MLP's) input features a multiple of int4's group of 128,
    the integers are those of the whole weight cut, so two ranks give one rank's logits.
    (int8's one scale per output channel is taken over a row-parallel shard's columns: a
    different quantization at each size, for the dense linears as for the experts.)"""
    shape = dict(SHAPES["qwen3_moe"], moe_intermediate_size=256)  # 128 features per rank
    checkpoint = make_tiny_checkpoint(tmp_path / "m", "qwen3_moe", **shape)
    generate_on_rank(str(checkpoint), str(tmp_path / "tp1.npy"), 0, 1, 0, PROMPTS, 6, "int4")
    run_ranks(checkpoint, tmp_path / "tp2.npy", 2, PROMPTS, 6, quantization="int4")
    one, two = np.load(tmp_path / "tp1.npy"), np.load(tmp_path / "tp2.npy")
    assert one.shape == two.shape and one.shape[0] >= 6
    np.testing.assert_allclose(two, one, atol=ATOL, rtol=RTOL)

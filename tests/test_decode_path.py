"""The native decode path (``pyengine.models.decode_path``) against the modules it stands in for.

It runs the same kernels in the same order on the same tensors, so a decode step's logits
must be bit-identical with it and without it, and so must every token; the tests also show
that it ran (and where it must not: prefill, draft verification, models whose layers differ).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.models.decode_path import NativeDecodePath
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner

VOCAB = 512


class _Counter:
    """Counts the steps ``NativeDecodePath.forward`` took and the ones it declined."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken = 0
        self.declined = 0
        original = NativeDecodePath.forward

        def counted(path, *args, **kwargs):
            out = original(path, *args, **kwargs)
            if out is None:
                self.declined += 1
            else:
                self.taken += 1
            return out

        monkeypatch.setattr(NativeDecodePath, "forward", counted)


def _runner(path, **overrides) -> ModelRunner:
    settings = dict(max_num_seqs=4, max_model_len=256, num_kv_blocks=96, attention_backend="sdpa")
    settings.update(overrides)
    return ModelRunner.from_pretrained(path, ExecutorConfig(**settings))


def _planner(prompt_lengths: list[int], seed: int) -> HandPlanner:
    planner = HandPlanner(num_blocks=96, max_rows=len(prompt_lengths), seed=seed)
    rng = np.random.default_rng(seed)
    for length in prompt_lengths:
        planner.add(rng.integers(0, VOCAB, size=length).tolist(), SamplingParams(temperature=0.0, max_tokens=200))
    return planner


def _logits_and_tokens(runner: ModelRunner, prompt_lengths: list[int], steps: int, seed: int = 0):
    """Each step's logits and sampled tokens (the plan prefills first, then decodes)."""
    planner = _planner(prompt_lengths, seed)
    logits, tokens = [], []
    for _ in range(steps):
        plan = planner.next_plan()
        out = runner.execute(plan, return_logits=True)
        planner.record(plan, out.sampled_token_ids)
        logits.append(out.logits.clone())
        tokens.append(out.sampled_token_ids.tolist())
    return logits, tokens


# (architecture, checkpoint overrides, runner settings)
CASES = {
    "qwen3": ("qwen3", {}, {}),  # q/k norm
    "llama": ("llama", {}, {}),
    "qwen2-bias": ("qwen2", {}, {}),  # qkv bias, 5 heads
    "mistral-window": ("mistral_window", {}, {}),  # contexts pass the 20-token window
    "qwen3-moe": ("qwen3_moe", {}, {}),  # the experts run as their module
    "qwen3-int8": ("qwen3", {}, {"quantization": "int8"}),
    # int4's groups of 128 input features
    "qwen3-int4": ("qwen3", {"hidden_size": 128, "intermediate_size": 256}, {"quantization": "int4"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_steps_are_bit_identical_with_and_without_the_path(case, tmp_path, monkeypatch):
    arch, overrides, settings = CASES[case]
    folder = make_tiny_checkpoint(tmp_path / case, arch, vocab_size=VOCAB, **overrides)
    with_path = _runner(folder, **settings)
    without = _runner(folder, **settings)
    assert with_path.model.decode_path is not None
    # Dense layers run their front as one native call (_kernels.DecodeLayer); MoE ones do not.
    programs = with_path.model.decode_path.layers
    assert [program.native is not None for program in programs] == [program.dense_mlp for program in programs]
    assert any(program.dense_mlp for program in programs)
    without.model.decode_path = None
    counter = _Counter(monkeypatch)
    lengths = [3, 17, 30]  # unequal contexts; 30 + 30 decodes passes mistral's window of 20
    logits_a, tokens_a = _logits_and_tokens(with_path, lengths, 32)
    logits_b, tokens_b = _logits_and_tokens(without, lengths, 32)
    assert tokens_a == tokens_b
    for step, (a, b) in enumerate(zip(logits_a, logits_b)):
        assert torch.equal(a, b), f"step {step}: logits differ by {float((a - b).abs().max())}"
    assert counter.taken >= 30  # every decode step took the path
    assert counter.declined >= 1  # the prefill did not


@pytest.mark.parametrize("case", ["qwen3", "qwen2-bias", "mistral-window", "qwen3-int8"])
def test_the_layers_separate_calls_are_bit_identical_too(case, tmp_path):
    # The native fronts (_kernels.DecodeLayer) off: each layer's kernels called one at a
    # time from Python, as with tensor parallelism or permuted inputs (GPTQ act order).
    arch, overrides, settings = CASES[case]
    folder = make_tiny_checkpoint(tmp_path / case, arch, vocab_size=VOCAB, **overrides)
    separate = _runner(folder, **settings)
    for program in separate.model.decode_path.layers:
        program.native = None
    modules = _runner(folder, **settings)
    modules.model.decode_path = None
    logits_a, tokens_a = _logits_and_tokens(separate, [3, 17, 30], 24)
    logits_b, tokens_b = _logits_and_tokens(modules, [3, 17, 30], 24)
    assert tokens_a == tokens_b
    for step, (a, b) in enumerate(zip(logits_a, logits_b)):
        assert torch.equal(a, b), f"step {step}: logits differ by {float((a - b).abs().max())}"


def test_mixed_prefill_and_decode_steps_run_the_modules(tmp_path, monkeypatch):
    runner = _runner(make_tiny_checkpoint(tmp_path / "m", "qwen3", vocab_size=VOCAB))
    counter = _Counter(monkeypatch)
    planner = HandPlanner(num_blocks=96, max_rows=2, seed=1)
    planner.add(list(range(5)), SamplingParams(temperature=0.0))
    for _ in range(3):
        plan = planner.next_plan()
        planner.record(plan, runner.execute(plan).sampled_token_ids)
    taken = counter.taken
    planner.add(list(range(40)), SamplingParams(temperature=0.0))  # a prefill joins the decodes
    plan = planner.next_plan()
    assert max(plan.num_scheduled_tokens) > 1 and min(plan.num_scheduled_tokens) == 1
    planner.record(plan, runner.execute(plan).sampled_token_ids)
    assert counter.taken == taken  # declined: not every token is a decode row


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "deepseek_v2"])
def test_models_whose_layers_differ_have_no_path(arch, tmp_path):
    runner = _runner(make_tiny_checkpoint(tmp_path / arch, arch, vocab_size=VOCAB))
    assert getattr(runner.model, "decode_path", None) is None


def test_bfloat16_models_have_no_path(tmp_path):
    runner = _runner(make_tiny_checkpoint(tmp_path / "bf16", "qwen3", vocab_size=VOCAB), dtype="bfloat16")
    assert runner.model.decode_path is None

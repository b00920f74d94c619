"""Plans without tokens at tensor-parallel size 2 (real worker process): rank 0 runs them
alone instead of publishing them. Published, such a plan ends in no collective, so the
next plan could overwrite the shared segment before the worker had read it (the worker
then stopped out of step, or read a torn plan). One that carries block-table writes is
refused with a clear error, and the group stays in step either way: the following steps
give the logits of size 1."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pyengine.executor.config import ExecutorConfig
from pyengine.executor.model_runner import ModelRunner
from pyengine.executor.tensor_parallel.runner import TokenlessPlanError, start
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.hand_plan import HandPlanner
from pyengine.testing.waits import wait_until

CONFIG = ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=256)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp_tokenless") / "qwen3", "qwen3", seed=11)


def drive(runner, with_block_writes: bool = False) -> tuple[list[np.ndarray], list[str]]:
    """The same hand-made steps on ``runner``: prefill, decodes, then (three times) a
    sequence finishes and a tokenless plan frees its row, the next decode following it at
    once. Returns every real step's logits, and the errors the tokenless plans raised."""
    planner = HandPlanner(block_size=runner.block_size, num_blocks=runner.num_kv_blocks, max_rows=8,
                          scatter_blocks=True)
    seqs = [planner.add(prompt, SamplingParams(temperature=0.0)) for prompt in PROMPTS]
    logits, errors = [], []
    channel = getattr(runner, "channel", None)  # rank 0's plan channel (tensor parallel only)

    def step() -> None:
        plan = planner.next_plan(max_chunk=16)
        result = runner.execute(plan, return_logits=True)
        planner.record(plan, result.sampled_token_ids)
        logits.append(result.logits.numpy().copy())

    for _ in range(3):
        step()
    for seq in seqs[:2] + [None]:
        if seq is not None:
            planner.finish(seq)
        tokenless = planner.next_plan(max_tokens=0)
        assert len(tokenless.input_ids) == 0
        if with_block_writes:
            tokenless = dataclasses.replace(
                tokenless, block_table_rows=np.array([7]), block_table_cols=np.array([0]),
                block_table_ids=np.array([1]),
            )
        if channel is not None:  # the worker has stopped polling and sleeps on its step pipe
            assert wait_until(lambda: channel.segment.asleep[0] == 1, 30, interval=0.005)
        try:
            out = runner.execute(tokenless)
            assert len(out.sampled_token_ids) == 0
        except TokenlessPlanError as error:
            errors.append(str(error))
        step()  # published right after the tokenless plan
        step()
    return logits, errors


@pytest.fixture(scope="module")
def reference(qwen3):
    runner = ModelRunner.from_pretrained(qwen3, CONFIG)
    return drive(runner)[0]


@pytest.mark.parametrize("with_block_writes", [False, True])
def test_tokenless_plans_leave_the_workers_in_step(qwen3, reference, with_block_writes):
    runner = start(qwen3, CONFIG, 2, timeout_s=60.0)
    try:
        logits, errors = drive(runner, with_block_writes)
        assert runner.dead_reason() is None
        if with_block_writes:
            assert len(errors) == 3 and all("block-table write" in e for e in errors), errors
        else:
            assert errors == []
        assert len(logits) == len(reference)
        for two, one in zip(logits, reference):
            np.testing.assert_allclose(two, one, atol=1e-4, rtol=1e-4)
    finally:
        runner.close()
    assert all(worker.process.poll() == 0 for worker in runner.workers)

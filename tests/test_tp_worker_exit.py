"""A tensor-parallel worker that fails while serving, with any exception (not only a
failed collective), logs it and leaves through the same ``os._exit`` as a clean exit:
exit code 1, never the interpreter's teardown (where gloo's threads can abort the rank
with SIGABRT); rank 0 then reports the worker's exit."""

from __future__ import annotations

import pytest

from pyengine.errors import EngineDeadError
from pyengine.executor.config import ExecutorConfig
from pyengine.executor.tensor_parallel.runner import start
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import ESCAPE_TOKEN
from pyengine.testing.hand_plan import HandPlanner

CONFIG = ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp_worker_exit") / "qwen3", "qwen3", seed=13)


def test_a_worker_whose_step_loop_raises_logs_it_and_exits_with_code_1(qwen3, capfd):
    runner = start(qwen3, CONFIG, 2, timeout_s=60.0, step_wrapper="pyengine.testing.faults:escape_rank1_step")
    try:
        planner = HandPlanner(block_size=runner.block_size, num_blocks=runner.num_kv_blocks, max_rows=8)
        planner.add([5, 6, 7], SamplingParams(temperature=0.0))
        plan = planner.next_plan()
        planner.record(plan, runner.execute(plan).sampled_token_ids)  # a healthy step first
        planner.add([5, ESCAPE_TOKEN, 7], SamplingParams(temperature=0.0))
        with pytest.raises(EngineDeadError, match="rank 1 .* exited with code 1"):
            runner.execute(planner.next_plan())
        worker = runner.workers[0]
        assert worker.process.wait(timeout=10) == 1
    finally:
        runner.close()
    err = capfd.readouterr().err
    assert "tensor-parallel rank 1 failed while serving" in err, err
    assert "LookupError: injected: rank 1's step loop broke" in err, err

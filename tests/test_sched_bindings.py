"""The native scheduler driven synchronously: plan arrays, results, errors, panics."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pyengine
from pyengine import (
    DuplicateRequestError,
    EngineError,
    InvalidConfigError,
    InvalidRequestError,
    Request,
    Scheduler,
    SchedulerConfig,
    StepResultError,
    UnknownRequestError,
)
from pyengine.devtools.fake_executor import FakeExecutor


def make(num_blocks: int = 64, **kw) -> Scheduler:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 128)
    return Scheduler(SchedulerConfig(num_blocks, **kw))


def test_plan_arrays_follow_the_contract():
    s = make(pipeline_depth=2)
    s.add_request(Request("a", list(range(6)), max_tokens=3, ignore_eos=True))
    plan = s.schedule()
    assert plan.step_id == 0
    assert plan.rows.dtype == np.int32 and plan.input_ids.dtype == np.int64
    assert plan.query_start_loc.tolist() == [0, 6]
    assert plan.positions.tolist() == list(range(6))
    table = dict(zip(plan.block_table_cols.tolist(), plan.block_table_ids.tolist()))
    assert plan.slot_mapping.tolist() == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert plan.logits_indices.tolist() == [5] and plan.sample_rows.tolist() == plan.rows.tolist()
    assert plan.new_token_ids.tolist() == list(range(6))
    assert plan.new_token_offsets.tolist() == [0, 6]
    nxt = s.schedule()  # depth 2: planned before the first result
    assert nxt.input_ids.tolist() == [pyengine.PLACEHOLDER_TOKEN]
    assert nxt.new_rows.size == 0
    s.apply_result(plan.step_id, np.array([9], dtype=np.int64))
    ev = s.take_output(plan.step_id)
    assert ev.step_id == 0 and ev.token_ids.tolist() == [9]


def test_requests_run_to_completion_and_free_every_block():
    s = make()
    ex = FakeExecutor(vocab=50)
    for i in range(5):
        s.add_request(Request(f"r{i}", [i + 1] * (3 + i), max_tokens=6, ignore_eos=True))
    produced = 0
    while s.has_unfinished():
        plan = s.schedule()
        s.apply_result(plan.step_id, ex.run(plan))
        produced += s.take_output().token_ids.size
        s.check_invariants()
    assert produced == 30
    stats = s.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(InvalidConfigError, match="block_size"):
        SchedulerConfig(10, block_size=0)
    with pytest.raises(InvalidConfigError, match="pipeline_depth"):
        SchedulerConfig(10, pipeline_depth=3)
    with pytest.raises(InvalidConfigError, match="policy"):
        SchedulerConfig(10, policy="random")
    with pytest.raises(InvalidConfigError, match="num_blocks"):
        SchedulerConfig(-1)
    s = make(num_blocks=4)
    with pytest.raises(InvalidRequestError, match="empty"):
        s.add_request(Request("x", []))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        s.add_request(Request("x", [1] * 120, max_tokens=20))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        s.add_request(Request("x", [1] * 20, max_tokens=10))
    with pytest.raises(InvalidRequestError, match="token id"):
        Request("x", [1, -2])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        Request("x", [1], max_tokens=-1)
    with pytest.raises(InvalidRequestError, match=r"sample_params\[1\] is None"):
        Request("x", [1], n=2, sample_params=[object(), None])
    with pytest.raises(InvalidRequestError, match="sample attachments for n = 2"):
        s.add_request(Request("x", [1], n=2, sample_params=[object()]))
    s.add_request(Request("dup", [1], max_tokens=2))
    with pytest.raises(DuplicateRequestError):
        s.add_request(Request("dup", [1], max_tokens=2))
    with pytest.raises(UnknownRequestError):
        s.finish(10_000)
    with pytest.raises(InvalidRequestError, match="finish reason"):
        s.finish(0, reason="because")
    plan = s.schedule()
    with pytest.raises(StepResultError, match="plan order"):
        s.apply_result(plan.step_id + 5, [1])
    with pytest.raises(StepResultError, match="tokens came back"):
        s.apply_result(plan.step_id, [1, 2, 3])
    # Every error is an EngineError, and request errors are also ValueErrors.
    assert issubclass(InvalidRequestError, EngineError) and issubclass(InvalidRequestError, ValueError)
    s.apply_result(plan.step_id, [1])


def test_abort_and_finish_report_what_happened():
    s = make()
    s.add_request(Request("a", [1, 2, 3], max_tokens=5))
    first = s.add_request(Request("b", [4, 5], max_tokens=5, n=2))
    assert s.abort("a") is True
    assert s.abort("a") is False  # already gone: not an error
    assert s.finish(first + 1, "stop") is True
    ev = s.take_output()
    assert ev.step_id is None
    reasons = [pyengine.FINISH_REASONS[r] for r in ev.finish_reasons]
    assert reasons == ["abort", "stop"]


def test_a_rust_panic_is_an_engine_error_not_a_crash(tmp_path):
    # Caught at the binding: NativePanicError (an EngineError and an Exception), not pyo3's
    # PanicException (a BaseException that `except Exception` misses); the interpreter and
    # the scheduler object go on.
    code = (
        "from pyengine import Scheduler, SchedulerConfig\n"
        "from pyengine.errors import EngineError, NativePanicError\n"
        "s = Scheduler(SchedulerConfig(8))\n"
        "try:\n"
        "    s._panic()\n"
        "except EngineError as e:\n"
        "    print('caught', type(e).__name__, isinstance(e, NativePanicError), str(e))\n"
        "print('alive', s.has_unfinished())\n"
    )
    # Run outside the source tree, so the installed package (with its native module) is used.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert "caught NativePanicError True" in out.stdout and "requested by Scheduler._panic()" in out.stdout
    assert "alive False" in out.stdout


def test_version_and_public_surface():
    assert pyengine.__version__.count(".") == 2
    assert set(pyengine.FINISH_REASONS) == {"stop", "length", "abort", "pooled", "error", "dead_end"}
    for name in pyengine.__all__:
        assert hasattr(pyengine, name), name

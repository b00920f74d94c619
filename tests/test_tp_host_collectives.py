"""The shared-memory collectives of tensor-parallel ranks on one host: sums that are the
same bits on every rank, chunked transfers, the gather; a peer killed inside an
all-reduce makes the engine dead within seconds naming it; no segment outlives its
engine, however the engine ends."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker

import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.errors import EngineDeadError, ModelLoadError
from pyengine.executor.tensor_parallel import host_collectives
from pyengine.executor.tensor_parallel.host_collectives import SEGMENT_PREFIX, HostCollectives
from pyengine.executor.tensor_parallel.runner import start
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import DIE_TOKEN, FaultySink
from pyengine.testing.waits import pid_alive

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)


def pair(slot_bytes: int = 4096) -> tuple[HostCollectives, HostCollectives]:
    """Rank 0 and rank 1 of one group, both in this process (driven by two threads)."""
    zero = HostCollectives(0, 2, timeout_s=30.0, slot_bytes=slot_bytes)
    one = HostCollectives(1, 2, timeout_s=30.0, name=zero.name, slot_bytes=slot_bytes)
    # In one process, rank 1's unregistration from the resource tracker also dropped rank 0's.
    resource_tracker.register(zero.shm._name, "shared_memory")  # type: ignore[attr-defined]
    return zero, one


def on_both(zero, one, work0, work1):
    """Runs work1(one) on a thread and work0(zero) here; returns both results."""
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("one", work1(one)))
    thread.start()
    try:
        result["zero"] = work0(zero)
    finally:
        thread.join(60)
    assert not thread.is_alive()
    return result["zero"], result["one"]


def segments_of(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"{SEGMENT_PREFIX}_{pid}_")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_ranks_get_the_same_bits_as_a_sum_in_rank_order(dtype):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(32, 256, generator=gen).to(dtype) * 10 ** r for r in range(2)]
    expected = (parts[0].float() + parts[1].float()).to(dtype)
    zero, one = pair(slot_bytes=4096)  # 32 x 256 x 4 bytes: eight chunks at float32
    try:
        for _ in range(3):  # both banks of the segment are reused
            a, b = parts[0].clone(), parts[1].clone()
            on_both(zero, one, lambda g, a=a: g.all_reduce(a), lambda g, b=b: g.all_reduce(b))
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
            assert torch.equal(a, expected)
    finally:
        one.close()
        zero.close()
    assert not os.path.exists(f"/dev/shm/{zero.name}")


def test_a_strided_tensor_is_summed_in_place_and_the_gather_lands_each_rank_in_its_row():
    zero, one = pair(slot_bytes=256)
    try:
        a = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
        b = torch.ones(3, 4).t()
        on_both(zero, one, lambda g: g.all_reduce(a), lambda g: g.all_reduce(b))
        assert torch.equal(a, torch.arange(12.0).reshape(3, 4).t() + 1) and torch.equal(a, b)
        out = torch.zeros(2, 300)
        on_both(zero, one, lambda g: g.gather(torch.full((300,), 3.0), out), lambda g: g.gather(torch.full((300,), 7.0), None))
        assert torch.equal(out[0], torch.full((300,), 3.0)) and torch.equal(out[1], torch.full((300,), 7.0))
        assert zero.accepts(a) and not zero.accepts(a.double())
    finally:
        one.close()
        zero.close()


def test_a_peer_that_never_comes_fails_the_all_reduce_within_its_timeout():
    zero = HostCollectives(0, 2, timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1 did not reach"):
            zero.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5
    finally:
        zero.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp_shm") / "qwen3", "qwen3", seed=5)


def test_a_worker_killed_inside_the_shared_memory_all_reduce_makes_the_engine_dead_naming_it(qwen3):
    config = EngineConfig(model=str(qwen3), tensor_parallel_size=2, **ENGINE)
    runner = start(qwen3, config.executor_config(), 2, step_wrapper="pyengine.testing.faults:kill_rank1_in_all_reduce")
    core = EngineCore(config, runner=runner)
    try:
        assert runner.model.parallel.local is not None, "the CPU group should use shared memory"
        assert segments_of(os.getpid()) == [], "the segments' names go once every rank mapped them"
        sink = FaultySink(fail_on=0)
        t0 = time.monotonic()
        core.add_request("dies", None, [5, DIE_TOKEN, 7], SamplingParams(temperature=0.0, max_tokens=4), sink)
        assert sink.done.wait(30), "the caller was left waiting"
        assert time.monotonic() - t0 < 15
        assert "rank 1" in str(sink.error), sink.error
        deadline = time.monotonic() + 10
        while core.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not core.is_alive
        assert "rank 1" in core.dead_reason() and "-9" in core.dead_reason()
        with pytest.raises(EngineDeadError, match="rank 1"):
            core.add_request("after", None, [5, 6], SamplingParams(max_tokens=2), FaultySink(fail_on=0))
    finally:
        core.shutdown()
    assert runner.workers[0].process.poll() is not None


@pytest.mark.parametrize("wrapper", ["fail_rank1_load", "fail_rank1_runner"])
def test_a_start_up_that_fails_leaves_no_segment(qwen3, wrapper):
    config = EngineConfig(model=str(qwen3), tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ModelLoadError, match="rank 1"):
        start(qwen3, config.executor_config(), 2, step_wrapper=f"pyengine.testing.faults:{wrapper}", timeout_s=60.0)
    assert segments_of(os.getpid()) == []


def test_the_switch_sends_every_collective_through_gloo_with_the_same_tokens(qwen3):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    tokens = {}
    for disabled in (False, True):
        with LLM(str(qwen3), tensor_parallel_size=2, disable_custom_all_reduce=disabled, **ENGINE) as llm:
            assert (llm.engine_core.runner.model.parallel.local is None) == disabled
            tokens[disabled] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[False] == tokens[True]


# The current folder off sys.path, so that the child imports the installed package (as
# pyengine/processes/child_command.py does for the engine's own children).
_KILLED_ENGINE = """
import sys
sys.path = [p for p in sys.path if p]
from pyengine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
print(llm.engine_core.runner.workers[0].process.pid, flush=True)
while True:
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    print("generated", flush=True)
"""


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next stdout line, or "" when none comes within ``timeout``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""  # type: ignore[union-attr]


def test_a_killed_engine_leaves_no_segment_and_its_worker_exits(qwen3):
    """SIGKILL to rank 0 in the middle of steps: the worker (waiting in a collective or on
    its step pipe) exits within seconds, and no shared segment of the group remains."""
    engine = subprocess.Popen([sys.executable, "-c", _KILLED_ENGINE, str(qwen3)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    worker = None
    try:
        line = read_line(engine, 120)
        assert line.strip().isdigit(), "the engine did not start"
        worker = int(line)
        # One generate done: the loop has started the next, so the kill lands among its steps.
        assert read_line(engine, 60).strip() == "generated", "no generate finished"
        engine.kill()
        engine.wait(timeout=10)
        deadline = time.monotonic() + 15
        while pid_alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(worker), "the worker outlived rank 0"
        assert segments_of(engine.pid) == []
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait(timeout=10)
        if worker is not None and pid_alive(worker):
            os.kill(worker, signal.SIGKILL)



def test_a_shared_memory_tmpfs_too_full_falls_back_to_gloo_with_a_warning(qwen3, monkeypatch, caplog):
    """A /dev/shm without room for the segment would SIGBUS the first rank that touches a
    page past the end of the free space: rank 0 checks first and lets gloo carry the
    collectives, saying why with the sizes; the tokens stay those of the segment's path."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(str(qwen3), tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.engine_core.runner.model.parallel.local is not None
        expected = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)]
    monkeypatch.setattr(host_collectives, "free_shared_memory_bytes", lambda path="/dev/shm": 3 << 20)
    with caplog.at_level("WARNING", logger=host_collectives.__name__):
        with LLM(str(qwen3), tensor_parallel_size=2, **ENGINE) as llm:
            assert llm.engine_core.runner.model.parallel.local is None, "the segment was made without room for it"
            tokens = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)]
    assert tokens == expected
    warning = caplog.text
    assert "/dev/shm has 3.0 MiB free" in warning and "need 16.0 MiB" in warning and "gloo" in warning, warning

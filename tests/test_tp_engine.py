"""The engine at tensor-parallel size 2 (rank 0 in the executor thread, one gloo worker
process) gives the tokens of size 1: greedy on every architecture, seeded sampling and
logprobs, prefix caching, preemption and n > 1; and its failures are those of size 1."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.config import EngineConfig
from pyengine.engine.core import EngineCore
from pyengine.errors import EngineDeadError, InvalidConfigError, ModelLoadError
from pyengine.executor.tensor_parallel.runner import start
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.faults import POISON_TOKEN, FaultySink
from pyengine.testing.waits import wait_until

# Greedy parity variants: GQA split, a single KV head (replicated), q/k/v bias with tied
# embeddings, q/k norm with an explicit head_dim; Gemma's windows, soft-caps and norms;
# Phi-3's fused tensors cut per part (tests/test_tp_phi3.py: its long factors); a window
# on every layer (blocks behind it freed by the scheduler) shorter than the prompts.
VARIANTS = {
    "llama": ("llama", {}),
    "mistral_one_kv_head": ("mistral", {}),
    "qwen2_bias_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("qwen3", {}),
    "gemma2_window_softcap": ("gemma2", {}),
    "gemma3_local_rope": ("gemma3", {}),
    "phi3_fused": ("phi3", {}),
    "mistral_window": ("mistral_window", {}),
}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
NEAR_TIE = 1e-3


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 400, 24).tolist()
    return [(shared if i % 2 else []) + rng.integers(3, 400, int(rng.integers(2, 30))).tolist() for i in range(count)]


def run(path, tp: int, batch, params, embed=(), **engine) -> tuple[list, Any, list]:
    """(outputs of each prompt, engine stats, embeddings of the ``embed`` prompts)."""
    with LLM(str(path), tensor_parallel_size=tp, **{**ENGINE, **engine}) as llm:
        outs = llm.generate(batch, params, use_tqdm=False)
        stats = llm.stats()
        # Pooling requests run the same sharded forward; rank 0 pools the all-reduced states.
        embeddings = [o.outputs.embedding for o in llm.embed(list(embed), use_tqdm=False)] if embed else []
    return [o.outputs for o in outs], stats, embeddings


def assert_same_tokens(one, two):
    """Token for token, except that from a near-tie on (top two logprobs of size 1 closer
    than NEAR_TIE) the rest of that sequence may differ."""
    assert len(one) == len(two)
    for a, b in zip(one, two):
        diverged = False
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                top = sorted((v.logprob for v in a.logprobs[i].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, f"position {i}: {a.token_ids} vs {b.token_ids}"
                diverged = True
                break
        if not diverged:  # same tokens as far as both go: then both went as far
            assert len(a.token_ids) == len(b.token_ids), f"{a.token_ids} vs {b.token_ids}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_at_two_ranks_equal_one(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = make_tiny_checkpoint(tmp_path / variant, arch, seed=3, **overrides)
    batch = prompts(1, 6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    one, _, _ = run(path, 1, batch, params)
    two, _, _ = run(path, 2, batch, params)
    assert_same_tokens([o[0] for o in one], [o[0] for o in two])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "qwen3", "qwen3", seed=5)


def test_seeded_sampling_logprobs_prefix_cache_preemption_n_and_embeddings(qwen3):
    """One engine per size, small enough a KV pool to preempt, shared prefixes, n = 2; then
    embeddings (pooled on rank 0 from the all-reduced hidden states)."""
    batch = prompts(2, 8)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, n=2, max_tokens=16, ignore_eos=True, logprobs=3)
    engine = dict(num_kv_blocks=12, max_num_seqs=6)
    one, _, embeddings_one = run(qwen3, 1, batch, params, embed=batch[:3], **engine)
    two, stats_two, embeddings_two = run(qwen3, 2, batch, params, embed=batch[:3], **engine)
    assert stats_two.preemptions > 0 and stats_two.prefix_cache_hit_rate > 0
    assert len(embeddings_two) == 3
    np.testing.assert_allclose(np.array(embeddings_two), np.array(embeddings_one), atol=1e-5)
    for samples_one, samples_two in zip(one, two):
        assert len(samples_two) == 2
        for a, b in zip(samples_one, samples_two):
            assert a.token_ids == b.token_ids
            for lp_a, lp_b in zip(a.logprobs, b.logprobs):
                assert lp_a.keys() == lp_b.keys()
                np.testing.assert_allclose([v.logprob for v in lp_b.values()], [v.logprob for v in lp_a.values()],
                                           atol=1e-4)
                assert [v.rank for v in lp_b.values()] == [v.rank for v in lp_a.values()]


def test_sizes_that_do_not_split_are_refused_before_any_process(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")  # 4 heads, intermediate 128
    children_before = _children()
    with pytest.raises(InvalidConfigError, match="num_attention_heads"):
        LLM(str(path), tensor_parallel_size=3)
    assert _children() == children_before
    with pytest.raises(InvalidConfigError, match="tensor_parallel_size"):
        EngineConfig(model=str(path), tensor_parallel_size=0)


@pytest.mark.parametrize("wrapper, message", [
    ("fail_rank1_join", "rank 1.*injected: rank 1 has no device"),
    ("fail_rank1_load", "rank 1.*injected: rank 1 cannot read its shard"),
    ("fail_rank1_runner", "rank 1.*injected: rank 1 cannot allocate its KV cache"),
])
def test_a_rank_that_fails_to_start_stops_start_up_naming_it(qwen3, wrapper, message):
    """Whatever stage rank 1 fails in, start-up stops with its error (soon, not after the
    store's timeout), no worker is left and torch's thread count is restored."""
    config = EngineConfig(model=str(qwen3), tensor_parallel_size=2, **ENGINE)
    threads = torch.get_num_threads()
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=message):
        start(qwen3, config.executor_config(), 2, step_wrapper=f"pyengine.testing.faults:{wrapper}", timeout_s=60.0)
    assert time.monotonic() - t0 < 50, "rank 0 waited for a timeout instead of the worker's report"
    assert _workers() == set()
    assert torch.get_num_threads() == threads


def test_a_rank_that_fails_inside_the_join_stops_start_up_with_its_own_error(qwen3):
    """Rank 1 said hello, then failed in the process group's join, where rank 0 is
    joining too: rank 0's join waits out the store's timeout (it cannot be interrupted),
    then start-up stops with rank 1's own error, not only the store's timeout; and a
    later start-up in the same process works (torch's group counter is not left behind)."""
    config = EngineConfig(model=str(qwen3), tensor_parallel_size=2, **ENGINE)
    threads = torch.get_num_threads()
    with pytest.raises(ModelLoadError, match="rank 1 failed to start .join.*injected: rank 1 cannot reach") as caught:
        # The timeout is also how long rank 1 has to start and say hello: 8 s failed at
        # "hello" when other work loaded the 2 cores (load average 20), so 20 s.
        start(qwen3, config.executor_config(), 2, step_wrapper="pyengine.testing.faults:fail_rank1_in_group_join",
              timeout_s=20.0)
    assert "timeout" in str(caught.value.__cause__)  # rank 0's own failure, kept as the cause
    assert _workers() == set()
    assert torch.get_num_threads() == threads
    assert not torch.distributed.is_initialized()
    runner = start(qwen3, config.executor_config(), 2, timeout_s=60.0)
    runner.close()
    assert _workers() == set()


def test_an_engine_that_fails_after_loading_closes_its_tensor_parallel_runner(qwen3, monkeypatch):
    threads = torch.get_num_threads()

    def broken_scheduler(*args, **kwargs):
        raise RuntimeError("injected: the scheduler cannot start")

    monkeypatch.setattr("pyengine.engine.core.SchedulerThread", broken_scheduler)
    with pytest.raises(RuntimeError, match="scheduler cannot start"):
        LLM(str(qwen3), tensor_parallel_size=2, **ENGINE)
    assert _workers() == set()
    assert torch.get_num_threads() == threads


def _workers() -> set[int]:
    """Live tensor-parallel worker processes started by this test process."""
    found = set()
    for pid in _children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"tensor_parallel.worker" in cmdline.read():
                    found.add(pid)
        except OSError:
            pass
    return found


def _engine(path, wrapper=None) -> EngineCore:
    config = EngineConfig(model=str(path), tensor_parallel_size=2, **ENGINE)
    return EngineCore(config, runner=start(path, config.executor_config(), 2, step_wrapper=wrapper))


def _submit(core, request_id, prompt, max_tokens=8) -> FaultySink:
    sink = FaultySink(fail_on=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    core.add_request(request_id, None, prompt, params, sink)
    return sink


def test_a_step_that_fails_on_one_rank_fails_its_requests_and_the_engine_goes_on(qwen3):
    core = _engine(qwen3, "pyengine.testing.faults:fail_rank1_on_poison")
    try:
        poisoned = _submit(core, "poisoned", [5, POISON_TOKEN, 7])
        assert poisoned.done.wait(60)
        failed = poisoned.error or poisoned.outputs[-1]
        assert "rank 1" in str(getattr(failed, "error", failed)) or "rank 1" in repr(failed)
        healthy = _submit(core, "healthy", [5, 6, 7])
        assert healthy.done.wait(60) and healthy.error is None
        assert len(healthy.outputs[-1].outputs[0].token_ids) == 8
        assert core.is_alive
    finally:
        core.shutdown()
    assert _workers() == set()


def test_a_worker_that_dies_makes_the_engine_dead_naming_its_rank(qwen3):
    core = _engine(qwen3)
    try:
        running = _submit(core, "long", [5, 6, 7], max_tokens=200)
        wait_until(lambda: running.outputs, 30, interval=0.01)  # it is streaming: in flight
        assert running.outputs and not running.done.is_set()
        worker = core.runner.workers[0]
        os.kill(worker.process.pid, 9)
        assert running.done.wait(20), "the caller was left waiting"
        last = running.outputs[-1]
        assert len(last.outputs[0].token_ids) < 200, "the request finished before the worker died"
        assert "rank 1" in str(running.error or getattr(last, "error", None)), last
        wait_until(lambda: not core.is_alive, 10)
        assert not core.is_alive
        assert "rank 1" in core.dead_reason()
        with pytest.raises(EngineDeadError, match="rank 1"):
            _submit(core, "after", [5, 6])
    finally:
        core.shutdown()
    assert _workers() == set()


def _children() -> set[int]:
    """Live child processes of this test process (zombies reaped are gone)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.add(int(entry))
    return found


def test_workers_outlive_ctrl_c_and_sigterm_so_rank_0_decides_when_they_stop(qwen3):
    """Ctrl-C (SIGINT to the terminal's process group) and a SIGTERM to every process of a
    cgroup must not take a worker down under a draining server: it is in a session of its
    own and ignores both; rank 0's shutdown still stops and reaps it."""
    import signal

    core = _engine(qwen3)
    try:
        worker = core.runner.workers[0].process
        assert os.getsid(worker.pid) != os.getsid(0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker.pid, sig)
        sink = _submit(core, "after-signals", [5, 6, 7])
        assert sink.done.wait(60) and sink.error is None
        assert len(sink.outputs[-1].outputs[0].token_ids) == 8
        assert worker.poll() is None and core.is_alive
    finally:
        core.shutdown()
    assert _workers() == set()


def test_prompt_logprobs_at_two_ranks_match_transformers(qwen3, monkeypatch):
    """The workers compute the prompt positions' logit slices too (the plan carries the
    positions and the slice size), in chunks of a small token budget and slices of 3
    positions (smaller than a chunk), next to a request that asks for nothing."""
    import transformers

    from pyengine.executor import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SLICE_POSITIONS", 3)  # rank 0 sends it to the workers
    batch = prompts(4, 3)
    asked = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, detokenize=False)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(qwen3), tensor_parallel_size=2, **{**ENGINE, "max_num_batched_tokens": 16}) as llm:
        outs = llm.generate(batch, [asked, plain, asked], use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).eval()
    assert outs[1].prompt_logprobs is None
    for out, prompt in ((outs[0], batch[0]), (outs[2], batch[2])):
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            entry = out.prompt_logprobs[j][prompt[j]]
            assert entry.logprob == pytest.approx(float(ref[j - 1, prompt[j]]), abs=2e-4)
            assert entry.rank == int((ref[j - 1] > ref[j - 1, prompt[j]]).sum()) + 1


def test_prompt_logits_failing_on_one_rank_fail_only_the_asking_request(qwen3):
    """Rank 1 runs out of memory on the prompt positions' logits: the request that asked
    fails naming the rank; the request beside it in the same steps, and later ones, go on."""
    core = _engine(qwen3, "pyengine.testing.faults:fail_rank1_prompt_logits")
    try:
        asking, plain = FaultySink(fail_on=0), FaultySink(fail_on=0)
        core.add_request("asking", None, [5, 6, 7, 8, 9], SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1), asking)
        core.add_request("plain", None, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         plain)
        assert asking.done.wait(60) and plain.done.wait(60)
        assert "rank 1" in str(asking.error) and "out of memory on prompt logits" in str(asking.error)
        assert plain.error is None and len(plain.outputs[-1].outputs[0].token_ids) == 8
        healthy = _submit(core, "healthy", [5, 6, 7])
        assert healthy.done.wait(60) and healthy.error is None
        assert len(healthy.outputs[-1].outputs[0].token_ids) == 8
        assert core.is_alive
    finally:
        core.shutdown()
    assert _workers() == set()

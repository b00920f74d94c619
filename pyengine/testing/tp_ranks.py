"""Tensor-parallel ranks in child processes, for tests: each rank runs the same hand-made
plans through its own ``ModelRunner`` (holding its shard) and rank 0 saves the logits.

``run_ranks`` starts ``world_size`` processes (``python -m pyengine.testing.tp_ranks``)
that meet through a TCP store on a free loopback port, waits for them with a deadline
and kills whatever is left in any case.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pyengine.processes.child_command import python_module_command
from pyengine.testing.waits import free_port


def run_ranks(checkpoint: Path, out: Path, world_size: int, prompts: list[list[int]], steps: int,
              timeout: float = 120.0, quantization: str = "none", expert_parallel: bool = False) -> list[str]:
    """Runs the ranks to completion; returns each rank's stderr. Raises on a failed rank."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    prompt_arg = ";".join(",".join(map(str, p)) for p in prompts)
    procs = [
        subprocess.Popen(
            python_module_command("pyengine.testing.tp_ranks", str(checkpoint), str(out), str(rank),
                                  str(world_size), str(port), prompt_arg, str(steps), quantization,
                                  str(int(expert_parallel))),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    errors = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            errors.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"ranks failed {failed}: {errors}")
    return errors


def check_two_ranks_match_one(checkpoint: Path, folder: Path, prompts: list[list[int]], steps: int, *,
                              quantization: str = "none", expert_parallel: bool = False, timeout: float = 120.0,
                              atol: float = 2e-5, rtol: float = 1e-5) -> np.ndarray:
    """TP=2's logits (``expert_parallel`` or not) equal TP=1's at every one of ``steps``
    steps of the same hand-made plans, within ``atol`` / ``rtol``; returns TP=2's. Both
    sizes load the checkpoint with ``quantization``; TP=1 runs in this process and saves to
    ``folder / "tp1.npy"``, the two ranks to ``folder / "tp2.npy"``."""
    generate_on_rank(str(checkpoint), str(folder / "tp1.npy"), 0, 1, 0, prompts, steps, quantization)
    run_ranks(checkpoint, folder / "tp2.npy", 2, prompts, steps, timeout=timeout, quantization=quantization,
              expert_parallel=expert_parallel)
    one, two = np.load(folder / "tp1.npy"), np.load(folder / "tp2.npy")
    assert one.shape == two.shape and one.shape[0] >= steps
    np.testing.assert_allclose(two, one, atol=atol, rtol=rtol)
    return two


def check_two_ranks_match_one_and_transformers(checkpoint: Path, folder: Path, prompts: list[list[int]], steps: int,
                                               expert_parallel: bool = False) -> None:
    """TP=2's logits equal TP=1's (every step), and the first sampled row (the second
    prompt's last position) equals transformers' on the same checkpoint."""
    from pyengine.testing.transformers_reference import reference_logits

    two = check_two_ranks_match_one(checkpoint, folder, prompts, steps, expert_parallel=expert_parallel)
    theirs = reference_logits(checkpoint, prompts[1])[-1].numpy()
    np.testing.assert_allclose(two[0], theirs, atol=2e-5, rtol=1e-5)


def generate_on_rank(checkpoint: str, out: str, rank: int, world_size: int, port: int, prompts: list[list[int]],
              steps: int, quantization: str = "none", expert_parallel: bool = False) -> None:
    import torch

    from pyengine.executor.config import ExecutorConfig
    from pyengine.executor.model_runner import ModelRunner
    from pyengine.executor.tensor_parallel.rendezvous import Rendezvous, join_group, leave_group
    from pyengine.models.parallel import ParallelContext
    from pyengine.sampling_params import SamplingParams
    from pyengine.testing.hand_plan import HandPlanner

    torch.set_num_threads(1)
    store = None
    if world_size > 1:
        store = join_group(Rendezvous("127.0.0.1", port, rank, world_size, rank, "gloo", timeout_s=60.0))
    try:
        config = ExecutorConfig(max_num_seqs=8, max_model_len=256, num_kv_blocks=64,
                                quantization=None if quantization == "none" else quantization,
                                enable_expert_parallel=expert_parallel)
        parallel = ParallelContext(rank, world_size, expert_parallel=expert_parallel)
        runner = ModelRunner.from_pretrained(checkpoint, config, parallel)
        planner = HandPlanner(block_size=runner.block_size, num_blocks=runner.num_kv_blocks, max_rows=8,
                              scatter_blocks=True)
        for prompt in prompts:
            planner.add(prompt, SamplingParams(temperature=0.0))
        logits = []
        for _ in range(steps):
            plan = planner.next_plan(max_chunk=16)
            result = runner.execute(plan, return_logits=True)
            planner.record(plan, result.sampled_token_ids)
            if result.logits is not None:
                logits.append(result.logits.numpy())
        if rank == 0:
            np.save(out, np.concatenate(logits))
    finally:
        leave_group(store, rank, world_size)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("checkpoint", "out", "rank", "world_size", "port", "prompts", "steps", "quantization",
                 "expert_parallel"):
        parser.add_argument(name)
    args = parser.parse_args()
    generate_on_rank(args.checkpoint, args.out, int(args.rank), int(args.world_size), int(args.port),
              [[int(t) for t in p.split(",")] for p in args.prompts.split(";")], int(args.steps), args.quantization,
              args.expert_parallel == "1")
    # The rank's work is saved and its group left; skip the interpreter's teardown of
    # torch, where gloo threads that outlived destroy_process_group() can abort the process
    # (the worker's entry point does the same; see worker.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Ranks started from outside (torchrun's variables, ``distributed_executor_backend=
"external_launcher"``): two processes on loopback run the same script; rank 0 is the
engine and gives the tokens of tensor-parallel size 1, rank 1 serves it over the
broadcast plan channel (the path ranks on another host take) and exits with it; so with
an EAGLE-3 head on rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.config import EngineConfig
from pyengine.errors import InvalidConfigError
from pyengine.executor.tensor_parallel.external import join_external
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.eagle3_checkpoint import write_eagle3_head
from pyengine.testing.waits import free_port

SCRIPT = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import json, sys
from pyengine import LLM, SamplingParams
prompts = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="external_launcher",
          max_model_len=256, max_num_seqs=8, speculative_config=json.loads(sys.argv[3]))
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
llm.shutdown()
"""


def test_two_launched_ranks_give_the_tokens_of_one(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=2)
    check_launched_ranks_give_the_tokens_of_one(path)


def test_launched_ranks_with_an_eagle3_head_give_the_tokens_of_one(tmp_path):
    """Rank 1 builds its runner from the same arguments: it loads no head but joins the
    start-up gather of the target's embedding that rank 0's head reads."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama", seed=2, num_hidden_layers=4)
    head = write_eagle3_head(tmp_path / "head", path, seed=3, aux_layer_ids=(0, 1, 3))
    check_launched_ranks_give_the_tokens_of_one(path, {"method": "eagle3", "model": str(head),
                                                       "num_speculative_tokens": 2})


def check_launched_ranks_give_the_tokens_of_one(path, speculative_config=None) -> None:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 400, int(rng.integers(2, 30))).tolist() for _ in range(5)]
    with LLM(str(path), max_model_len=256, max_num_seqs=8) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        expected = [o.outputs[0].token_ids for o in outs]
    port = free_port()
    procs = []
    try:
        for rank in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(path), json.dumps(prompts),
                                           json.dumps(speculative_config)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 120
        results = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    line = next(line for line in results[0][0].splitlines() if line.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == expected
    assert "TOKENS" not in results[1][0]  # rank 1 never returned from LLM(...)


def test_the_launcher_variables_must_be_there_and_agree(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    config = EngineConfig(model=str(path), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidConfigError, match="MASTER_ADDR"):
        join_external(path, config.executor_config(), 2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(InvalidConfigError, match="WORLD_SIZE"):
        join_external(path, config.executor_config(), 2)
    with pytest.raises(InvalidConfigError, match="distributed_executor_backend"):
        EngineConfig(model=str(path), distributed_executor_backend="ray")

"""Every program in examples/ runs as a user runs it (``python examples/offline/X.py``,
its own process, against the installed pyengine and the built-in tiny checkpoint) and
prints what it promises; the one that shows a difference from vLLM fails loudly and says
what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "offline"
TIMEOUT_S = 240  # one model load and a few short batches, on a shared 2-core machine

# (script, arguments, text the output must hold)
RUNS = [
    ("basic.py", [], ["Prompt:    'The capital of France is'", "(16 tokens, length)"]),
    ("chat.py", ["--max-tokens", "4"], ["Prompt: '<|im_start|>user\\nWhat is 2 + 2?<|im_end|>"]),
    ("embed.py", [], ["(64 dims, norm 1.000)", "encode() gives a 64-dim vector too"]),
    ("generate.py", ["--max-tokens", "3", "--temperature", "0", "--max-model-len", "256", "--dtype", "float"],
     ["Prompt:    'The president of the United States is'"]),
    ("prefix_caching.py", [], ["the outputs are the same with and without prefix caching"]),
    ("reproducibility.py", [], ["the seeded request drew the same tokens alone, in its batch"]),
]


def run_example(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # A script's own folder goes first on sys.path, not the current one: from any folder it
    # imports the installed pyengine (as pyengine/processes/child_command.py ensures for modules).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd, env=env, check=False)


def test_every_example_is_covered():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted([r[0] for r in RUNS] + ["classify.py"])


@pytest.mark.parametrize("script, args, expected", RUNS, ids=[r[0] for r in RUNS])
def test_example_runs(script, args, expected, tmp_path):
    done = run_example(script, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in expected:
        assert text in done.stdout, done.stdout[-3000:]


def test_the_unsupported_example_fails_loudly_saying_what_to_do(tmp_path):
    done = run_example("classify.py", [], tmp_path)
    assert done.returncode == 1
    assert "InvalidRequestError: LLM.classify is not supported" in done.stderr
    assert "LLM.embed gives pooled vectors" in done.stderr


@pytest.mark.parametrize("name", ["classify", "score", "reward", "sleep", "wake_up", "start_profile",
                                  "stop_profile", "collective_rpc", "apply_model"])
def test_vllm_methods_pyengine_lacks_say_so(name):
    from pyengine import LLM
    from pyengine.errors import InvalidRequestError

    llm = LLM.__new__(LLM)  # no engine needed: the refusal comes first
    with pytest.raises(InvalidRequestError, match=f"LLM.{name} is not supported: .+"):
        getattr(llm, name)("x")

"""The small benches' reports: the recorded workload is the workload (not the ``--json``
switch that chose the output format), and plain output is readable lines, not a
Python ``repr`` of the JSON dict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
import beam_search  # noqa: E402
import prompt_logprobs  # noqa: E402

PLP_ARGS = ["--num-requests", "3", "--prompt-len", "8", "--vocab", "512", "--repeats", "1"]


def test_prompt_logprobs_json_records_the_workload_only(capsys):
    prompt_logprobs.main([*PLP_ARGS, "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["workload"] == {"num_requests": 3, "prompt_len": 8, "vocab": 512, "repeats": 1}
    assert set(result["seconds"]) == {"none", "all", "one_in_8"}
    assert all(len(runs) == 1 for runs in result["runs"].values())


def test_prompt_logprobs_plain_output_is_readable_lines(capsys):
    prompt_logprobs.main(PLP_ARGS)
    out = capsys.readouterr().out
    assert "{" not in out and "json" not in out
    lines = out.splitlines()
    assert lines[0] == "workload: 3 requests of 8 prompt tokens, vocab 512, 8 output tokens, median of 1 run(s)"
    assert any(line.strip().startswith("every request asks:") and line.rstrip().endswith(")") for line in lines)
    assert lines[-1].startswith("idle per-step check") and lines[-1].endswith("µs")


def test_beam_search_json_records_the_workload_only(capsys):
    beam_search.main(["--num-prompts", "1", "--prompt-len", "6", "--beam-width", "2", "--max-tokens", "2",
                      "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["workload"] == {"num_prompts": 1, "prompt_len": 6, "beam_width": 2, "max_tokens": 2, "repeats": 1}
    assert result["same_sequences"] is True

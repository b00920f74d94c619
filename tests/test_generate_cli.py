"""``pyengine generate`` as a batch tool: prompts from a file or stdin (text lines or JSONL
with per-request sampling fields), engine arguments as flags, JSONL out in input order,
progress that follows generated tokens and stays a few lines off a terminal; bad input is
one line naming the line, before any model loads."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

import pyengine
from pyengine.cli.main import main
from pyengine.entrypoints.progress import RequestBar, TokenProgress
from pyengine.sampling_params import SamplingParams

ENGINE = ["--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "128"]


def rows(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_jsonl_in_jsonl_out_in_input_order(tmp_path, capsys):
    lines = [
        {"prompt": "Once upon a time", "max_tokens": 3, "id": "a"},
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 2, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "id": 7},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n\nplain text prompt\n")
    assert main(["generate", "--input", str(source), "--max-tokens", "4", "--no-progress", *ENGINE]) == 0
    out = rows(capsys.readouterr().out)
    assert [r["id"] for r in out] == ["a", "1", "7", "3"]
    assert out[1]["prompt_token_ids"] == [5, 6, 7] and len(out[1]["outputs"][0]["token_ids"]) == 2
    assert len(out[0]["outputs"][0]["token_ids"]) <= 3 and len(out[3]["outputs"][0]["token_ids"]) <= 4
    assert out[2]["prompt"].startswith("<|im_start|>user\nhi")  # rendered with the chat template
    for r in out:
        assert set(r["outputs"][0]) == {"index", "text", "token_ids", "finish_reason", "stop_reason"}


def test_text_lines_from_stdin_to_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("first prompt\nsecond prompt\n"))
    target = tmp_path / "out.jsonl"
    assert main(["generate", "--input", "-", "--output", str(target), "--max-tokens", "2", "--temperature", "0",
                 "--ignore-eos", *ENGINE]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    out = rows(target.read_text())
    assert [r["prompt"] for r in out] == ["first prompt", "second prompt"]
    assert all(r["outputs"][0]["finish_reason"] == "length" for r in out)
    # stderr is no terminal here: progress is a few plain lines, no redrawn bar.
    assert "\r" not in captured.err and 1 <= captured.err.count("generate:") <= 3


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x"}\n{"prompt": "y", oops}\n', "line 2: not valid JSON"),
    ('{"prompt": "x", "temprature": 0.5}\n', "line 1: unknown field(s) temprature"),
    ('{"max_tokens": 3}\n', "line 1: needs exactly one of prompt, prompt_token_ids, messages"),
    ('{"prompt": "x", "messages": []}\n', "(got prompt, messages)"),
    ('["x"]\n', "line 1: expected a JSON object"),  # (auto would read it as a text prompt)
    ("\n\n", "no prompts in it"),
    ('{"prompt": "x", "max_tokens": 0}\n', "line 1: max_tokens must be >= 1"),
    ('{"prompt": "x"}\n{"prompt": "y", "temperature": "hot"}\n', "line 2: temperature must be a finite number"),
    ('{"prompt": "x", "min_tokens": 5}\n', "line 1: min_tokens must be <= max_tokens"),  # with --max-tokens 3
])
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, monkeypatch, content, message):
    def no_model(*_, **__):
        raise AssertionError("a model was loaded for input that cannot run")

    monkeypatch.setattr(pyengine, "LLM", no_model)
    source = tmp_path / "bad.jsonl"
    source.write_text(content)
    assert main(["generate", "--input", str(source), "--input-format", "jsonl", "--no-progress", "--max-tokens", "3",
                 *ENGINE]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("pyengine generate: ")


def test_a_bad_sampling_flag_fails_before_the_model_loads(capsys, monkeypatch):
    def no_model(*_, **__):
        raise AssertionError("a model was loaded for flags that cannot run")

    monkeypatch.setattr(pyengine, "LLM", no_model)
    assert main(["generate", "--prompt", "x", "--max-tokens", "0", "--no-progress", *ENGINE]) == 2
    assert "sampling flags: max_tokens must be >= 1" in capsys.readouterr().err


def test_a_missing_input_file_and_conflicting_flags(tmp_path, capsys):
    assert main(["generate", "--input", str(tmp_path / "nope.txt")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--input", "-", "--prompt", "x"])


def test_default_output_without_input_is_readable_text(capsys):
    assert main(["generate", "--prompt", "hello", "--max-tokens", "2", "--no-progress", *ENGINE]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("--- 'hello'") and "finish:" in captured.out
    assert "--- engine stats" in captured.out and "busy" in captured.out  # the main job's figures


# ---- the progress display ----

def finished(n_tokens):
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * n_tokens)])


def test_token_progress_moves_with_tokens_and_ends_full():
    stream = io.StringIO()
    progress = TokenProgress("generate", stream=stream, log_interval_s=3600)
    progress.start([4, 4, 90], [SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, n=2),
                                SamplingParams(max_tokens=50)], max_model_len=100)
    assert progress.total == 10 + 20 + 10  # the third request has room for 10 tokens only
    progress.update([], 7)  # no request finished yet: the count still moves
    assert progress.tokens + progress.released == 7
    progress.update([(0, finished(3))], 12)  # ended early: 7 of its budget released
    progress.update([(1, finished(20)), (2, finished(10))], 33)
    assert min(progress.total, progress.tokens + progress.released) == progress.total
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1  # within one interval only the final line: a log gets lines, not a redrawn bar
    assert lines[-1].startswith("generate: 40/40 tok (100%), 3/3 req")


def test_use_tqdm_may_be_a_tqdm_like_class_as_in_vllm():
    from pyengine import LLM

    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.n = self.total = 0
            self.closed = False

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def close(self):
            self.closed = True

    with LLM(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128) as llm:
        outs = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert len(outs) == 2 and len(made) == 1 and made[0]["desc"] == "generate"
    bar = RequestBar("x", bar_factory=Bar)
    bar.start([1], [SamplingParams()], 10)
    bar.update([(0, finished(1))], 1)
    bar.close()
    assert bar.display.bar.n == 1 and bar.display.bar.total == 1 and bar.display.bar.closed

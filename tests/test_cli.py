"""``pyengine`` itself: --help lists the commands, --version, an unknown command is named,
and a model the engine cannot run is one line on stderr, not a traceback."""

from __future__ import annotations

import json
import signal

import pytest

import pyengine
from pyengine.cli.main import COMMANDS, main


def test_help_lists_every_command_with_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        lines = [line for line in out.splitlines() if line.strip().startswith(command + " ")]
        assert len(lines) == 1, (command, out)
    assert main(["-h"]) == 0


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pyengine {pyengine.__version__}"


def test_unknown_command_is_named(capsys):
    assert main(["generat", "--model", "x"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pyengine: unknown command 'generat'")
    assert "generate" in captured.err and captured.out == ""


def test_options_without_a_command_still_go_to_generate():
    with pytest.raises(SystemExit) as info:
        main(["--no-such-option"])
    assert info.value.code == 2


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_unsupported_architecture_is_one_line(command, tmp_path, capfd):
    # capfd: serve loads the model in its engine-core process, whose stderr counts too.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    argv = ["generate", "--model", str(tmp_path)] if command == "generate" else ["serve", str(tmp_path)]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert main(argv) == 2
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # a failed start-up puts them back
    err = capfd.readouterr().err
    lines = err.splitlines()
    if command == "serve":  # the core logs its load error on its own stderr too, in one line
        core_lines = [line for line in lines if line.startswith("engine core 0: ERROR engine core 0 failed to load")]
        assert len(core_lines) == 1
        lines.remove(core_lines[0])
    where = "engine core 0 failed to load: " if command == "serve" else ""
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pyengine {command}: {where}architectures: 'GPT2LMHeadModel' is not supported")
    assert "Traceback" not in err


def test_missing_folder_is_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "is not a checkpoint folder" in err and err.count("\n") == 1

"""``MultiprocessEngine``: the engine core in a process of its own, with real processes.

Outputs equal transformers' greedy tokens and the in-process engine's outputs (text,
logprobs, embeddings, every output kind); a bad request is refused at once; a core that
fails to load reports its error; a core killed with SIGKILL fails every request in flight
within seconds and the health says dead; a front end killed with SIGKILL takes its core
with it within 5 s; nothing is left behind (ipc files, processes). Every wait is bounded
and every child reaped."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pyengine import AsyncEngine, EngineConfig, LinkOptions, SamplingParams, make_engine_client
from pyengine.errors import DuplicateRequestError, EngineDeadError, InvalidRequestError, ModelLoadError
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.processes.child_command import python_module_command
from pyengine.testing.checkpoints import make_tiny_checkpoint
from pyengine.testing.waits import free_ports, pid_alive, wait_until

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [9] * 20, [42, 17, 3, 250, 11, 8]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mp") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = make_engine_client(EngineConfig.from_kwargs(str(checkpoint), max_num_seqs=16, num_kv_blocks=128),
                             multiprocess=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def local(checkpoint):
    eng = AsyncEngine(str(checkpoint), max_num_seqs=16, num_kv_blocks=128)
    yield eng
    eng.shutdown()


async def _last(engine, prompt, params, kind="cumulative", rid=None):
    outs = [o async for o in engine.generate(prompt, params, rid, output_kind=kind)]
    return outs


def test_greedy_tokens_equal_transformers(engine, checkpoint):
    import transformers

    assert isinstance(engine, MultiprocessEngine)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def run():
        return await asyncio.gather(*[_last(engine, p, params) for p in PROMPTS])

    for prompt, outs in zip(PROMPTS, asyncio.run(run())):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        # transformers stops at EOS, the engine (ignore_eos) goes on: equal up to there.
        assert ref.numel() > 0 and outs[-1].outputs[0].token_ids[:ref.numel()] == ref.tolist()
        assert outs[-1].prompt_token_ids == prompt and outs[-1].finished


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final"])
def test_outputs_equal_the_in_process_engine(engine, local, kind):
    params = SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=10, logprobs=3, ignore_eos=True)
    prompt = "The three threads of an inference engine"
    mp = asyncio.run(_last(engine, prompt, params, kind))
    ip = asyncio.run(_last(local, prompt, params, kind))
    assert len(mp) == len(ip)
    for a, b in zip(mp, ip):
        assert a.prompt == b.prompt and a.prompt_token_ids == b.prompt_token_ids and a.finished == b.finished
        for x, y in zip(a.outputs, b.outputs):
            assert (x.index, x.text, x.token_ids, x.finish_reason) == (y.index, y.text, y.token_ids, y.finish_reason)
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob)
            assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]


def test_stop_strings_and_embeddings_equal_the_in_process_engine(engine, local):
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "e"], include_stop_str_in_output=True)
    mp = asyncio.run(_last(engine, "Hello there", params))[-1].outputs[0]
    ip = asyncio.run(_last(local, "Hello there", params))[-1].outputs[0]
    assert (mp.text, mp.token_ids, mp.finish_reason, mp.stop_reason) == \
        (ip.text, ip.token_ids, ip.finish_reason, ip.stop_reason)
    a = asyncio.run(engine.embed([5, 6, 7]))
    b = asyncio.run(local.embed([5, 6, 7]))
    assert a.outputs.embedding == b.outputs.embedding and a.prompt_token_ids == [5, 6, 7]


def test_bad_requests_are_refused_at_once_and_harm_no_one(engine):
    async def run():
        with pytest.raises(InvalidRequestError, match="logprobs"):
            await _last(engine, [1, 2], SamplingParams(logprobs=10_000))
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            await _last(engine, [10**6], SamplingParams())
        with pytest.raises(InvalidRequestError, match="max_model_len"):  # the core's scheduler refuses it
            await _last(engine, [1] * 10, SamplingParams(max_tokens=10**7))
        gen = engine.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), "same")
        first = await gen.__anext__()
        with pytest.raises(DuplicateRequestError):
            await _last(engine, [1, 2], SamplingParams(), rid="same")
        await engine.abort("same")
        outs = [first] + [o async for o in gen]
        assert outs[-1].outputs[0].finish_reason == "abort"
        return await _last(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))

    assert len(asyncio.run(run())[-1].outputs[0].token_ids) == 3
    assert engine.health().alive


def test_structured_outputs_cross_and_bad_ones_are_refused_at_once(engine, local):
    from pyengine.structured_outputs import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]))
    mp = asyncio.run(_last(engine, "Pick one:", params))[-1].outputs[0]
    ip = asyncio.run(_last(local, "Pick one:", params))[-1].outputs[0]
    assert mp.text in ("alpha", "beta gamma") and (mp.text, mp.token_ids) == (ip.text, ip.token_ids)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError):
        asyncio.run(_last(engine, "x", bad))


def test_stats_stacks_and_health_cross_the_link(engine):
    asyncio.run(_last(engine, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    stats = engine.stats()
    assert stats.steps > 0 and stats.generated_tokens > 0 and "pyengine-exec" in stats.threads
    assert [s.role for s in engine.thread_stacks()] == ["scheduler", "executor", "output"]
    assert wait_until(lambda: engine.health().steps >= stats.steps, 5.0)
    assert len(engine.engine_health()) == 1 and len(engine.engine_stats()) == 1


def test_a_core_that_fails_to_load_reports_its_error(tmp_path, monkeypatch):
    import tempfile

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nope"}))
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where the ipc folder goes
    with pytest.raises(ModelLoadError, match="engine core 0 failed to load.*NoSuchForCausalLM"):
        make_engine_client(EngineConfig(model=str(bad)), multiprocess=True, link=LinkOptions(start_timeout=60))
    assert not list(private.iterdir())  # its ipc folder is gone


def test_a_failure_after_the_cores_are_ready_reaps_them(checkpoint, tmp_path, monkeypatch):
    """The start-up's last steps (the tokenizer, the threads) fail after every core said
    ready: the constructor still kills and reaps the cores and removes the ipc folder."""
    import tempfile

    from pyengine.multiprocess import cores, request_prep

    started = []
    real_core_process = cores.CoreProcessHandle

    def recording(*args, **kwargs):
        process = real_core_process(*args, **kwargs)
        started.append(process)
        return process

    def broken_tokenizer(_):
        raise ValueError("a tokenizer.json this front end cannot read")

    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setattr(cores, "CoreProcessHandle", recording)
    monkeypatch.setattr(request_prep, "_tokenizer", broken_tokenizer)
    try:
        with pytest.raises(ValueError, match="cannot read"):
            MultiprocessEngine(_config(checkpoint), LinkOptions(start_timeout=60))
        assert len(started) == 1
        assert started[0].popen.poll() is not None, "a ready core outlived its failed start-up"
        assert not list(private.iterdir())  # its ipc folder is gone
    finally:
        for process in started:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait(10)


def test_setting_abandon_ends_the_start_up(checkpoint, tmp_path, monkeypatch):
    """``abandon`` (the CLI's signal handlers set it) ends a start-up whose core hangs in
    its load: EngineError, the core killed and reaped, the ipc folder removed."""
    import shutil
    import tempfile
    import threading

    from pyengine.errors import EngineError
    from pyengine.multiprocess import cores

    model = tmp_path / "hanging"
    shutil.copytree(checkpoint, model)
    (model / "generation_config.json").unlink()
    os.mkfifo(model / "generation_config.json")  # nobody writes it: the core's load hangs
    started = []
    real_core_process = cores.CoreProcessHandle

    def recording(*args, **kwargs):
        process = real_core_process(*args, **kwargs)
        started.append(process)
        return process

    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    monkeypatch.setattr(cores, "CoreProcessHandle", recording)
    abandon = threading.Event()
    timer = threading.Timer(1.0, abandon.set)
    timer.start()
    try:
        with pytest.raises(EngineError, match="abandoned"):
            MultiprocessEngine(_config(model), LinkOptions(start_timeout=60), abandon=abandon)
        assert len(started) == 1 and started[0].popen.poll() is not None
        assert not list(private.iterdir())
    finally:
        timer.cancel()
        for process in started:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait(10)


def test_a_killed_core_fails_every_request_in_flight(checkpoint):
    eng = MultiprocessEngine(_config(checkpoint))
    ipc_dir = eng.ipc_dir
    pid = eng.info.pid
    try:
        async def run():
            params = SamplingParams(max_tokens=100_000 // 200, ignore_eos=True)
            streaming = asyncio.Event()

            async def stream(prompt):
                outs = []
                async for out in eng.generate(prompt, params, None, output_kind="cumulative"):
                    streaming.set()
                    outs.append(out)
                return outs

            streams = [asyncio.ensure_future(stream([i + 1, 2, 3])) for i in range(16)]
            # Killed at the first token streamed, not after a step count: the count comes with
            # the core's once-a-second status, and under load 500 steps can pass before it does.
            await asyncio.wait_for(streaming.wait(), 60)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 10)
            return results, time.monotonic() - killed

        results, took = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "SIGKILL" in str(results[0]) and took < 5
        assert not eng.health().alive and "SIGKILL" in eng.health().dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(_last(eng, [1], SamplingParams()))
        with pytest.raises(EngineDeadError):
            eng.stats()
    finally:
        eng.shutdown()
    assert not Path(ipc_dir).exists()


FRONT_END = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import json, sys, time
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.config import EngineConfig
eng = MultiprocessEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=64, max_num_seqs=8))
print(json.dumps({"pid": eng.info.pid, "ipc_dir": eng.ipc_dir}), flush=True)
time.sleep(120)
"""


def _assert_killing_the_front_end_ends_its_core(front: subprocess.Popen) -> None:
    """Reads the line ``front`` prints once its core runs (the core's pid and ipc folder;
    bounded: the front end times out its own start-up), then SIGKILLs the front end: the
    core exits within 5 s and its ipc files are gone within 2 s. Both processes are reaped
    or killed whatever happens."""
    core_pid = None
    try:
        started = json.loads(front.stdout.readline())
        core_pid, ipc_dir = started["pid"], started["ipc_dir"]
        assert pid_alive(core_pid) and Path(ipc_dir).exists()
        front.kill()
        front.wait(10)
        assert wait_until(lambda: not pid_alive(core_pid), 5.0), "the core outlived its front end"
        assert wait_until(lambda: not Path(ipc_dir).exists(), 2.0), "the ipc files were left behind"
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(10)
        if core_pid is not None and pid_alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_a_killed_front_end_takes_its_core_with_it(checkpoint):
    _assert_killing_the_front_end_ends_its_core(
        subprocess.Popen([sys.executable, "-c", FRONT_END, str(checkpoint)], stdout=subprocess.PIPE, text=True))


FRONT_END_STREAMING = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import asyncio, json, sys, time
from pyengine import SamplingParams
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.config import EngineConfig
eng = MultiprocessEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=256, max_num_seqs=8))

async def main():
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    async def one(i):
        async for out in eng.generate([i + 1, 2, 3], params, output_kind="delta"):
            await asyncio.sleep(0.05)  # a slow reader: the core's outputs queue up
    tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
    while eng.health().steps < 5:
        await asyncio.sleep(0.02)
    print(json.dumps({"pid": eng.info.pid, "ipc_dir": eng.ipc_dir}), flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_a_front_end_killed_with_streams_in_flight_takes_its_core_with_it(checkpoint):
    _assert_killing_the_front_end_ends_its_core(
        subprocess.Popen([sys.executable, "-c", FRONT_END_STREAMING, str(checkpoint)], stdout=subprocess.PIPE,
                         text=True))


FRONT_END_LOADING = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import os, subprocess, sys, time
from pyengine.processes.child_command import python_module_command
core = subprocess.Popen(python_module_command("pyengine", "core", sys.argv[1], "--input", sys.argv[2],
                                              "--output", sys.argv[3], "--parent-pid", str(os.getpid())))
print(core.pid, flush=True)
time.sleep(120)
"""


def test_a_front_end_killed_while_its_core_loads_takes_the_core_with_it(checkpoint, tmp_path):
    """The core's load hangs (two of its checkpoint's files are pipes nobody writes): the
    front end's death still ends it."""
    import shutil

    model = tmp_path / "hanging"
    shutil.copytree(checkpoint, model)
    for name in ("tokenizer_config.json", "generation_config.json"):
        (model / name).unlink()
        os.mkfifo(model / name)
    front = subprocess.Popen([sys.executable, "-c", FRONT_END_LOADING, str(model), f"ipc://{tmp_path}/in.sock",
                              f"ipc://{tmp_path}/out.sock"], stdout=subprocess.PIPE, text=True)
    core_pid, writer = None, None
    try:
        core_pid = int(front.stdout.readline())
        # The core is loading once it opened one of the pipes to read. Holding a writer end
        # open (and writing nothing) keeps its read hanging rather than ending at EOF.
        pipes = [model / "tokenizer_config.json", model / "generation_config.json"]
        writer = _writer_of_a_pipe_being_read(pipes, timeout=120.0)
        assert writer is not None, "the core never reached its load"
        assert pid_alive(core_pid), "the core exited before its front end did"
        front.kill()
        front.wait(10)
        assert wait_until(lambda: not pid_alive(core_pid), 5.0), "a loading core outlived its front end"
    finally:
        if front.poll() is None:
            front.kill()
            front.wait(10)
        if core_pid is not None and pid_alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)
        if writer is not None:
            os.close(writer)


def _writer_of_a_pipe_being_read(pipes, timeout):
    """A write end of the first of ``pipes`` that a process opened to read, once one did
    (None after ``timeout``): opening a pipe to write without blocking fails with ENXIO
    while nobody reads it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pipe in pipes:
            try:
                return os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as error:
                if error.errno != errno.ENXIO:
                    raise
        time.sleep(0.02)
    return None


HALF_BUILT_HANDLER = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import logging, os, time
from pyengine.multiprocess.watchdog import FrontEndWatch
# What logging holds while another thread runs StreamHandler.__init__: the handler is
# registered before it has its lock.
half_built = logging.StreamHandler.__new__(logging.StreamHandler)
logging._addHandlerRef(half_built)
FrontEndWatch(0, os.getppid() + 1, 30.0, None).start()  # a parent that is not ours: gone
time.sleep(60)
"""


def test_a_core_whose_front_end_is_gone_exits_whatever_state_logging_is_in():
    """The watch thread used to call logging.shutdown(), which raised on a handler the
    main thread was still building, and the core lived on."""
    child = subprocess.Popen([sys.executable, "-c", HALF_BUILT_HANDLER], stderr=subprocess.PIPE, text=True)
    try:
        assert child.wait(30) == 1, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert "is gone while loading; exiting" in child.stderr.read()


def test_a_core_with_a_front_end_ignores_sigterm(checkpoint):
    """systemd signals the whole group: the front end drains, so its core must not end
    the requests on its own. The stream finishes in full; Shutdown still stops the core."""
    eng = MultiprocessEngine(_config(checkpoint))
    pid = eng.info.pid
    try:
        async def run():
            got = 0
            async for out in eng.generate([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True), None,
                                          output_kind="delta"):
                if got == 0:
                    os.kill(pid, signal.SIGTERM)
                got += len(out.outputs[0].token_ids)
            return got

        assert asyncio.run(asyncio.wait_for(run(), 60)) == 200
        assert pid_alive(pid) and eng.health().alive
    finally:
        eng.shutdown()
    assert not pid_alive(pid)


def test_a_core_on_another_host_over_tcp(checkpoint):
    """A front end with no local core; the core started by hand (`pyengine core`), as on
    another host, over loopback tcp, both with the default heartbeat timeout. Its death is
    seen from its silence within 5 s (the issue's bound)."""
    eng_box: dict = {}
    core = None
    try:
        import threading

        cfg = _config(checkpoint)
        from pyengine.multiprocess.client import MultiprocessEngine as MP

        ports = free_ports(2)

        def start() -> None:
            try:
                eng_box["eng"] = MP(cfg, LinkOptions(transport="tcp", input_port=ports[0], output_port=ports[1],
                                                     local_cores=0, start_timeout=60))
            except BaseException as error:  # noqa: BLE001 - shown by the assert below
                eng_box["error"] = error

        t = threading.Thread(target=start, daemon=True)
        t.start()
        core = subprocess.Popen(python_module_command("pyengine", "core", str(checkpoint), "--num-kv-blocks", "64",
                                                     "--max-num-seqs", "8", "--input", f"tcp://127.0.0.1:{ports[0]}",
                                                     "--output", f"tcp://127.0.0.1:{ports[1]}"))
        t.join(90)
        assert "eng" in eng_box, f"the front end did not start: {eng_box.get('error')!r}"
        eng = eng_box["eng"]
        outs = asyncio.run(_last(eng, [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
        assert len(outs[-1].outputs[0].token_ids) == 5
        core.send_signal(signal.SIGSTOP)  # silent, not gone: only the missing heartbeats tell
        assert wait_until(lambda: not eng.health().alive, 5.0), "a silent core was not declared dead within 5 s"
        assert "no status" in eng.health().dead_reason
    finally:
        if "eng" in eng_box:
            eng_box["eng"].shutdown(timeout=2)
        if core is not None:
            core.kill()
            core.wait(10)


FRONT_END_TCP = """
import sys; sys.path = [p for p in sys.path if p]  # the installed pyengine, not the checkout
import sys, time
from pyengine.multiprocess.client import MultiprocessEngine
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.config import EngineConfig
eng = MultiprocessEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=64, max_num_seqs=8),
                         LinkOptions(transport="tcp", input_port=int(sys.argv[2]), output_port=int(sys.argv[3]),
                                     local_cores=0, start_timeout=90))
print("ready", flush=True)
time.sleep(120)
"""


def test_a_core_on_another_host_exits_when_its_front_end_is_killed(checkpoint):
    """A core started by hand has no parent to watch: only the front end's missing
    heartbeats tell it, and with the default timeout it exits within 5 s of a SIGKILL."""
    ports = free_ports(2)
    front = subprocess.Popen([sys.executable, "-c", FRONT_END_TCP, str(checkpoint), *map(str, ports)],
                             stdout=subprocess.PIPE, text=True)
    core = None
    try:
        core = subprocess.Popen(python_module_command("pyengine", "core", str(checkpoint), "--num-kv-blocks", "64",
                                                     "--max-num-seqs", "8", "--input", f"tcp://127.0.0.1:{ports[0]}",
                                                     "--output", f"tcp://127.0.0.1:{ports[1]}"))
        assert front.stdout.readline().strip() == "ready"  # bounded: the front end's start_timeout
        assert core.poll() is None
        front.kill()
        front.wait(10)
        assert wait_until(lambda: core.poll() is not None, 5.0), "the core outlived its front end by 5 s"
    finally:
        for proc in (front, core):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.wait(10)


def _config(checkpoint):
    from pyengine.config import EngineConfig

    return EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_seqs=8)



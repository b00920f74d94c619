"""The engine core's side of the link (``CoreLink``), against real zmq sockets in this
process: what it must get across (a ``LoadFailed`` sent just before the core exits), what
it must survive (a peer's malformed bytes), and that no send waits forever on a front end
that reads nothing. Every wait is bounded."""

from __future__ import annotations

import json
import os
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from pyengine.config import EngineConfig
from pyengine.multiprocess import wire
from pyengine.multiprocess.core_loop import CoreMainLoop
from pyengine.multiprocess.link_options import LinkOptions
from pyengine.sampling_params import SamplingParams
from pyengine.testing.checkpoints import make_tiny_checkpoint


class FrontEnd:
    """The front end's two bound sockets in a folder of their own."""

    def __init__(self, folder, name: str) -> None:
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.ROUTER)
        self.commands.bind(f"ipc://{folder}/{name}-in.sock")
        self.outputs = self.context.socket(zmq.PULL)
        self.outputs.bind(f"ipc://{folder}/{name}-out.sock")
        self.input_address = f"ipc://{folder}/{name}-in.sock"
        self.output_address = f"ipc://{folder}/{name}-out.sock"

    def close(self) -> None:
        self.commands.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()


def test_a_load_failure_sent_right_before_exit_arrives(tmp_path, caplog):
    """The core says ``LoadFailed`` and closes at once, often before its connection is up:
    closing with linger lets it out (with linger 0 most of these were lost); the error is
    logged on the core's side as well."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"], "model_type": "nope"}))
    config = EngineConfig(model=str(bad))
    lost = 0
    for i in range(20):
        front = FrontEnd(tmp_path, f"f{i}")
        try:
            core = CoreMainLoop(config, front.input_address, front.output_address, 0, parent_pid=None,
                               heartbeat_timeout=10.0)
            assert core.run() == 1
            if not front.commands.poll(2000):
                lost += 1
                continue
            frames = front.commands.recv_multipart(copy=False)
            hello = wire.Codec(wire.Hello).decode(frames[1:])
            assert isinstance(hello, wire.LoadFailed) and "NoSuchForCausalLM" in hello.message
        finally:
            front.close()
    assert lost == 0, f"{lost} of 20 LoadFailed messages were lost"
    assert "engine core 0 failed to load" in caplog.text and "NoSuchForCausalLM" in caplog.text


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("link") / "qwen3", "qwen3", seed=3)


def _receive(socket, codec, timeout_ms: int = 10_000):
    assert socket.poll(timeout_ms), "nothing arrived"
    return codec.decode(socket.recv_multipart(copy=False))


def test_bad_messages_fail_one_request_and_the_core_serves_on(checkpoint, tmp_path):
    """Stray bytes, a message of another version and a request whose fields are of the
    wrong kind: each is logged and dropped or fails that one request; the core then
    serves a good request and stops on ``Shutdown``."""
    front = FrontEnd(tmp_path, "bad")
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=32, max_num_seqs=4)
    core = CoreMainLoop(config, front.input_address, front.output_address, 0, parent_pid=None, heartbeat_timeout=60)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(core.run()), daemon=True)
    thread.start()
    identity = wire.core_identity(0)
    to_core = wire.Codec(wire.ToCore)
    from_core = wire.Codec(wire.ToFrontEnd)
    try:
        assert front.commands.poll(60_000)
        frames = front.commands.recv_multipart(copy=False)
        ready = wire.Codec(wire.Hello).decode(frames[1:])
        assert isinstance(ready, wire.Ready) and ready.protocol_version == wire.PROTOCOL_VERSION
        front.commands.send_multipart([identity, b"\xc1 not msgpack"])
        front.commands.send_multipart([identity, msgspec.msgpack.encode(["NoSuchMessage", 1, 2])])
        bad = wire.AddRequest("bad", 7, {"max_tokens": 3}, False, "delta")  # ids not an array
        front.commands.send_multipart([identity, *to_core.encode(bad)])
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        good = wire.AddRequest("good", np.array([5, 6, 7], dtype=np.int64), params, False, "delta")
        front.commands.send_multipart([identity, *to_core.encode(good)])
        failed, tokens, finished = [], [], False
        deadline = time.monotonic() + 30
        while not finished and time.monotonic() < deadline:
            message = _receive(front.outputs, from_core)
            if isinstance(message, wire.EngineCoreOutputs):
                failed += [f.request_id for f in message.failures]
                for out in message.outputs:
                    assert out.request_id == "good"
                    tokens += out.completions[0].token_ids
                    finished = out.finished
        assert failed == ["bad"] and finished and len(tokens) == 4
        front.commands.send_multipart([identity, *to_core.encode(wire.Shutdown(timeout=2.0))])
        thread.join(30)
        assert result == [0]
    finally:
        core.stop_requested.set()
        thread.join(30)
        front.close()


def test_a_core_whose_front_end_reads_nothing_stops(checkpoint, tmp_path):
    """The front end's output socket is gone (it reads nothing, ever again) and the core's
    send queue fills: its sends give up, its watch notices the silence, and ``run``
    returns within bounds with the engine's threads joined (it used to wait forever)."""
    front = FrontEnd(tmp_path, "mute")
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_seqs=8)
    core = CoreMainLoop(config, front.input_address, front.output_address, 0, parent_pid=None, heartbeat_timeout=2,
                       send_timeout=2.0)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(core.run()), daemon=True)
    thread.start()
    try:
        assert front.commands.poll(60_000)
        front.commands.recv_multipart()
        to_core = wire.Codec(wire.ToCore)
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        for i in range(8):
            add = wire.AddRequest(f"r{i}", np.array([i + 1, 2, 3], dtype=np.int64), params, False, "delta")
            front.commands.send_multipart([wire.core_identity(0), *to_core.encode(add)])
        front.outputs.close(linger=0)  # nobody reads the core's outputs any more
        for i in range(1500):  # more replies than the core's send queue holds (1000)
            front.commands.send_multipart([wire.core_identity(0), *to_core.encode(wire.Query(i, "stats"))])
        thread.join(30)
        assert not thread.is_alive(), "the core waited forever on a front end that reads nothing"
        assert result == [0] and not core.engine_core.is_alive
    finally:
        core.stop_requested.set()
        thread.join(30)
        front.commands.close(linger=0)
        front.context.term()


def test_a_send_that_times_out_leaves_a_live_front_ends_socket_files(checkpoint, tmp_path):
    """The front end is alive (this process's parent stands for it) but reads nothing: the
    core's sends time out and it stops, as it must, but the front end's socket files stay
    (it still owns them); they used to be removed as if the front end had died."""
    context = zmq.Context()
    commands = context.socket(zmq.ROUTER)
    commands.bind(f"ipc://{tmp_path}/input.sock")
    outputs = context.socket(zmq.PULL)
    outputs.setsockopt(zmq.RCVHWM, 1)  # bound, never read: the core's queue fills soon
    outputs.bind(f"ipc://{tmp_path}/output.sock")
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_seqs=8)
    core = CoreMainLoop(config, f"ipc://{tmp_path}/input.sock", f"ipc://{tmp_path}/output.sock", 0,
                       parent_pid=os.getppid(), heartbeat_timeout=2, ipc_dir=str(tmp_path), send_timeout=2.0)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(core.run()), daemon=True)
    thread.start()
    try:
        assert commands.poll(60_000)
        commands.recv_multipart()
        to_core = wire.Codec(wire.ToCore)
        for i in range(3000):  # more replies than the core's send queue and the socket hold
            commands.send_multipart([wire.core_identity(0), *to_core.encode(wire.Query(i, "stats"))])
        thread.join(60)
        assert not thread.is_alive(), "the core waited forever on a front end that reads nothing"
        assert result == [0] and core.link.stopping.is_set()
        assert sorted(p.name for p in tmp_path.glob("*.sock")) == ["input.sock", "output.sock"]
    finally:
        core.stop_requested.set()
        thread.join(30)
        commands.close(linger=0)
        outputs.close(linger=0)
        context.term()


@pytest.mark.parametrize("hello, says", [
    ([b"\xc1 stray bytes"], "cannot read"),
    ("old", "speaks link protocol 0"),
])
def test_a_hello_of_another_version_is_a_clear_error(checkpoint, hello, says):
    """A front end waiting for its (remote) core gets a hello it cannot use: the
    constructor raises an ``EngineError`` that says why, not a decoder's traceback."""
    import socket

    from pyengine.errors import EngineError
    from pyengine.multiprocess.client import MultiprocessEngine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box: dict = {}

    def start() -> None:
        try:
            box["engine"] = MultiprocessEngine(EngineConfig(model=str(checkpoint)), LinkOptions(
                transport="tcp", input_port=port, local_cores=0, start_timeout=20))
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            box["error"] = error

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, wire.core_identity(0))
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        if hello == "old":
            info = wire.CoreInfo("m", 64, 64, 100, 5, None, {}, 1, [0])
            hello = wire.Codec(wire.Hello).encode(wire.Ready(0, info, 0))
        dealer.send_multipart(hello)
        thread.join(30)
        assert "engine" not in box
        assert isinstance(box.get("error"), EngineError) and says in str(box["error"]), box
    finally:
        if "engine" in box:
            box["engine"].shutdown()
        dealer.close(linger=0)
        context.term()


class FakeCore:
    """A peer that speaks the wire protocol by hand (as a core of another version or a
    buggy one could), connected to a real ``MultiprocessEngine`` over loopback tcp."""

    def __init__(self, input_port: int, output_port: int) -> None:
        self.context = zmq.Context()
        self.commands = self.context.socket(zmq.DEALER)
        self.commands.setsockopt(zmq.IDENTITY, wire.core_identity(0))
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.connect(f"tcp://127.0.0.1:{input_port}")
        self.outputs = self.context.socket(zmq.PUSH)
        self.outputs.setsockopt(zmq.LINGER, 0)
        self.outputs.connect(f"tcp://127.0.0.1:{output_port}")
        self.to_front = wire.Codec(wire.ToFrontEnd)
        self.from_front = wire.Codec(wire.ToCore)

    def ready(self) -> None:
        info = wire.CoreInfo("fake", 64, 64, 1000, 5, None, {}, os.getpid(), [0])
        self.commands.send_multipart(wire.Codec(wire.Hello).encode(wire.Ready(0, info, wire.PROTOCOL_VERSION)))

    def next_add(self, timeout_ms: int = 10_000) -> wire.AddRequest:
        deadline = time.monotonic() + timeout_ms / 1000
        while time.monotonic() < deadline:
            if self.commands.poll(100):
                message = self.from_front.decode(self.commands.recv_multipart(copy=False))
                if isinstance(message, wire.AddRequest):
                    return message
        raise AssertionError("no request arrived")

    def send(self, message) -> None:
        self.outputs.send_multipart(self.to_front.encode(message))

    def close(self) -> None:
        self.commands.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()


def _token(request_id: str, token: int, finished: bool) -> wire.WireOutput:
    completion = wire.WireCompletion(0, "", [token], None, None, "length" if finished else None, None)
    return wire.WireOutput(request_id, finished, [completion], (0.0, None, None, None, None, 0, 0))


def test_an_unreadable_output_fails_its_request_only_and_a_broken_message_fails_the_core(checkpoint):
    """Through a real front end: an output that cannot be read fails that request alone
    (another stream of the same step goes on); a message that does not decode counts as the
    core's death: the streams still waiting end with ``EngineDeadError`` at once."""
    import asyncio
    import socket

    from pyengine.errors import EngineDeadError, EngineError
    from pyengine.multiprocess.client import MultiprocessEngine
    from pyengine.sampling_params import PoolingParams

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(engine=MultiprocessEngine(
        EngineConfig(model=str(checkpoint)), LinkOptions(transport="tcp", input_port=ports[0], output_port=ports[1],
                                                         local_cores=0, start_timeout=20))), daemon=True)
    thread.start()
    fake = FakeCore(*ports)
    try:
        fake.ready()
        thread.join(30)
        engine = box["engine"]

        async def run():
            embed = asyncio.ensure_future(engine.embed([1, 2, 3], PoolingParams()))
            text = asyncio.ensure_future(engine.generate([4, 5], SamplingParams(max_tokens=3)).__anext__())
            adds = {}
            for _ in range(2):
                add = await asyncio.to_thread(fake.next_add)
                adds["embed" if add.pooling else "text"] = add.request_id
            # One step: an embedding that is not an array (unreadable) and a good token.
            fake.send(wire.EngineCoreOutputs(0, [wire.WireOutput(adds["embed"], True, [], (0.0, None, None, None, None,
                                                                                   0, 0), 0, "not an array"),
                                           _token(adds["text"], 7, False)]))
            with pytest.raises(EngineError, match="could not be read"):
                await asyncio.wait_for(embed, 10)
            first = await asyncio.wait_for(text, 10)
            assert first.outputs[0].token_ids == [7]
            waiting = asyncio.ensure_future(engine.generate([8, 9], SamplingParams(max_tokens=3)).__anext__())
            await asyncio.to_thread(fake.next_add)
            fake.outputs.send_multipart([b"\xc1 not msgpack"])
            with pytest.raises(EngineDeadError, match="cannot read"):
                await asyncio.wait_for(waiting, 10)
            assert not engine.health().alive

        asyncio.run(run())
    finally:
        if "engine" in box:
            box["engine"].shutdown(timeout=2)
        fake.close()


def test_constrained_requests_compile_off_the_main_thread_and_fail_alone(checkpoint, tmp_path):
    """A constrained request is compiled and added by the core's compile thread: a bad
    grammar fails that request only, a good one is served, a plain request sent after them
    is served too, and an abort that comes while the constraint compiles still ends it."""
    from pyengine.structured_outputs import StructuredOutputsParams

    front = FrontEnd(tmp_path, "grammar")
    config = EngineConfig(model=str(checkpoint), num_kv_blocks=64, max_num_seqs=8)
    core = CoreMainLoop(config, front.input_address, front.output_address, 0, parent_pid=None, heartbeat_timeout=60)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(core.run()), daemon=True)
    thread.start()
    identity = wire.core_identity(0)
    to_core = wire.Codec(wire.ToCore)
    from_core = wire.Codec(wire.ToFrontEnd)

    def add(rid, params):
        message = wire.AddRequest(rid, np.array([5, 6, 7], dtype=np.int64), params, False, "delta")
        front.commands.send_multipart([identity, *to_core.encode(message)])

    try:
        assert front.commands.poll(60_000)
        front.commands.recv_multipart()
        add("bad", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
        add("choice", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta gamma"])))
        add("aborted", SamplingParams(max_tokens=1000, structured_outputs=StructuredOutputsParams(regex="[a-z ]+")))
        front.commands.send_multipart([identity, *to_core.encode(wire.Abort(["aborted"]))])
        add("plain", SamplingParams(max_tokens=5, ignore_eos=True))
        failed, text, finished, reasons = [], {}, set(), {}
        deadline = time.monotonic() + 60
        while {"choice", "plain", "aborted"} - finished and time.monotonic() < deadline:
            message = _receive(front.outputs, from_core)
            if isinstance(message, wire.EngineCoreOutputs):
                failed += [f.request_id for f in message.failures]
                for out in message.outputs:
                    text[out.request_id] = text.get(out.request_id, "") + out.completions[0].text
                    if out.finished:
                        finished.add(out.request_id)
                        reasons[out.request_id] = out.completions[0].finish_reason
        assert failed == ["bad"]
        assert {"choice", "plain", "aborted"} <= finished, finished
        assert text["choice"] in ("alpha", "beta gamma") and reasons["aborted"] == "abort"
        front.commands.send_multipart([identity, *to_core.encode(wire.Shutdown(timeout=2.0))])
        thread.join(30)
        assert result == [0]
    finally:
        core.stop_requested.set()
        thread.join(30)
        front.close()

"""The engine core's side of the link (``CoreLink``), against real zmq sockets in this
process: what it must get across (a ``LoadFailed`` sent just before the core exits), what
it must survive (a peer's malformed bytes), and that no send waits forever on a front end
that reads nothing. Every wait is bounded."""

from __future__ import annotations

import json

import zmq

from pyengine.config import EngineConfig
from pyengine.multiprocess import wire
from pyengine.multiprocess.core_process import CoreProcess


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
            core = CoreProcess(config, front.input_address, front.output_address, 0, parent_pid=None,
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

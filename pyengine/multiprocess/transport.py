"""The front end's side of the link: its two sockets and the frames that cross them.

The front end binds (ipc:// files in a private temporary folder, or tcp://) and the cores
connect: a ROUTER for commands (one DEALER per core, addressed by its identity, which is
also where a core's ``Ready`` or ``LoadFailed`` arrives) and a PULL for everything the
cores send afterwards. What the messages mean is ``wire.py``; the core's half of the link
is ``core_loop.CoreLink``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from typing import Any, Optional

import zmq

from pyengine.errors import EngineError
from pyengine.multiprocess import wire


def check_transport(transport: str) -> None:
    if transport not in ("ipc", "tcp"):
        raise EngineError(f"transport must be 'ipc' or 'tcp', got {transport!r}")


class UnreadableMessage(EngineError):
    """A core sent frames this front end cannot decode (the decoder's error is the cause)."""


class FrontEndLink:
    """Binds at construction (a failure closes what it opened); ``close`` removes the ipc
    folder too. ``send`` may be called from any thread; ``receive`` from one thread only
    (the receiver), ``receive_hello`` from the start-up only."""

    def __init__(self, transport: str, host: str = "127.0.0.1", input_port: int = 0,
                 output_port: int = 0) -> None:
        check_transport(transport)
        self.ipc_dir: Optional[str] = None
        self.context: Optional[zmq.Context] = None
        self._commands: Optional[zmq.Socket] = None
        self._outputs: Optional[zmq.Socket] = None
        self._send_lock = threading.Lock()  # the ROUTER socket and its codec
        self._codec = wire.Codec(wire.ToCore)
        self._hello_codec = wire.Codec(wire.Hello)
        self._out_codec = wire.Codec(wire.ToFrontEnd)  # the receiver thread's
        try:
            self.ipc_dir = tempfile.mkdtemp(prefix="pyengine-") if transport == "ipc" else None
            self.context = zmq.Context()
            self._bind(host, input_port, output_port)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._outputs, zmq.POLLIN)

    def _bind(self, host: str, input_port: int, output_port: int) -> None:
        assert self.context is not None
        self._commands = self.context.socket(zmq.ROUTER)
        self._commands.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a core that is gone raises
        self._commands.setsockopt(zmq.LINGER, 0)
        self._outputs = self.context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.LINGER, 0)
        if self.ipc_dir is not None:
            self._commands.bind(f"ipc://{self.ipc_dir}/input.sock")
            self._outputs.bind(f"ipc://{self.ipc_dir}/output.sock")
        else:
            self._commands.bind(f"tcp://{host}:{input_port or '*'}")
            self._outputs.bind(f"tcp://{host}:{output_port or '*'}")
        self.input_address: str = self._commands.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.output_address: str = self._outputs.getsockopt(zmq.LAST_ENDPOINT).decode()

    @staticmethod
    def local_address(address: str) -> str:
        """Where a core on this host connects: a wildcard bind is reached on loopback."""
        return address.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:").replace("tcp://[::]:", "tcp://[::1]:")

    def send(self, index: int, message: Any) -> None:
        """Never blocks (the event loop calls it): ``zmq.Again`` when core ``index``'s queue
        is full, another ``zmq.ZMQError`` when the core is not connected."""
        frames = [wire.core_identity(index)]
        with self._send_lock:
            if self._commands is None:  # closed (a send racing shutdown): as zmq says of a closed socket
                raise zmq.ZMQError(zmq.ENOTSOCK)
            frames += self._codec.encode(message)
            self._commands.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def receive_hello(self, timeout_ms: int) -> Optional[wire.Ready]:
        """A core's ``Ready`` within ``timeout_ms`` (None when none came); its ``LoadFailed``
        raised as its error; anything else (another version's hello, stray bytes) an
        ``EngineError`` that says so."""
        if not self._commands.poll(timeout_ms):
            return None
        frames = self._commands.recv_multipart(copy=False)
        try:
            hello = self._hello_codec.decode(frames[1:])
        except Exception as error:  # noqa: BLE001 - a peer's bytes: a clear error, not a decoder's traceback
            raise EngineError(f"an engine core ({bytes(frames[0].bytes)!r}) sent a hello this front end cannot "
                              f"read (a different pyengine version?): {error}") from None
        if isinstance(hello, wire.LoadFailed):
            raise wire.error_from_wire(hello.error_type, f"engine core {hello.engine_index} failed to "
                                       f"load: {hello.message}")
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            raise EngineError(f"engine core {hello.engine_index} speaks link protocol {hello.protocol_version}, "
                              f"this front end {wire.PROTOCOL_VERSION}: run the same pyengine version on both")
        return hello

    def receive(self, timeout_ms: int) -> Any:
        """The next message from a core within ``timeout_ms`` (None when none came);
        ``UnreadableMessage`` when its frames do not decode (which core sent it is unknown:
        the PULL socket says nothing)."""
        if not self._poller.poll(timeout_ms):
            return None
        frames = self._outputs.recv_multipart(copy=False)
        try:
            return self._out_codec.decode(frames)
        except Exception as error:  # noqa: BLE001 - a peer's bytes: the caller decides what it costs
            raise UnreadableMessage(str(error)) from error

    def close(self) -> None:
        """Closes the sockets and the context and removes the ipc folder (idempotent)."""
        with self._send_lock:  # no send is half way through the socket being closed
            for socket in (self._commands, self._outputs):
                if socket is not None:
                    socket.close(linger=0)
            self._commands = self._outputs = None
        if self.context is not None:
            self.context.term()
            self.context = None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)

"""``LiveServer``: the app on a real uvicorn server, in a background thread, on a free
loopback port. For tests (``pyengine/server`` ships no test helper); it never binds beyond
127.0.0.1 unless told to."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from pyengine.entrypoints.engine_client import EngineClient
from pyengine.server.app import create_app
from pyengine.server.args import ServerArgs
from pyengine.server.http_protocol import uvicorn_options


class LiveServer:
    """``with LiveServer(engine, args) as server: server.url`` — uvicorn in a thread.

    The engine is the caller's: it is not shut down here."""

    def __init__(self, engine: EngineClient, args: Optional[ServerArgs] = None, host: str = "127.0.0.1",
                 port: int = 0, start_timeout: float = 30.0) -> None:
        import uvicorn

        self.engine = engine
        self.args = args or ServerArgs()
        self.app = create_app(engine, self.args)
        # The same head limits as `pyengine serve` (uvicorn_options), so tests meet them.
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_config=None,
                                                    log_level="warning", lifespan="on",
                                                    timeout_keep_alive=30, timeout_graceful_shutdown=2,
                                                    **uvicorn_options(self.args)))
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def context(self) -> Any:
        return self.app.state.context

    def start(self) -> LiveServer:
        self._thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        sockets = [s for server in self.server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

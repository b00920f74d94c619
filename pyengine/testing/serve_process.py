"""``pyengine serve`` in a child process, for tests and benchmarks: started on a free
loopback port, waited for (bounded) until ``/health`` answers 200, stopped with Ctrl-C and
reaped (killed when it does not exit). The waits multi-process tests use with it
(``wait_until``, ``pid_alive``) are in ``pyengine.testing.waits``.

The child runs the installed pyengine (``python_module_command``), never a source
checkout the current folder may hold."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import TracebackType
from typing import Any, Optional

from pyengine.processes.child_command import python_module_command
from pyengine.testing.waits import child_pids, free_port, pid_alive


class ServeProcess:
    """``pyengine serve *args`` on ``127.0.0.1`` and a free port (``url``). ``popen``
    options (``env``, ``stderr``, ``preexec_fn``, ...) go to ``subprocess.Popen``. Use as a
    context manager, or call ``stop`` in a ``finally``."""

    def __init__(self, args: list[str], **popen: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(  # noqa: S603 - our own command line
            python_module_command("pyengine", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)),
            **popen)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_up(self, timeout: float = 120.0) -> ServeProcess:
        """Returns once ``/health`` answers 200; ``RuntimeError`` when the server exits
        first (with its stderr, if captured) or is not up within ``timeout`` seconds."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                stderr = self.proc.stderr.read() if self.proc.stderr is not None else ""
                raise RuntimeError(f"the server exited with {self.proc.returncode} before it was up: {stderr}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server did not come up within {timeout:.0f}s")

    def core_pids(self) -> list[int]:
        """The server's child processes (its engine cores), while it runs."""
        return child_pids(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """Ctrl-C (the server drains and stops its cores), killed after ``timeout``
        seconds; reaped either way. Its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    def kill(self) -> Optional[int]:
        """SIGKILL (nothing drains), reaped."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(30)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, kind: Optional[type[BaseException]], error: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop()


def sigkill(pid: int) -> None:
    """SIGKILL to ``pid`` if it still runs (a test's last resort for a child it did not start)."""
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

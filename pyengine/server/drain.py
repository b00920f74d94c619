"""Graceful shutdown for ``pyengine serve``: a drain in front of uvicorn's own shutdown.

Left to itself, uvicorn answers SIGTERM / SIGINT by closing the listener and waiting
``timeout_graceful_shutdown`` for the connections to finish; then it cancels their tasks
(logging a traceback for each: 64 pretty-printed tracebacks took 117 s) and, once
``serve`` returns, re-raises the signal, which kills the process (status -15) before the
engine's shutdown and the last log lines, with every stream cut short. Instead:

- ``DrainingServer.handle_exit`` (uvicorn's hook for signals) starts the ``Drain`` and sets
  ``should_exit``, so uvicorn closes the listener and lets the connections finish as usual,
  but does not record the signal for re-raising: the command's cleanup runs and it exits 0.
  A second signal ends the drain at once, in place of uvicorn's ``force_exit`` (which skips
  the lifespan shutdown and leaves the requests to be cancelled, again with a traceback
  each, by ``asyncio.run``).
- ``DrainMiddleware`` answers a request that still arrives with a 503, and when the drain
  ends (``drain_timeout`` seconds, or the second signal) cancels the requests still running
  (their engine requests are aborted as their generators unwind) and ends each response
  itself: a stream with an error event and ``[DONE]``, a response not yet begun with a 503.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any, Optional

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pyengine.server.errors import APIError, error_response
from pyengine.server.sse import DONE, error_event

SHUTTING_DOWN = APIError(503, "the server is shutting down", code="server_shutting_down")
# uvicorn's own deadline, after ours: only reached if ending a response itself hangs
# (a client that does not read). Then uvicorn cancels what is left, as it always did.
BACKSTOP_S = 5.0


class Drain:
    """The shutdown's state, shared by the server (signals) and the middleware (requests)."""

    def __init__(self, timeout: float, logger: Any) -> None:
        self.timeout = timeout
        self.logger = logger
        self.draining = False
        self._ended: Optional[asyncio.Future[None]] = None
        self.running = 0  # requests in flight
        self.cut = 0  # requests ended by the drain
        self._timer: Optional[asyncio.TimerHandle] = None

    def begin(self, sig: int) -> None:
        """First signal: refuse new requests, end the running ones after the timeout;
        a later signal ends them now."""
        name = signal.Signals(sig).name
        if self.draining:
            self.end(f"second {name}")
            return
        self.draining = True
        self.logger.info("draining", signal=name, requests_in_flight=self.running, drain_timeout=self.timeout)
        self._timer = asyncio.get_running_loop().call_later(self.timeout, self.end, "drain timeout")

    def ended(self) -> asyncio.Future[None]:
        """Done when the drain ends; one future that every request waits on."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
        return self._ended

    def end(self, reason: str) -> None:
        if self.ended().done():
            return
        if self._timer is not None:
            self._timer.cancel()
        if self.running:  # one line for all of them, not one per request
            self.logger.warning("ending requests still in flight", requests=self.running, reason=reason)
        self.ended().set_result(None)


class DrainingServer(uvicorn.Server):
    """uvicorn's ``Server`` whose signals start a ``Drain`` and are never re-raised."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # A signal handler: hand the work to the loop rather than run it between bytecodes.
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.drain.begin, sig)


class _Tracked:
    """A ``send`` that remembers how far the response got."""

    def __init__(self, send: Send) -> None:
        self.send_to = send
        self.started = self.complete = self.stream = False

    async def send(self, message: Message) -> None:
        await self.send_to(message)
        if message["type"] == "http.response.start":
            self.started = True
            headers = dict(message.get("headers", []))
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


class DrainMiddleware:
    """Outermost ASGI layer: 503 while draining; ends the responses the drain cuts."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await error_response(SHUTTING_DOWN)(scope, receive, send)
            return
        tracked = _Tracked(send)
        # The request runs in its own task so that the drain can cancel it and still
        # finish the response here; uvicorn's task never sees the cancellation.
        task = asyncio.ensure_future(self.app(scope, receive, tracked.send))
        self.drain.running += 1
        try:
            await asyncio.wait((task, self.drain.ended()), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await self._cut(task, tracked, scope, receive, send)
                return
        except asyncio.CancelledError:
            task.cancel()
            if not self.drain.draining:
                raise
            # uvicorn's backstop (a client that does not read what ends its stream): it
            # logs one line for an unfinished response, where a raise logs a traceback.
            return
        finally:
            self.drain.running -= 1
        task.result()  # the app's own exception, if any, goes to uvicorn as before

    async def _cut(self, task: asyncio.Future[None], tracked: _Tracked, scope: Scope, receive: Receive,
                   send: Send) -> None:
        """Cancels the request (its engine requests are aborted as it unwinds) and ends its
        response: a 503 if none began, else an error event and ``[DONE]`` for a stream."""
        task.cancel()
        await asyncio.wait((task,))  # does not raise the task's cancellation
        if not task.cancelled() and task.exception() is None and tracked.complete:
            return  # it finished before the cancellation reached it
        if not task.cancelled() and task.exception() is not None:
            self.drain.logger.warning("a request failed while the drain ended it", error=repr(task.exception()))
        self.drain.cut += 1
        if not tracked.started:
            await error_response(SHUTTING_DOWN)(scope, receive, send)
        elif not tracked.complete:
            body = error_event(SHUTTING_DOWN) + DONE if tracked.stream else b""
            await send({"type": "http.response.body", "body": body, "more_body": False})


__all__ = ["Drain", "DrainingServer", "DrainMiddleware", "SHUTTING_DOWN"]

"""A lean load generator's HTTP/1.1 client: one keep-alive connection per request in
flight, raw asyncio streams, no connection pool.

Why not httpx: with 128 streams in flight, httpx's pool left the next wave of requests
waiting about 2 s for a connection when the previous wave ended together (it opened ~90
new TCP connections 2-2.5 s after the requests were started, while the engine idled),
and its per-chunk cost (``aiter_lines`` through several layers of async generators) was
~150 us of client CPU per streamed token, on the CPU the server's front end shares with
the client in ``serve_vs_offline.py``. This client costs a fraction of that, so a benchmark
measures the server rather than its load generator.

Only what ``serve.py`` needs: ``POST`` a JSON body and read the response, either whole
(``Content-Length``) or chunked, handing each server-sent event's ``data`` to the caller
as it arrives. Every read is bounded by the caller's timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Optional
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    """A response other than 200: ``status`` and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class Connection:
    """One keep-alive connection; one request at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"only http:// URLs with a host, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.authority = parts.netloc.encode()
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None

    async def stream_events(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """``POST path`` with the JSON ``body``; yields each event's data (the bytes after
        ``data: ``) as it arrives. ``HTTPStatusError`` for a status other than 200. The
        connection is reused when the response ended cleanly, else closed."""
        if self._writer is None:
            await self._connect()
        assert self._reader is not None and self._writer is not None
        clean = False
        try:
            self._writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                               b"Accept: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                               % (path.encode(), self.authority, len(body), body))
            status, headers = await self._read_head()
            if status != 200:
                raise HTTPStatusError(status, await self._read_body(headers))
            pending = b""
            async for piece in self._body_pieces(headers):
                pending += piece
                *events, pending = pending.split(b"\n\n")
                for ev in events:
                    if ev.startswith(b"data: "):
                        yield ev[6:]
            clean = headers.get(b"connection") != b"close"
        finally:
            if not clean:
                self.close()

    async def _read_head(self) -> tuple[int, dict[bytes, bytes]]:
        assert self._reader is not None
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip().lower() if name.lower() in (
                    b"connection", b"transfer-encoding") else value.strip()
        return status, headers

    async def _read_body(self, headers: dict[bytes, bytes]) -> bytes:
        return b"".join([piece async for piece in self._body_pieces(headers)])

    async def _body_pieces(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        assert self._reader is not None
        if headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await self._reader.readuntil(b"\r\n")  # no trailers are sent: the empty line
                    return
                data = await self._reader.readexactly(size + 2)
                yield data[:-2]
        elif b"content-length" in headers:
            yield await self._reader.readexactly(int(headers[b"content-length"]))
        else:
            yield await self._reader.read()  # until the server closes
            self.close()


class ConnectionPool:
    """Idle connections to one server, handed out one per request; a new one is opened
    when none is idle (concurrency is the caller's to bound)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._idle: list[Connection] = []
        self._all: list[Connection] = []

    @property
    def opened(self) -> int:
        """Connections this pool has made (reuse keeps it at the concurrency reached)."""
        return len(self._all)

    def take(self) -> Connection:
        if self._idle:
            return self._idle.pop()
        connection = Connection(self.url)
        self._all.append(connection)
        return connection

    def give_back(self, connection: Connection) -> None:
        self._idle.append(connection)

    def close(self) -> None:
        for connection in self._all:
            connection.close()
        self._idle.clear()
        self._all.clear()

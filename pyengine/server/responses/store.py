"""``ResponseStore``: the responses kept for ``previous_response_id`` and
``GET /v1/responses/{id}``, bounded in count and in bytes.

Each entry is a finished response (as returned) and the conversation a follow-up
continues (its input messages, without instructions, and its output as an assistant
turn), copied whole, so that an entry never depends on an older one that may have been
evicted. Least recently used entries go first once there are more than ``max_entries``
(``--responses-store-size``, 0 keeps nothing) or they weigh more than ``max_bytes``
(``--responses-store-max-bytes``: the bytes kept, each entry held as its encoded JSON,
UTF-8, so the bound is the memory the entries hold rather than a guess at what live dicts
weigh); one entry heavier than the whole budget is not kept. An entry is encoded once
when it is stored and decoded only when a follow-up (``previous_response_id``) reads its
history; ``GET`` returns the stored bytes as they are. A request with ``store=false`` is not kept. Everything
lives in the server's memory, per server process: it is gone on restart, and replicas
behind a load balancer do not share it. The store is used from the event loop only (no
lock)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import msgspec


@dataclass(frozen=True)
class StoredResponse:
    response_json: bytes  # the response object, as returned
    history_json: bytes  # the chat messages a follow-up continues from

    @property
    def size(self) -> int:
        """Bytes, as counted against ``max_bytes``."""
        return len(self.response_json) + len(self.history_json)

    @property
    def response(self) -> dict[str, Any]:
        return msgspec.json.decode(self.response_json)

    @property
    def history(self) -> list[dict[str, Any]]:
        """A fresh copy: the caller may extend it."""
        return msgspec.json.decode(self.history_json)


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, response: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keeps the response (evicting the least recently used past the bounds); False
        when it is not kept (the store is off, or it alone outweighs ``max_bytes``)."""
        if self.max_entries == 0:
            return False
        entry = StoredResponse(msgspec.json.encode(response), msgspec.json.encode(history))
        if entry.size > self.max_bytes:
            return False
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[response_id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

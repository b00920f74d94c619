"""``ResponseStore``: the responses kept for ``previous_response_id`` and
``GET /v1/responses/{id}``, bounded in count and in bytes.

Each entry is a finished response (as returned) and the conversation a follow-up
continues (its input messages, without instructions, and its output as an assistant
turn), copied whole, so that an entry never depends on an older one that may have been
evicted. Least recently used entries go first once there are more than ``max_entries``
(``--responses-store-size``, 0 keeps nothing) or they weigh more than ``max_bytes``
(``--responses-store-max-bytes``: the JSON size of what is kept); one entry heavier than
the whole budget is not kept. A request with ``store=false`` is not kept. Everything
lives in the server's memory, per server process: it is gone on restart, and replicas
behind a load balancer do not share it. The store is used from the event loop only (no
lock)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    history: list[dict[str, Any]]  # chat messages a follow-up continues from
    size: int  # bytes, as counted against max_bytes


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
        size = len(json.dumps(response)) + len(json.dumps(history))
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[response_id] = StoredResponse(response, history, size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.size
        return True

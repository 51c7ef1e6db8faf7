"""The Responses API's stored responses: what ``previous_response_id`` continues and
``GET`` / ``DELETE /v1/responses/{id}`` read, as OpenAI's (and vLLM's) server keeps them.

Agent frameworks (the OpenAI Agents SDK among them) send only the new turn and name the
response it follows. A stored response keeps its body and its conversation: the input items
of every turn of its chain, then its own output items, so the next turn's prompt is rendered
from exactly the items an explicit ``input`` would have carried (instructions are not carried
over, as in OpenAI's API). In memory, per server, the least recently used dropped beyond
``capacity``: a restart forgets them, and a continuation of a forgotten response is a 404
naming ``previous_response_id``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]
    # The chain's input items and this response's output items, as JSON.
    conversation: list[dict[str, Any]]


class ResponseStore:
    """Responses by id; the least recently used goes beyond ``capacity`` (0: none kept)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

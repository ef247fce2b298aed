"""Stored Responses (`store: true`), for `previous_response_id`, GET and DELETE: a bounded LRU in memory.

Each entry holds its response object and the conversation it answered (every input item, earlier turns'
included, instructions excepted: OpenAI does not carry them over), so a chained request is that
conversation + the response's output + its own input. The lists share their item dicts, so a long chain
costs one reference per item per stored turn, not copies. Gone on restart, as any in-memory cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_NUM_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    input_items: list[dict]

    @property
    def conversation(self) -> list[dict]:
        """What a response chained onto this one continues: its inputs, then its output."""
        return self.input_items + self.response["output"]


class ResponseStore:
    def __init__(self, max_num_responses: int = DEFAULT_MAX_NUM_RESPONSES) -> None:
        if max_num_responses < 1:
            raise ValueError("max_num_responses must be >= 1")
        self.max_num_responses = max_num_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, input_items: list[dict]) -> None:
        self._entries[response["id"]] = StoredResponse(response, input_items)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_num_responses:
            self._entries.popitem(last=False)  # the least recently used

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

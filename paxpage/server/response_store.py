"""The answers of /v1/responses kept for `previous_response_id`: a bounded in-memory LRU. Each
entry is the response object and the conversation up to and including its answer (chat
messages), so a follow-up continues it. Lost on restart; the oldest entry goes first."""

from __future__ import annotations

import collections
import threading


class ResponseStore:
    def __init__(self, max_entries: int):
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.max_entries == 0:
            return
        with self._lock:
            self._entries[response["id"]] = (response, conversation)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def __len__(self) -> int:
        return len(self._entries)

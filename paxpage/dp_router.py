"""Data-parallel routing: which engine replica gets a request. Pure Python, no jax.

Each replica has its own KV pool and prefix cache, so a prompt whose prefix a replica has seen
is cheapest there: its cached pages are reused instead of recomputed. The router keeps its own
record of the full-page prefixes it sent to each replica (chained hashes of page_size-token
pages, as the page manager keys its cache) and sends a request to the replica holding the
longest run of the prompt's leading pages; with no such prefix anywhere (or a tie), to the
least loaded replica (fewest live requests), then the lowest index. The record is what the
router sent, not what the replica still caches (a replica may have evicted those pages since):
a cheap, lock-free estimate, as cache-aware routers in front of vLLM keep one. It remembers at
most `max_pages` page keys per replica, forgetting the least recently used.
"""

from __future__ import annotations

import collections
from typing import Sequence


class PrefixRouter:
    def __init__(self, num_replicas: int, page_size: int, max_pages: int = 1 << 16):
        if num_replicas < 1 or page_size < 1 or max_pages < 1:
            raise ValueError(f"num_replicas {num_replicas}, page_size {page_size} and max_pages "
                             f"{max_pages} must be positive")
        self.num_replicas = num_replicas
        self.page_size = page_size
        self.max_pages = max_pages
        # per replica: page key -> None, in least-recently-used-first order
        self._seen = [collections.OrderedDict() for _ in range(num_replicas)]

    def page_keys(self, prompt_ids: Sequence[int]) -> list[int]:
        """Chained keys of the prompt's full pages: key i names pages 0..i together."""
        keys, parent = [], None
        for start in range(0, len(prompt_ids) - self.page_size + 1, self.page_size):
            parent = hash((parent, tuple(prompt_ids[start:start + self.page_size])))
            keys.append(parent)
        return keys

    def cached_pages(self, replica: int, keys: Sequence[int]) -> int:
        """How many of the leading `keys` the router has sent to `replica`."""
        seen = self._seen[replica]
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        return n

    def route(self, prompt_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for this prompt (see the module docstring); records its pages there.
        loads[i]: live requests on replica i."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"got {len(loads)} loads for {self.num_replicas} replicas")
        keys = self.page_keys(prompt_ids)
        hits = [self.cached_pages(i, keys) for i in range(self.num_replicas)]
        best = min(range(self.num_replicas), key=lambda i: (-hits[i], loads[i], i))
        seen = self._seen[best]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_pages:
            seen.popitem(last=False)
        return best

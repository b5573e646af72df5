"""Paged KV-cache allocator: reference-counted pages, copy-on-write, prefix caching. Pure Python (no jax).

Every page id 0..num_pages-1 is allocatable. A page is in exactly one of three states:
  free       refcount 0, not in the prefix cache, in the free heap
  evictable  refcount 0, registered in the prefix cache (its K/V is still valid), in the LRU dict
  used       refcount > 0 == number of page tables that contain it

Allocation order (deterministic, tested): free pages lowest id first; only when none are left, evictable pages
in LRU order (least recently released first), which drops them from the prefix cache.

Prefix caching: a FULL, computed page is keyed by hash((parent_key, tuple(its token ids))), parent_key of the
first page = the sequence's `prefix_root` (None, or its LoRA adapter), so a key names the whole prefix. The manager also stores (parent_key, tokens) per cached
page and compares them on lookup, so a hash collision is a miss, never wrong K/V. Cached pages are immutable;
only a sequence's last, partial page is ever written. A sequence frees its pages last-page-first, so the tail
of a prefix chain is evicted before its head (a head without its tail is still useful; a tail without its
head never matches).

Copy-on-write: before a sequence writes positions [num_computed, num_computed + q) it must own (refcount 1)
every page the write touches. A shared page gets a fresh page; if the shared page already holds valid tokens
of this sequence (positions before num_computed) the manager returns a (src, dst) copy that the device must
run BEFORE the step; the sequence's table then points at dst and src is decref'ed.

Sliding window: when every layer of the model attends only to its last W keys, a page all of whose
positions lie before the window of the sequence's next token is never read again.
`release_outside_window` frees it and leaves RELEASED (-1) in its table entry, so logical indices
are kept and the sequence holds O(W) pages however long it grows. A released page that is in the
prefix cache stays registered (it becomes evictable like any unreferenced cached page, its K/V
still valid), so another sequence with the same prefix can still hit it; releasing head pages
first means a chain may lose its head to eviction before its tail (the tail then never matches:
a miss, never wrong K/V). Preemption frees the remaining pages and recomputes from position 0 as
usual.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable

from paxpage.sequence import Sequence


RELEASED = -1  # page-table entry of a page released because it lies wholly outside the window


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def held(table: Iterable[int]) -> list[int]:
    """The pages a table holds (RELEASED entries skipped)."""
    return [page for page in table if page != RELEASED]


class PageManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = False):
        if num_pages < 1:
            raise ValueError(f"num_pages is {num_pages}; need at least 1")
        if page_size < 1:
            raise ValueError(f"page_size is {page_size}; need at least 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount: list[int] = [0] * num_pages
        # Pages with refcount > 1 (prefix hits, forks) -> the tokens each holder has in it. Every
        # holder has the same (a prefix hit shares full pages; a fork shares its parent's pages
        # at the parent's computed count), and no holder writes a shared page (it copies it
        # first), so the count is fixed while the page is shared.
        self._shared_fill: dict[int, int] = {}
        self._excess_tokens = 0  # sum over shared pages of (refcount - 1) * fill
        self._free: list[int] = list(range(num_pages))  # min-heap of free page ids (a sorted list is a heap)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU order: first = evicted first
        self._key_to_page: dict[int, int] = {}
        self._page_key: dict[int, int] = {}
        self._page_content: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # page -> (parent_key, tokens)
        self.prefix_queries_tokens = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of which found cached

    # ---- counts -------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get now: free + evictable cached."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (used or evictable)."""
        return len(self._page_key)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    def usage(self) -> float:
        """Fraction of pages referenced by some page table."""
        return self.num_used_pages / self.num_pages

    @property
    def num_shared_pages(self) -> int:
        """Pages that more than one page table holds."""
        return len(self._shared_fill)

    @property
    def num_excess_tokens(self) -> int:
        """Tokens that the page tables count more than once: the sum of the holders' token counts
        in each page less the page's own (a sequence's tokens less this are the pool's)."""
        return self._excess_tokens

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return page in self._page_key

    def free_pages(self) -> list[int]:
        """Free (uncached) pages in allocation order."""
        return sorted(self._free)

    def evictable_pages(self) -> list[int]:
        """Evictable cached pages in eviction (LRU) order."""
        return list(self._evictable)

    def num_pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    # ---- page-level operations ----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1: free pages lowest id first, then evicted cached pages in LRU order."""
        if n > self.num_free_pages:
            raise ValueError(f"cannot allocate {n} pages; {self.num_free_pages} free of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                page = heapq.heappop(self._free)
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unregister(page)
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def incref(self, pages: Iterable[int], fills: Iterable[int] | None = None) -> None:
        """Add a reference to used pages, or revive evictable cached pages (refcount 0 -> 1).
        fills: the tokens the new holder has in each page (default: full pages)."""
        pages = list(pages)
        for page, fill in zip(pages, [self.page_size] * len(pages) if fills is None else fills):
            if self._refcount[page] == 0:
                if page not in self._evictable:
                    raise ValueError(f"page {page} is free; only used or cached pages can be incref'ed")
                del self._evictable[page]
            self._refcount[page] += 1
            if self._refcount[page] >= 2:
                fill = self._shared_fill.setdefault(page, fill)
                self._excess_tokens += fill

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per page, in the given order. At refcount 0 a cached page becomes evictable
        (appended to the LRU end), any other page free."""
        refcount, shared, cached, evictable = self._refcount, self._shared_fill, self._page_key, self._evictable
        freed = []
        for page in pages:
            count = refcount[page] - 1
            if count < 0:
                raise ValueError(f"page {page} has refcount {count + 1}; double free")
            refcount[page] = count
            if count == 0:
                if page in cached:
                    evictable[page] = None
                else:
                    freed.append(page)
            elif page in shared:
                self._excess_tokens -= shared[page]
                if count == 1:
                    del shared[page]
        for page in freed:
            heapq.heappush(self._free, page)

    # ---- sequence-level operations ------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Free all of seq's pages (last page first) and reset it to hold nothing (num_computed_tokens = 0)."""
        self.free(reversed(held(seq.page_table)))
        seq.page_table = []
        seq.num_computed_tokens = 0
        seq.num_pages_cache_checked = 0
        seq.num_released_pages = 0

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares all of parent's pages (incref) and its computed tokens."""
        if child.page_table:
            raise ValueError(f"fork child {child.seq_id} already holds pages {child.page_table}")
        child.page_table = list(parent.page_table)
        ps, nc = self.page_size, parent.num_computed_tokens
        self.incref(held(child.page_table),
                    [min(ps, max(0, nc - i * ps)) for i, page in enumerate(child.page_table) if page != RELEASED])
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_released_pages = parent.num_released_pages
        num_full = parent.num_computed_tokens // self.page_size
        child.page_keys = parent.page_keys[:num_full]
        child.num_pages_cache_checked = min(parent.num_pages_cache_checked, num_full)

    def release_outside_window(self, seq: Sequence, window: int) -> list[int]:
        """Frees seq's pages wholly before the window of its next token (position num_computed,
        which sees keys num_computed - window + 1 onwards) and marks them RELEASED; returns them."""
        first_needed = max(0, seq.num_computed_tokens - window + 1) // self.page_size
        released = []
        for i in range(seq.num_released_pages, min(first_needed, len(seq.page_table))):
            page = seq.page_table[i]
            if page != RELEASED:
                released.append(page)
                seq.page_table[i] = RELEASED
        seq.num_released_pages = max(seq.num_released_pages, first_needed)
        self.free(released)
        return released

    def truncate(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Speculative rollback: frees seq's pages wholly past its first num_tokens positions (last page
        first; they hold only rejected drafts' K/V, so none is cached) and returns them."""
        keep = self.num_pages_for(num_tokens)
        assert num_tokens >= seq.num_computed_tokens, (num_tokens, seq)
        dropped = seq.page_table[keep:]
        assert not any(page in self._page_key for page in dropped), f"rollback of a cached page in {seq}"
        del seq.page_table[keep:]
        self.free(reversed(held(dropped)))
        return dropped

    def num_pages_to_write(self, seq: Sequence, num_new_tokens: int, reserve_tokens: int = 0) -> int:
        """Pages `prepare_write(seq, num_new_tokens, reserve_tokens)` will allocate: new pages to cover
        max(num_computed + num_new_tokens, reserve_tokens) tokens, plus one per shared page the write touches."""
        end = seq.num_computed_tokens + num_new_tokens
        target = self.num_pages_for(max(end, reserve_tokens))
        num_new = max(0, target - len(seq.page_table))
        num_cow = sum(1 for i in self._write_range(seq, end) if self._refcount[seq.page_table[i]] > 1)
        return num_new + num_cow

    def writes_in_place(self, seq: Sequence) -> bool:
        """True when seq's next token (one, no reserve) lands in a page of its table that it alone
        holds: `num_pages_to_write(seq, 1) == 0`, and `prepare_write(seq, 1)` would change nothing,
        in O(1) (a decode step's common case)."""
        index = seq.num_computed_tokens // self.page_size
        table = seq.page_table
        return index < len(table) and self._refcount[table[index]] == 1

    def prepare_write(self, seq: Sequence, num_new_tokens: int, reserve_tokens: int = 0) -> list[tuple[int, int]]:
        """Make seq own every page it writes this step and extend its table; returns (src, dst) copies."""
        need = self.num_pages_to_write(seq, num_new_tokens, reserve_tokens)
        if need > self.num_free_pages:
            raise ValueError(
                f"sequence {seq.seq_id} needs {need} pages to write {num_new_tokens} tokens; "
                f"{self.num_free_pages} free"
            )
        nc = seq.num_computed_tokens
        end = nc + num_new_tokens
        copies = []
        for i in self._write_range(seq, end):
            page = seq.page_table[i]
            # cached pages are full and computed by every holder, so a write never lands in one
            assert page not in self._page_key, f"write into cached page {page} of {seq}"
            if self._refcount[page] > 1:
                (dst,) = self.allocate(1)
                if i * self.page_size < nc:  # holds valid tokens before the write position: keep them
                    copies.append((page, dst))
                seq.page_table[i] = dst
                self.free([page])
        target = self.num_pages_for(max(end, reserve_tokens))
        if target > len(seq.page_table):
            seq.page_table.extend(self.allocate(target - len(seq.page_table)))
        return copies

    def _write_range(self, seq: Sequence, end: int) -> range:
        """Indices of existing table entries that positions [num_computed, end) fall into."""
        return range(seq.num_computed_tokens // self.page_size, min(len(seq.page_table), self.num_pages_for(end)))

    # ---- prefix cache -------------------------------------------------------------------------------
    def _key(self, seq: Sequence, index: int) -> int:
        """Chained key of seq's full logical page `index` (memoised in seq.page_keys)."""
        keys = seq.page_keys
        assert (index + 1) * self.page_size <= seq.num_tokens, "only full pages have keys"
        if len(keys) <= index:
            _chain_keys(seq, len(keys), _pages_of(seq, len(keys), index + 1, self.page_size))
        return keys[index]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Longest chain of cached pages holding seq's leading tokens, capped at (num_tokens - 1) // page_size
        pages so at least one token is left to compute (its logits are needed). No side effects."""
        if not self.enable_prefix_caching or not seq.use_prefix_cache:
            return []
        pages: list[int] = []
        parent = seq.prefix_root
        for i in range((seq.num_tokens - 1) // self.page_size):
            key = self._key(seq, i)
            page = self._key_to_page.get(key)
            if page is None or self._page_content[page] != (parent, seq.page_tokens(i, self.page_size)):
                break
            pages.append(page)
            parent = key
        return pages

    def num_revived(self, pages: Iterable[int]) -> int:
        """How many of these cached pages are evictable, i.e. would leave the free pool when incref'ed."""
        return sum(1 for p in pages if self._refcount[p] == 0)

    def acquire_prefix(self, seq: Sequence, pages: list[int]) -> None:
        """Admit seq (holding nothing) with the cached pages from match_prefix; records hit statistics."""
        if seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"{seq} must hold no pages when admitted")
        self.incref(pages)
        seq.page_table = list(pages)
        seq.num_computed_tokens = len(pages) * self.page_size
        seq.num_cached_tokens = seq.num_computed_tokens
        seq.num_pages_cache_checked = len(pages)
        if self.enable_prefix_caching:
            self.prefix_queries_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_computed_tokens

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register seq's pages that are full and computed. If another page already caches the same prefix,
        seq's page stays private (freed normally)."""
        if not self.enable_prefix_caching:
            return
        ps, first = self.page_size, seq.num_pages_cache_checked
        num_full = seq.num_computed_tokens // ps
        if num_full <= first:
            return
        if first and len(seq.page_keys) < first:
            self._key(seq, first - 1)  # the chain up to the first page looked at
        # Each page's tokens are taken once (a prefill registers all its pages in one call): its
        # key where not memoised yet, and its content.
        pages = _pages_of(seq, first, num_full, ps)
        _chain_keys(seq, first, pages)
        keys, table, key_to_page, page_key = seq.page_keys, seq.page_table, self._key_to_page, self._page_key
        for i, tokens in enumerate(pages, first):
            content = (keys[i - 1] if i else seq.prefix_root, tokens)
            page = table[i]
            if page == RELEASED or page in page_key:
                continue
            key = keys[i]
            if key in key_to_page:
                continue
            key_to_page[key] = page
            page_key[page] = key
            self._page_content[page] = content
        seq.num_pages_cache_checked = num_full

    def _unregister(self, page: int) -> None:
        key = self._page_key.pop(page)
        del self._key_to_page[key]
        del self._page_content[page]

    # ---- invariants ---------------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless: every page is free / evictable / used, exactly one; refcount == number
        of page tables (of `seqs`, all live sequences) holding it; free + evictable + used == num_pages; the
        prefix-cache maps are consistent and each cached page in a table holds that sequence's prefix."""
        holders: Counter[int] = Counter()
        for seq in seqs:
            table = held(seq.page_table)
            _check(len(set(table)) == len(table), f"duplicate page in {seq}")
            _check(RELEASED not in seq.page_table[seq.num_released_pages:], f"released page past the window in {seq}")
            _check(len(seq.page_table) * self.page_size >= seq.num_computed_tokens, f"table too short for {seq}")
            holders.update(table)
            num_full = seq.num_computed_tokens // self.page_size
            for i, page in enumerate(seq.page_table):
                if page in self._page_key:
                    _check(i < num_full, f"cached page {page} is not full and computed in {seq}")
                    _check(self._page_key[page] == self._key(seq, i), f"cached page {page} mismatches {seq}")
        free = set(self._free)
        evictable = set(self._evictable)
        used = {p for p in range(self.num_pages) if self._refcount[p] > 0}
        _check(len(free) == len(self._free), f"duplicate id in free heap {sorted(self._free)}")
        _check(not free & evictable, f"pages both free and evictable: {sorted(free & evictable)}")
        _check(not free & used, f"pages both free and used: {sorted(free & used)}")
        _check(not evictable & used, f"pages both evictable and used: {sorted(evictable & used)}")
        _check(len(free) + len(evictable) + len(used) == self.num_pages, "pages lost or duplicated")
        _check(set(self._shared_fill) == {p for p, r in enumerate(self._refcount) if r > 1}, "shared pages are off")
        _check(self._excess_tokens == sum((self._refcount[p] - 1) * f for p, f in self._shared_fill.items()),
               "excess token count is off")
        for page in range(self.num_pages):
            _check(
                self._refcount[page] == holders[page],
                f"page {page}: refcount {self._refcount[page]} but {holders[page]} tables hold it",
            )
        _check(evictable <= self._page_key.keys(), "evictable page not cached")
        _check(not free & self._page_key.keys(), "free page still cached")
        _check(
            all(self._key_to_page.get(k) == p for p, k in self._page_key.items())
            and len(self._key_to_page) == len(self._page_key) == len(self._page_content),
            "prefix-cache maps inconsistent",
        )


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise AssertionError(msg)


def _chain_keys(seq: Sequence, first: int, pages: list[tuple[int, ...]]) -> None:
    """Memoises in seq.page_keys the chained prefix-cache keys of its logical pages first,
    first + 1 ..., whose token tuples are `pages` (those memoised already are kept; the keys of
    the pages before `first` must be there): hash((the previous page's key, or the sequence's
    prefix_root, the page's tokens))."""
    keys = seq.page_keys
    assert len(keys) >= first, (len(keys), first)
    for i in range(len(keys), first + len(pages)):
        keys.append(hash((keys[i - 1] if i else seq.prefix_root, pages[i - first])))


def _pages_of(seq: Sequence, first: int, end: int, page_size: int) -> list[tuple[int, ...]]:
    """The token tuples of seq's logical pages first .. end - 1 (full pages), with one slice of
    its token lists."""
    lo, hi, num_prompt = first * page_size, end * page_size, len(seq.prompt_token_ids)
    if hi <= num_prompt:
        tokens = seq.prompt_token_ids[lo:hi]
    elif lo >= num_prompt:
        tokens = seq.output_token_ids[lo - num_prompt:hi - num_prompt]
    else:
        tokens = seq.prompt_token_ids[lo:] + seq.output_token_ids[:hi - num_prompt]
    return [tuple(tokens[j:j + page_size]) for j in range(0, hi - lo, page_size)]

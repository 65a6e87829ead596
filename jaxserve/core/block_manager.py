"""KV page allocator with automatic prefix caching (vLLM V1 style).

Host side only (no jax). The pool has ``num_pages`` pages of ``block_size`` tokens; page 0 is
the trash page that padded tokens write to, so it is never handed out.

Prefix caching: once a page is full and its K/V computed, it is keyed by a hash chain
``hash(parent_hash, page token ids, extra keys)``. A later request whose prompt starts with the
same tokens reuses those pages copy-free (ref count > 1). Freed pages keep their hash and stay
in the free queue; a cached page is only evicted (hash dropped) when the allocator hands it
out again, least recently freed first. Pages without a hash go to the front of the free queue
so cached ones are the last to be reused.

Sliding window: when every attention layer of the model has a window (``sliding_window``, the
largest of them), no query at or after a request's ``num_computed_tokens`` reads the pages that
end before ``num_computed_tokens - window + 1``. Those pages are released as soon as the request
is next allocated (or swapped out), and their ``block_ids`` entries become ``NULL_PAGE`` (the
trash page), so ``block_ids`` stays indexed by position and the block table points dead columns
at the page that unused columns already point at. A released page keeps its prefix-cache hash
like any freed page: its content stays valid until the allocator hands it out again.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import xxhash

from jaxserve.core.kv_events import (MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored,
                                     block_hash_bytes)
from jaxserve.core.request import Request
from jaxserve.core.step_plan import TRASH_PAGE

NULL_PAGE = TRASH_PAGE  # the block-table entry of a page released out of the window


def hash_page_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_keys=None) -> int:
    """128-bit xxh3 over (parent hash, int32 token bytes, extra keys): one link of the chain."""
    h = xxhash.xxh3_128()
    h.update((0 if parent_hash is None else parent_hash).to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return h.intdigest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, record_events: bool = False,
                 group: int = 0):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the trash page), got {num_pages}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.num_pages = num_pages
        self.block_size = block_size
        # the block-table row this pool fills: a request's pages here are
        # ``request.group_block_ids[group]`` (``request.block_ids`` for row 0)
        self.group = group
        # every layer's window (the largest); None: some layer attends to the whole context
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        # Free queue, head = next to hand out. OrderedDict gives O(1) removal of a cached page
        # that gets a prefix hit while free.
        self._free: OrderedDict[int, None] = OrderedDict(
            (p, None) for p in range(num_pages) if p != TRASH_PAGE
        )
        self._cached: dict[int, int] = {}  # hash -> page
        self._num_cached_blocks: dict[str, int] = {}  # request_id -> pages registered so far
        self._num_released: dict[str, int] = {}  # request_id -> leading pages checked for release
        self.prefix_cache_queries = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.prefix_cache_hits = 0  # tokens found
        self.prefix_cache_requests = 0
        # KV-cache events since the last take_events() (None: not recorded)
        self._events: list | None = [] if record_events else None
        self.state_slots = None  # a pool holds pages only (state slots: the coordinator)
        # the host-memory tier (core.kv_offload.KVOffload) told of every page cached here
        self.offload = None

    # -- pool state -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out (includes cached pages nobody uses)."""
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests (vLLM's kv_cache_usage)."""
        return self.num_used_pages / self.num_usable_pages

    @property
    def hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def take_events(self) -> list:
        """The KV-cache events recorded since the last call (oldest first)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    @property
    def cached_page_counts(self) -> dict[str, int]:
        """request id -> its leading pages registered in the prefix cache so far (read-only:
        ``cache_full_blocks`` has nothing to do while a request's known computed tokens fill
        no more pages than this)."""
        return self._num_cached_blocks

    def cached_block_hashes(self) -> set[int]:
        """Every hash in the prefix cache now (what a subscriber of the events rebuilds)."""
        return set(self._cached)

    def free_page_ids(self) -> list[int]:
        """The free queue, head (next evicted) first. For tests and debugging."""
        return list(self._free)

    # -- prefix cache -----------------------------------------------------------------------
    def _extra_keys(self, request: Request, page_index: int):
        """The first page's salt and adapter (the chain carries them to every later page):
        a prefix computed under one adapter is never served to another, nor to the base.
        A page holding image placeholders adds those images' hashes."""
        mm = request.mm
        if mm is not None:
            bs = self.block_size
            images = mm.page_keys(page_index * bs, (page_index + 1) * bs)
            if images:
                return (self._first_keys(request, page_index), "images", images)
        return self._first_keys(request, page_index)

    @staticmethod
    def _first_keys(request: Request, page_index: int):
        if page_index != 0:
            return None
        lora = request.lora_int_id
        if lora:
            return (request.cache_salt, "lora", lora)
        return request.cache_salt

    def _ensure_hashes(self, request: Request, num_pages: int) -> list[int]:
        """Extend ``request.block_hashes`` to its first ``num_pages`` full pages (tokens never change)."""
        hashes = request.block_hashes
        bs = self.block_size
        toks = request.all_token_ids
        while len(hashes) < num_pages:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_page_tokens(parent, toks[i * bs:(i + 1) * bs], self._extra_keys(request, i)))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request as (pages, tokens). Pure lookup; stats are recorded
        by ``allocate_slots`` when the hit is used. At least one token is always left to compute
        (the step needs it to produce logits)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_pages = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(request, max_pages)
        pages = []
        for h in hashes[:max_pages]:
            p = self._cached.get(h)
            if p is None:
                break
            pages.append(p)
        return pages, len(pages) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's pages that became full of computed tokens since the last call
        (only tokens the host knows: a page holding a pending id waits for it)."""
        if not self.enable_prefix_caching:
            return
        known = min(request.num_computed_tokens,
                    len(request.all_token_ids) - request.num_pending)
        start = self._num_cached_blocks.get(request.request_id, 0)
        if known // self.block_size <= start:  # no page filled since the last call: most steps
            return
        pages = self.pages(request)
        n_full = min(known // self.block_size, len(pages))
        if n_full <= start:
            return
        hashes = self._ensure_hashes(request, n_full)
        for i in range(start, n_full):
            page = pages[i]
            if page == NULL_PAGE:  # released before its tokens were known: not registered
                continue
            h = hashes[i]
            if self.page_hash[page] is None and h not in self._cached:
                self.page_hash[page] = h
                self._cached[h] = page
                if self._events is not None:
                    bs = self.block_size
                    self._events.append(BlockStored(
                        [block_hash_bytes(h)], block_hash_bytes(hashes[i - 1]) if i else None,
                        [int(t) for t in request.all_token_ids[i * bs:(i + 1) * bs]], bs, None,
                        MEDIUM))
                if self.offload is not None:
                    self.offload.on_cached(self.group, request, i, h, page)
            # else: already a cached page (a prefix hit), or an identical page computed by a
            # concurrent request is cached already; this copy stays unregistered.
        self._num_cached_blocks[request.request_id] = n_full

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Only possible while no page is in use (like vLLM)."""
        if self.num_used_pages:
            return False
        self._cached.clear()
        self.page_hash = [None] * self.num_pages
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    # -- a request's pages in this pool ---------------------------------------------------------
    def pages(self, request: Request) -> list[int]:
        """The request's page list of this pool (its block-table row), position order."""
        if self.group == 0:
            return request.block_ids
        return request.group_block_ids[self.group]

    def _set_pages(self, request: Request, pages: list[int]) -> None:
        if self.group == 0:
            request.block_ids = pages
        if request.group_block_ids is not None:
            request.group_block_ids[self.group] = pages

    def swap_pages(self, request: Request) -> list[list[int]]:
        """Per pool (one here), the pages of the request's computed tokens that a later step
        reads: what swap preemption copies to host memory and back."""
        pages = self.pages(request)
        end = min(cdiv(request.num_computed_tokens, self.block_size), len(pages))
        dead = min(self.num_dead_pages(request.num_computed_tokens), end)
        return [list(pages[dead:end])]

    # -- sliding window -----------------------------------------------------------------------
    def num_dead_pages(self, first_pos: int) -> int:
        """Leading pages no query at position >= ``first_pos`` reads (0 without a window): a
        query at ``q`` reads positions ``> q - window``."""
        if self.sliding_window is None:
            return 0
        return max(0, first_pos - self.sliding_window + 1) // self.block_size

    def release_out_of_window(self, request: Request) -> int:
        """Release the request's pages that fell out of every layer's window (their entries become
        ``NULL_PAGE``). Returns how many leading entries are dead now."""
        pages = self.pages(request)
        dead = min(self.num_dead_pages(request.num_computed_tokens), len(pages))
        start = self._num_released.get(request.request_id, 0)
        if dead <= start:
            return start
        for i in range(dead - 1, start - 1, -1):  # tail first, like free()
            p = pages[i]
            if p != NULL_PAGE:
                self._unref(p)
                pages[i] = NULL_PAGE
                request.pages_dirty = True
        self._num_released[request.request_id] = dead
        return dead

    # -- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] | None = None,
    ) -> bool:
        """Make ``request.block_ids`` cover ``num_computed_tokens + hits + num_new_tokens`` tokens.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (only on a
        request that owns no pages yet); passing it (even ``[]``) marks a first admission and
        counts the lookup in the hit-rate stats. With a sliding window, pages before the window
        of the step's first query are released first (always: no later step needs them) and
        never allocated (hits there are not taken). Returns False and changes nothing else if
        the free queue is too short.
        """
        if (new_computed_blocks is None and self.sliding_window is None
                and request.num_computed_tokens + num_new_tokens
                <= len(self.pages(request)) * self.block_size):
            return True  # a decode inside its last page (most rows of most steps): nothing to do
        computed = list(new_computed_blocks) if new_computed_blocks else []
        return self._allocate_pages(request, num_new_tokens, new_computed_blocks, computed)

    def _allocate_pages(self, request: Request, num_new_tokens: int,
                        new_computed_blocks: Sequence[int] | None, computed: list[int]) -> bool:
        bs = self.block_size
        dead, n_alloc, n_null, live_hits, n_touch_free = self._needs(request, num_new_tokens,
                                                                     computed)
        if n_alloc <= 0 and not computed:  # fast path: a decode inside its last page
            if new_computed_blocks is not None:
                self._record_query(request, 0)
            return True
        if n_alloc + n_touch_free > len(self._free):
            return False
        for p in live_hits:
            if self.ref_counts[p] == 0:
                del self._free[p]
            self.ref_counts[p] += 1
        if computed:
            self._num_cached_blocks[request.request_id] = len(computed)
        pages = self.pages(request)
        pages.extend([NULL_PAGE] * (len(computed) - len(live_hits) + n_null))
        pages.extend(live_hits)
        if dead:
            rid = request.request_id
            self._num_released[rid] = max(self._num_released.get(rid, 0), min(dead, len(pages)))
        for _ in range(n_alloc):
            p, _ = self._free.popitem(last=False)
            h = self.page_hash[p]
            if h is not None:  # evict: its content is about to be overwritten
                self.page_hash[p] = None
                if self._cached.get(h) == p:
                    del self._cached[h]
                    if self._events is not None:
                        self._events.append(BlockRemoved([block_hash_bytes(h)], MEDIUM))
            self.ref_counts[p] = 1
            pages.append(p)
        if new_computed_blocks is not None:
            self._record_query(request, len(computed) * bs)
        return True

    def _needs(self, request: Request, num_new_tokens: int, computed: list[int]):
        """What ``allocate_slots`` would do: (dead columns, pages to allocate, null columns to
        add, live hits, hit pages to take out of the free queue). Releases the pages already
        out of the window first (no later step needs them)."""
        held = len(self.pages(request))
        if computed and held:
            raise ValueError("prefix-cache hits can only be added to a request without pages")
        bs = self.block_size
        dead = self.num_dead_pages(request.num_computed_tokens + len(computed) * bs)
        if dead and not computed:
            self.release_out_of_window(request)
        total = request.num_computed_tokens + len(computed) * bs + num_new_tokens
        n_alloc = -(-total // bs) - held - len(computed)
        # columns before the window (dead) get NULL_PAGE: no page, and hits there are not taken
        n_null = max(0, dead - held - len(computed))
        live_hits = computed[dead:]
        # Hit pages nobody holds are in the free queue; touching them takes them out of it.
        n_touch_free = sum(1 for p in live_hits if self.ref_counts[p] == 0)
        return dead, n_alloc if n_alloc <= 0 else max(0, n_alloc - n_null), n_null, \
            live_hits, n_touch_free

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Sequence[int] | None = None) -> bool:
        """Whether ``allocate_slots`` would succeed now (releases out-of-window pages only)."""
        computed = list(new_computed_blocks) if new_computed_blocks else []
        _, n_alloc, _, _, n_touch_free = self._needs(request, num_new_tokens, computed)
        return max(0, n_alloc) + n_touch_free <= len(self._free)

    def _record_query(self, request: Request, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_requests += 1
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _unref(self, p: int) -> None:
        rc = self.ref_counts[p] - 1
        if rc < 0:
            raise RuntimeError(f"page {p} freed more often than allocated")
        self.ref_counts[p] = rc
        if rc == 0:
            self._free[p] = None
            if self.page_hash[p] is None:  # worthless: reuse it before any cached page
                self._free.move_to_end(p, last=False)

    def free(self, request: Request) -> None:
        """Release a request's pages, tail first, so the tail of a cached prefix is evicted first."""
        for p in reversed(self.pages(request)):
            if p != NULL_PAGE:
                self._unref(p)
        self._set_pages(request, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)

    def check_invariants(self, requests: Sequence[Request] = ()) -> None:
        """Assert the pool's bookkeeping is consistent with the given live requests (tests)."""
        owners = [0] * self.num_pages
        for r in requests:
            pages = self.pages(r)
            n_null = next((i for i, p in enumerate(pages) if p != NULL_PAGE), len(pages))
            assert NULL_PAGE not in pages[n_null:], \
                f"{r.request_id}: a null page after a live one"
            assert n_null <= self.num_dead_pages(r.num_computed_tokens), \
                f"{r.request_id}: a page released inside the window"
            for p in pages[n_null:]:
                owners[p] += 1
        assert self.ref_counts[TRASH_PAGE] == 0, "trash page handed out"
        assert TRASH_PAGE not in self._free
        for p in range(1, self.num_pages):
            assert self.ref_counts[p] == owners[p], f"page {p}: ref {self.ref_counts[p]} != owners {owners[p]}"
            assert (p in self._free) == (owners[p] == 0), f"page {p} free-queue state wrong"
            if owners[p] > 1:
                assert self.page_hash[p] is not None, f"page {p} shared but not a cached page"
        for h, p in self._cached.items():
            assert self.page_hash[p] == h
        assert sum(h is not None for h in self.page_hash) == len(self._cached)

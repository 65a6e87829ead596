"""One manager per cache kind, combined (vLLM's ``KVCacheCoordinator``): the scheduler's one
KV cache manager, built from the pools of a ``core.kv_cache_config.KVCacheConfig``.

- a page pool per block-table row: a ``BlockManager`` (free list, ref counts, prefix cache;
  full attention keeps every page, a sliding window frees the pages out of its window). A
  request's pages of row ``g`` are ``request.group_block_ids[g]`` (``request.block_ids`` is
  row 0's); each manager reads its own row, nothing is swapped in and out.
- shared-KV readers own nothing: they read their producer's row, so they have no manager.
- the MTP head's layer uses the page ids of the pool its spec belongs to (no manager of its
  own: its pages are allocated with that pool's).
- recurrent state (``LinearState`` layers): :class:`StateSlots`, one slot per running request,
  taken with its first pages and freed with them.

Allocation is every manager or none. A prefix-cache hit is the longest prefix every pool can
serve (a full pool needs every page of it, a sliding pool only the pages inside the window of
the first token to compute); with state slots there is no prefix caching (a cached attention
prefix does not restore the state). With one pool and no state slots the pool's
``BlockManager`` is the manager itself (:func:`make_kv_cache_manager`). Host side only.
"""
from __future__ import annotations

from typing import Sequence

from jaxserve.core.block_manager import NULL_PAGE, BlockManager
from jaxserve.core.request import Request
from jaxserve.core.state_slots import StateSlots


def make_kv_cache_manager(pools: Sequence[tuple[str, int, int | None]], *, block_size: int,
                          num_state_slots: int | None, enable_prefix_caching: bool,
                          record_events: bool = False, free_out_of_window: bool = True):
    """The scheduler's KV cache manager: ``pools`` (name, pages, window) in block-table row
    order (``KVCacheConfig.manager_pools``), ``num_state_slots`` None without LinearState
    layers. ``free_out_of_window`` False: no pool frees a page early (a draft model, which
    lags behind and may attend globally, reads the same page ids)."""
    if num_state_slots is not None:
        enable_prefix_caching = False
    managers = [BlockManager(pages, block_size, enable_prefix_caching=enable_prefix_caching,
                             sliding_window=window if free_out_of_window else None,
                             record_events=record_events, group=g)
                for g, (_, pages, window) in enumerate(pools)]
    if len(managers) == 1 and num_state_slots is None:
        return managers[0]
    state = None if num_state_slots is None else StateSlots(num_state_slots)
    return KVCacheCoordinator(managers, state, names=[name for name, _, _ in pools])


class KVCacheCoordinator:
    def __init__(self, managers: Sequence[BlockManager], state_slots: StateSlots | None = None,
                 names: Sequence[str] | None = None):
        if len({m.block_size for m in managers}) != 1:
            raise ValueError("every cache group needs the same block_size")
        if [m.group for m in managers] != list(range(len(managers))):
            raise ValueError("manager g must fill block-table row g")
        self.managers = list(managers)
        self.names = list(names) if names is not None else [str(g) for g in range(len(managers))]
        self.block_size = managers[0].block_size
        self.enable_prefix_caching = managers[0].enable_prefix_caching
        if state_slots is not None and self.enable_prefix_caching:
            raise ValueError("prefix caching serves no recurrent state: turn it off for models "
                             "with LinearState layers")
        # the scheduler's fast path for a decode inside its last page holds when no pool frees
        # out of a window
        windows = [m.sliding_window for m in managers if m.sliding_window is not None]
        self.sliding_window = max(windows) if windows else None
        self.state_slots = state_slots

    def manager(self, name: str) -> BlockManager:
        return self.managers[self.names.index(name)]

    def _rows(self, request: Request) -> None:
        """Give the request its page list per row (row 0 is ``request.block_ids``)."""
        if len(self.managers) > 1 and request.group_block_ids is None:
            request.group_block_ids = [request.block_ids] + [[] for _ in self.managers[1:]]

    # -- pool state ---------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.managers[0].num_pages

    @property
    def num_free_pages(self) -> int:
        return min(m.num_free_pages for m in self.managers)

    @property
    def num_usable_pages(self) -> int:
        """Pages of the tightest full-attention pool (a prompt must fit there whole)."""
        full = [m for m in self.managers if m.sliding_window is None] or self.managers
        return min(m.num_usable_pages for m in full)

    @property
    def num_used_pages(self) -> int:
        return max(m.num_used_pages for m in self.managers)

    @property
    def num_cached_pages(self) -> int:
        return self.managers[0].num_cached_pages

    @property
    def usage(self) -> float:
        """The fullest pool's usage (or the state pool's)."""
        u = max(m.usage for m in self.managers)
        if self.state_slots is not None:
            u = max(u, self.state_slots.num_used / self.state_slots.num_slots)
        return u

    @property
    def prefix_cache_queries(self) -> int:
        return self.managers[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.managers[0].prefix_cache_hits

    @property
    def prefix_cache_requests(self) -> int:
        return self.managers[0].prefix_cache_requests

    @property
    def hit_rate(self) -> float:
        return self.managers[0].hit_rate

    def group_used_pages(self) -> list[int]:
        return [m.num_used_pages for m in self.managers]

    def take_events(self) -> list:
        return [e for m in self.managers for e in m.take_events()]

    def cached_block_hashes(self) -> set[int]:
        return set().union(*(m.cached_block_hashes() for m in self.managers))

    # -- prefix cache -------------------------------------------------------------------------
    @property
    def cached_page_counts(self) -> "_LeastCached":
        """request id -> the leading pages every pool has registered in the prefix cache (the
        fewest of any pool: ``cache_full_blocks`` has work while one pool is behind)."""
        return _LeastCached(self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Per pool, the pages of the longest prefix every pool serves (entries before a
        sliding pool's window are ``NULL_PAGE``), and its length in tokens."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.managers], 0
        bs = self.block_size
        full = max(((request.num_tokens - 1) // bs), 0)
        hashes = self.managers[0]._ensure_hashes(request, full)
        n = full  # the longest prefix every pool holds (from the start, or its window)
        while n > 0 and not all(self._serves(m, hashes, n) for m in self.managers):
            n -= 1
        out = []
        for m in self.managers:
            dead = m.num_dead_pages(n * bs)
            out.append([NULL_PAGE] * dead + [m._cached[h] for h in hashes[dead:n]])
        return out, n * bs

    @staticmethod
    def _serves(m: BlockManager, hashes: list[int], n: int) -> bool:
        dead = m.num_dead_pages(n * m.block_size)
        return all(h in m._cached for h in hashes[dead:n])

    def cache_full_blocks(self, request: Request) -> None:
        self._rows(request)
        for m in self.managers:
            m.cache_full_blocks(request)

    def reset_prefix_cache(self) -> bool:
        if self.num_used_pages:
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

    # -- windows, allocation, swap ------------------------------------------------------------
    def num_dead_pages(self, first_pos: int) -> int:
        return min(m.num_dead_pages(first_pos) for m in self.managers)

    def release_out_of_window(self, request: Request) -> int:
        self._rows(request)
        return min([m.release_out_of_window(request) for m in self.managers])

    def swap_pages(self, request: Request) -> list[list[int]]:
        """Per pool, the pages of the computed tokens a later step reads (swap preemption)."""
        self._rows(request)
        return [m.swap_pages(request)[0] for m in self.managers]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] | None = None) -> bool:
        """Every pool's pages for the step and, on admission, a state slot; or (False) none:
        each is checked first."""
        self._rows(request)
        hits = [None] * len(self.managers)
        if new_computed_blocks is not None:  # a first admission: [] or one list per pool
            hits = list(new_computed_blocks) or [[] for _ in self.managers]
        needs_slot = self.state_slots is not None and request.state_slot < 0
        if needs_slot and not self.state_slots.num_free:
            return False
        if len(self.managers) == 1:  # a refused allocate_slots changes nothing
            if not self.managers[0].allocate_slots(request, num_new_tokens, hits[0]):
                return False
        else:
            if not all(m.can_allocate(request, num_new_tokens, h)
                       for m, h in zip(self.managers, hits)):
                return False
            for m, h in zip(self.managers, hits):
                ok = m.allocate_slots(request, num_new_tokens, h)
                assert ok, "a pool that fitted failed to allocate"
        if needs_slot:
            request.state_slot = self.state_slots.allocate(request.request_id)
        return True

    def free(self, request: Request) -> None:
        self._rows(request)
        for m in self.managers:
            m.free(request)
        if request.state_slot >= 0 and self.state_slots is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = -1
        request.group_block_ids = None
        request.block_ids = []

    def check_invariants(self, requests: Sequence[Request] = ()) -> None:
        for r in requests:
            self._rows(r)
        for m in self.managers:
            m.check_invariants(requests)
        if self.state_slots is not None:
            held = {r.state_slot: r.request_id for r in requests if r.state_slot >= 0}
            held.update({r.kv_state_snapshot: r.request_id + "#kv" for r in requests
                         if r.kv_state_snapshot >= 0})  # a P/D prefill's held state
            assert held == self.state_slots.owners(), \
                f"state slots {self.state_slots.owners()} != held by requests {held}"


class _LeastCached:
    """A read-only view: ``get(request_id, default)`` is the fewest cached pages of any
    pool's manager."""

    __slots__ = ("_counts",)

    def __init__(self, managers: Sequence[BlockManager]):
        self._counts = [m.cached_page_counts for m in managers]

    def get(self, request_id: str, default: int = 0) -> int:
        return min(c.get(request_id, default) for c in self._counts)

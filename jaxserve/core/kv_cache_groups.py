"""Page pools per KV cache group: one ``BlockManager`` (free list, ref counts, prefix cache,
window) per paged group, behind the ``BlockManager`` interface the scheduler uses.

A request holds one page list per group (``request.group_block_ids``; ``request.block_ids`` is
group 0's). Allocation is all groups or none. A sliding group frees the pages that fall out of
its own window while full-attention groups keep theirs. Prefix caching keys pages per group by
the same hash chain; a hit is the longest prefix every group can serve: a full group needs every
page of it, a sliding group only the pages inside the window of the first token to compute.
Host side only (no jax).
"""
from __future__ import annotations

from typing import Sequence

from jaxserve.core.block_manager import NULL_PAGE, BlockManager
from jaxserve.core.request import Request


class GroupedBlockManager:
    def __init__(self, managers: Sequence[BlockManager]):
        if len({m.block_size for m in managers}) != 1:
            raise ValueError("every cache group needs the same block_size")
        self.managers = list(managers)
        self.block_size = managers[0].block_size
        self.enable_prefix_caching = managers[0].enable_prefix_caching
        self.sliding_window = None  # per group: each manager has its own
        self.state_slots = None  # grouped pools hold pages only (no LinearState layers)

    # -- one group at a time ------------------------------------------------------------------
    def _on(self, g: int, request: Request, fn):
        """Run ``fn(manager)`` with ``request.block_ids`` standing for group ``g``'s pages."""
        lists = request.group_block_ids
        if lists is None or len(lists) != len(self.managers):
            lists = request.group_block_ids = [list(request.block_ids)] + [
                [] for _ in self.managers[1:]]
        request.block_ids = lists[g]
        try:
            return fn(self.managers[g])
        finally:
            lists[g] = request.block_ids
            request.block_ids = lists[0]

    # -- pool state ---------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.managers[0].num_pages

    @property
    def num_free_pages(self) -> int:
        return min(m.num_free_pages for m in self.managers)

    @property
    def num_usable_pages(self) -> int:
        """Pages of the tightest full-attention group (a prompt must fit there whole)."""
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
        return max(m.usage for m in self.managers)

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
        """request id -> the leading pages every group has registered in the prefix cache (the
        fewest of any group: ``cache_full_blocks`` has work while one group is behind)."""
        return _LeastCached(self.managers)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Per group, the pages of the longest prefix every group serves (entries before a
        sliding group's window are ``NULL_PAGE``), and its length in tokens."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.managers], 0
        bs = self.block_size
        full = max(((request.num_tokens - 1) // bs), 0)
        hashes = self.managers[0]._ensure_hashes(request, full)
        n = full  # the longest prefix every group holds (from the start, or its window)
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
        for g in range(len(self.managers)):
            self._on(g, request, lambda m: m.cache_full_blocks(request))

    def reset_prefix_cache(self) -> bool:
        if self.num_used_pages:
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

    # -- windows and allocation -------------------------------------------------------------
    def num_dead_pages(self, first_pos: int) -> int:
        return min(m.num_dead_pages(first_pos) for m in self.managers)

    def release_out_of_window(self, request: Request) -> int:
        dead = [self._on(g, request, lambda m: m.release_out_of_window(request))
                for g in range(len(self.managers))]
        return min(dead)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[Sequence[int]] | None = None) -> bool:
        """Every group's pages for the step, or (False) none: each group is checked first."""
        hits = [None] * len(self.managers)
        if new_computed_blocks is not None:  # a first admission: [] or one list per group
            hits = list(new_computed_blocks) or [[] for _ in self.managers]
        fits = [self._on(g, request, lambda m: m.can_allocate(request, num_new_tokens, hits[g]))
                for g in range(len(self.managers))]
        if not all(fits):
            return False
        for g in range(len(self.managers)):
            ok = self._on(g, request, lambda m: m.allocate_slots(request, num_new_tokens,
                                                                 hits[g]))
            assert ok, "a group that fitted failed to allocate"
        return True

    def free(self, request: Request) -> None:
        for g in range(len(self.managers)):
            self._on(g, request, lambda m: m.free(request))
        request.group_block_ids = None
        request.block_ids = []

    def check_invariants(self, requests: Sequence[Request] = ()) -> None:
        for g, m in enumerate(self.managers):
            views = []
            for r in requests:
                v = Request.__new__(Request)
                v.__dict__.update(r.__dict__)
                v.block_ids = (r.group_block_ids or [r.block_ids] * len(self.managers))[g]
                views.append(v)
            m.check_invariants(views)


class _LeastCached:
    """A read-only view: ``get(request_id, default)`` is the fewest cached pages of any
    group's manager."""

    __slots__ = ("_counts",)

    def __init__(self, managers: Sequence[BlockManager]):
        self._counts = [m.cached_page_counts for m in managers]

    def get(self, request_id: str, default: int = 0) -> int:
        return min(c.get(request_id, default) for c in self._counts)

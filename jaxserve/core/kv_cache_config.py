"""The KV cache's layout and sizes, computed once from the model's cache specs and one byte
budget (vLLM's ``KVCacheConfig``). Host side only: pure arithmetic, no jax (the worker measures
the budget, ``jaxserve.worker.kv_cache_config``, and allocates from this).

A :class:`KVCacheConfig` names every pool by its groups (``"full"``, ``"sliding_512"``, or
``"sliding_512+full"`` for one pool that every paged layer indexes), says which pool each layer
reads (``pool_of_layer``), how many pages each pool has, how many recurrent-state slots the
``LinearState`` layers share (plus scratch slots for speculative snapshots), and which layer is
the multi-token-prediction head and which pool's page ids it uses. The block-table row of a pool
is its index in ``pools``; nothing else reads a position.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from jaxserve.core.kv_cache_spec import (CacheGroup, CacheSpec, LinearState, PagePool,
                                         SharedKV, SlidingWindow, group_layers, group_pools,
                                         page_pools, split_budget, state_bytes_per_slot)


@dataclass(frozen=True)
class PoolConfig:
    """One page pool: its name, the groups whose layers index it, and its page count."""

    name: str
    pool: PagePool
    num_pages: int

    @property
    def window(self) -> int | None:
        return self.pool.window

    @property
    def layers(self) -> tuple[int, ...]:
        return self.pool.layers

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        return self.pool.page_bytes(block_size, tp)


@dataclass(frozen=True)
class KVCacheConfig:
    block_size: int
    specs: tuple[CacheSpec, ...]
    groups: tuple[CacheGroup, ...]
    pools: tuple[PoolConfig, ...]  # in block-table row order
    pool_of_layer: tuple[str | None, ...]  # None: a LinearState layer (a state slot)
    num_state_slots: int | None  # None: no LinearState layers
    scratch_slots: int = 0  # state slots after the requests' (speculative snapshots)
    mtp_layer: int | None = None  # the MTP head's cache layer (the last spec), None: no head

    # -- names -----------------------------------------------------------------------------
    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"no KV pool named {name!r} (pools: {[p.name for p in self.pools]})")

    def row(self, name: str) -> int:
        """The block-table row of pool ``name``."""
        return [p.name for p in self.pools].index(name)

    @property
    def mtp_pool(self) -> str | None:
        """The pool whose page ids the MTP head's layer uses."""
        return None if self.mtp_layer is None else self.pool_of_layer[self.mtp_layer]

    def manager_pools(self) -> list[tuple[str, int, int | None]]:
        """(name, pages, window) of each pool, in row order: what the host managers need."""
        return [(p.name, p.num_pages, p.window) for p in self.pools]

    @property
    def pool_pages(self) -> tuple[int, ...]:
        return tuple(p.num_pages for p in self.pools)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.specs) if isinstance(s, LinearState))

    @property
    def paged_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.specs)
                     if not isinstance(s, (LinearState, SharedKV)))

    @property
    def per_group_pools(self) -> bool:
        """Whether each paged group has its own pool (block tables ``[G, S, M]`` with G > 1)."""
        return len(self.pools) > 1

    def layer_range(self, lo: int, hi: int) -> "KVCacheConfig":
        """The cache of layers ``[lo, hi)`` alone (a pipeline stage's, numbered within it): the
        same pools (names, block-table rows, pages: every stage indexes the same page ids),
        each holding only the range's layers, and the same state slots."""
        specs = tuple(SharedKV(s.producer_layer - lo) if isinstance(s, SharedKV) else s
                      for s in self.specs[lo:hi])
        pools = tuple(dataclasses.replace(p, pool=_pool_range(p.pool, lo, hi))
                      for p in self.pools)
        mtp = self.mtp_layer
        return KVCacheConfig(self.block_size, specs, group_layers(specs), pools,
                             self.pool_of_layer[lo:hi], self.num_state_slots,
                             self.scratch_slots,
                             None if mtp is None or not lo <= mtp < hi else mtp - lo)

    # -- capacity figures ------------------------------------------------------------------
    def page_bytes(self, tp: int = 1) -> int:
        """One page id of every pool, all devices together."""
        return sum(p.page_bytes(self.block_size, tp) for p in self.pools)

    def state_slot_bytes(self) -> int:
        return state_bytes_per_slot(self.groups)

    def kv_bytes_per_token(self, max_model_len: int) -> float:
        """KV bytes a ``max_model_len`` request holds per context token (a pool that frees
        out of its window: its window's pages)."""
        bs = self.block_size
        return sum(p.pool.max_pages(max_model_len, bs) * p.page_bytes(bs)
                   for p in self.pools) / max_model_len

    def max_concurrency(self, max_model_len: int) -> float:
        """How many ``max_model_len`` requests the pools (and state slots) hold at once."""
        n = min((p.num_pages - 1) / p.pool.max_pages(max_model_len, self.block_size)
                for p in self.pools)
        return n if self.num_state_slots is None else min(n, self.num_state_slots)


def _pool_range(pool: PagePool, lo: int, hi: int) -> PagePool:
    """``pool`` with only layers ``[lo, hi)``, numbered from ``lo`` (groups with none left
    go: the pool may hold no layer of the range)."""
    def within(layers):
        return tuple(i - lo for i in layers if lo <= i < hi)

    groups = tuple(CacheGroup(g.spec, within(g.layers), within(g.readers)) for g in pool.groups)
    return dataclasses.replace(pool, groups=tuple(g for g in groups if g.layers or g.readers))


def pool_name(pool: PagePool) -> str:
    return "+".join(_group_name(g) for g in pool.groups)


def _group_name(group: CacheGroup) -> str:
    s = group.spec
    base = f"sliding_{s.window}" if isinstance(s, SlidingWindow) else "full"
    return base


def _named(pools: Sequence[PagePool]) -> list[str]:
    """Unique names: a spec kind repeated at another page shape gets ``_<kv heads>x<head dim>``."""
    names = [pool_name(p) for p in pools]
    for i, p in enumerate(pools):
        if names.count(pool_name(p)) > 1:
            names[i] = f"{pool_name(p)}_{p.kv_heads}x{p.head_dim}"
    return names


@dataclass(frozen=True)
class Budget:
    """What the sizer divides. ``bytes``: one device's bytes for pages and state slots;
    ``host``: the budget is a host-memory cap (CPU), so pools are sized for ``max_num_seqs``
    full-length requests and capped by it (each still holds two); ``num_pages_override``:
    every pool gets that many pages (``--num-gpu-blocks-override``)."""

    bytes: int
    host: bool = False
    num_pages_override: int | None = None


def size_kv_cache(specs: Sequence[CacheSpec], budget: Budget, *, block_size: int,
                  max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                  per_group_pools: bool, tp: int = 1, extra_page_bytes: int = 0,
                  scratch_slots: int = 0, mtp_layer: int | None = None,
                  stages: Sequence[tuple[int, int]] = ()) -> KVCacheConfig:
    """The one sizer: pools (one per paged group when ``per_group_pools``, else one that every
    paged layer indexes), their pages, and the state slots, from one budget.

    Every pool runs out at the same number of full-length requests (pages in proportion to
    what such a request holds in each); a pool that frees out of its window also gets the pages
    one step's prefill chunks span past the windows (``max_num_batched_tokens / block_size +
    max_num_seqs``). With ``LinearState`` layers each request is also a slot (at most
    ``max_num_seqs``), and ``scratch_slots`` are taken off the budget first.
    ``extra_page_bytes``: what a page of the (single) pool costs elsewhere (a draft model's
    pool on the same page ids). ``stages``: the layer ranges of pipeline stages, each on its
    own devices with ``budget`` of its own: pages and slots are what every stage holds (the
    draft model's pool sits on the last stage)."""
    specs = tuple(specs)
    groups = group_layers(specs)
    if not any(g.paged for g in groups):
        raise NotImplementedError("a model without any attention layer has no page pool")
    pools = group_pools(groups) if per_group_pools else page_pools(groups)
    if extra_page_bytes and len(pools) > 1:
        raise ValueError("a draft model's pages share the page ids of one pool")
    has_state = any(isinstance(s, LinearState) for s in specs)
    fit = dict(budget=budget, block_size=block_size, max_model_len=max_model_len,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               per_group_pools=per_group_pools, tp=tp, scratch_slots=scratch_slots)
    if not stages:
        pages, slots = pages_and_slots(
            pools, state_bytes_per_slot(groups) // tp if has_state else None,
            extra_page_bytes=extra_page_bytes, **fit)
    else:
        pages, slots = _stages_fit(specs, pools, stages, extra_page_bytes, fit)
    names = _named(pools)
    configs = tuple(PoolConfig(n, p, k) for n, p, k in zip(names, pools, pages))
    of_layer: list[str | None] = [None] * len(specs)
    for c in configs:
        for g in c.pool.groups:
            for i in g.layers + g.readers:
                of_layer[i] = c.name
    return KVCacheConfig(block_size, specs, groups, configs, tuple(of_layer),
                         slots if has_state else None, scratch_slots if has_state else 0,
                         mtp_layer)


def _stages_fit(specs, pools, stages, extra_page_bytes: int, fit: dict
                ) -> tuple[tuple[int, ...], int]:
    """(pages per pool, state slots) that every stage holds: each stage sized on its own
    budget for its own layers' share of each pool (the fewest of each, across stages)."""
    tp, pages, slots = fit["tp"], [None] * len(pools), fit["max_num_seqs"]
    for lo, hi in stages:
        part = [_pool_range(p, lo, hi) for p in pools]
        have = [k for k, p in enumerate(part) if p.page_bytes(fit["block_size"], tp)]
        state = state_bytes_per_slot(group_layers(
            [s for s in specs[lo:hi] if isinstance(s, LinearState)])) // tp
        if not have:  # only LinearState layers: slots alone
            b = fit["budget"]
            n = (fit["max_num_seqs"] if b.host or b.num_pages_override is not None
                 else (b.bytes - fit["scratch_slots"] * state) // max(state, 1))
            slots = min(slots, max(0, int(n)))
            continue
        got, n = pages_and_slots([part[k] for k in have], state or None,
                                 extra_page_bytes=extra_page_bytes if hi == stages[-1][1] else 0,
                                 **fit)
        for k, g in zip(have, got):
            pages[k] = g if pages[k] is None else min(pages[k], g)
        slots = min(slots, n)
    if slots < 1:
        raise ValueError("no room for the state pool")
    return tuple(pages), slots


def pages_and_slots(pools: Sequence[PagePool], slot_bytes: int | None, budget: Budget, *,
           block_size: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
           per_group_pools: bool, tp: int, extra_page_bytes: int, scratch_slots: int
           ) -> tuple[tuple[int, ...], int]:
    """(pages per pool, state slots) of :func:`size_kv_cache` for given pools; ``slot_bytes``:
    one device's bytes of a state slot, None without LinearState layers."""
    bs = block_size
    if budget.num_pages_override is not None:
        return (int(budget.num_pages_override),) * len(pools), max_num_seqs
    full = -(-max_model_len // bs)
    # pages a full-length request holds in each pool (one shared pool keeps every page)
    need = [p.max_pages(max_model_len, bs) if per_group_pools else full for p in pools]
    headroom = [(-(-max_num_batched_tokens // bs) + max_num_seqs)
                if per_group_pools and p.window is not None else 0 for p in pools]
    per_page = [p.page_bytes(bs, tp) // tp for p in pools]

    def split(nbytes: int, extra: int = 0) -> tuple[int, ...]:
        return split_budget(pools, max(nbytes, 0), block_size=bs, max_model_len=max_model_len,
                            tp=tp, extra_page_bytes=extra)

    if budget.host:  # every sequence at full length, capped by the host budget
        fit = split(budget.bytes, extra_page_bytes)
        pages = tuple(int(max(2, min(max_num_seqs * n + h + 1, max(f, 2 * n + 1) + h)))
                      for n, f, h in zip(need, fit, headroom))
        return pages, max_num_seqs
    nbytes = budget.bytes - sum(h * b for h, b in zip(headroom, per_page))
    if extra_page_bytes:  # the target's share of the pages that fit beside the draft's
        nbytes = nbytes // (per_page[0] + extra_page_bytes) * per_page[0]
    slots = max_num_seqs
    if slot_bytes is not None:
        nbytes -= scratch_slots * slot_bytes
        per_request = slot_bytes + sum(n * b for n, b in zip(need, per_page))
        slots = int(max(0, min(max_num_seqs, nbytes // per_request)))
        nbytes -= slots * slot_bytes
    pages = tuple(n + h for n, h in zip(split(nbytes), headroom))
    if nbytes <= 0 or min(pages) < 2 or slots < 1:
        raise ValueError("no room for the KV cache" + (" and the state pool" if slot_bytes
                                                       is not None else ""))
    return pages, slots

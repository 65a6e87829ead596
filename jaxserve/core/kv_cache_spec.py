"""What each layer caches (a small frozen spec), the groups layers form, and the page budget
each group gets. Host side only (numpy dtypes, no jax).

Every model layer declares one spec (``CausalLM.cache_specs``); layers with equal specs form a
**group**. A paged group has its own page pool, free list and block-table row per request
(``StepPlan.block_tables[G, S, M]``); a state group (``LinearState``) has one slot per running
request. All pools are sized from one byte budget, in proportion to what each needs per
request, so every group holds the same number of full-length requests.

Two layouts for the paged groups. ``page_pools``: one pool whose page ids index every owning
layer's array (each at its own spec's KV heads and head dim), freeing a request's early pages
only when every layer is windowed. ``group_pools``: a pool per paged group
(``core.kv_cache_coordinator``), each with its own free list and window, for models that read
per-group block tables. ``LinearState`` groups live in the **state pool** beside them (one slot
per running request; ``core.kv_cache_config`` sizes them all).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _itemsize(dtype: str) -> int:
    if dtype.startswith("float8"):
        return 1
    return _ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize


@dataclass(frozen=True)
class FullAttention:
    """K and V of every position: ``max_model_len / block_size`` pages per request."""

    kv_heads: int
    head_dim: int
    dtype: str

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        """K and V of one page of this layer (all devices together)."""
        return 2 * max(self.kv_heads, tp) * block_size * self.head_dim * _itemsize(self.dtype)

    def max_pages(self, max_model_len: int, block_size: int) -> int:
        return -(-max_model_len // block_size)


@dataclass(frozen=True)
class SlidingWindow:
    """K and V of the last ``window`` positions: at most ``window / block_size + 1`` pages."""

    window: int
    kv_heads: int
    head_dim: int
    dtype: str

    page_bytes = FullAttention.page_bytes

    def max_pages(self, max_model_len: int, block_size: int) -> int:
        return min(-(-max_model_len // block_size), self.window // block_size + 1)


@dataclass(frozen=True)
class SharedKV:
    """Reads the pages of ``producer_layer`` and owns none."""

    producer_layer: int


@dataclass(frozen=True)
class LinearState:
    """A fixed-size recurrent state per request (e.g. Gated DeltaNet's conv and delta-rule
    states): ``shapes`` of one request's arrays, one slot each in a state pool."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    def slot_bytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes) * _itemsize(self.dtype)


CacheSpec = Union[FullAttention, SlidingWindow, SharedKV, LinearState]


def attention_spec(kv_heads: int, head_dim: int, dtype: str, sliding_window: int | None
                   ) -> FullAttention | SlidingWindow:
    """The spec of an attention layer (``sliding_window`` None: full attention)."""
    if sliding_window is None:
        return FullAttention(kv_heads, head_dim, dtype)
    return SlidingWindow(sliding_window, kv_heads, head_dim, dtype)


@dataclass(frozen=True)
class CacheGroup:
    """Layers with one spec; ``readers``: the ``SharedKV`` layers that read this group's pages."""

    spec: CacheSpec
    layers: tuple[int, ...]
    readers: tuple[int, ...] = ()

    @property
    def paged(self) -> bool:
        return isinstance(self.spec, (FullAttention, SlidingWindow))


def group_layers(specs: Sequence[CacheSpec]) -> tuple[CacheGroup, ...]:
    """Layers with equal specs form a group (groups in the order of their first layer); a
    ``SharedKV`` layer joins its producer's group as a reader."""
    order: dict[CacheSpec, list[int]] = {}
    shared: list[tuple[int, int]] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, SharedKV):
            shared.append((i, spec.producer_layer))
        else:
            order.setdefault(spec, []).append(i)
    readers: dict[CacheSpec, list[int]] = {s: [] for s in order}
    for i, producer in shared:
        if not 0 <= producer < len(specs) or isinstance(specs[producer], SharedKV):
            raise ValueError(f"layer {i} shares the KV of layer {producer}, which owns none")
        readers[specs[producer]].append(i)
    return tuple(CacheGroup(s, tuple(ls), tuple(readers[s])) for s, ls in order.items())


@dataclass(frozen=True)
class PagePool:
    """One page pool: paged groups whose page ids index every one of their layers' arrays.
    ``kv_heads``/``head_dim``/``dtype``: the groups' page shape, None where they differ.
    ``window``: the largest window when every layer is windowed, else None (early pages are
    freed only when no layer reads them again)."""

    groups: tuple[CacheGroup, ...]
    kv_heads: int | None
    head_dim: int | None
    dtype: str | None
    window: int | None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(i for g in self.groups for i in g.layers))

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        """One page id across every layer that owns pages in this pool."""
        return sum(g.spec.page_bytes(block_size, tp) * len(g.layers) for g in self.groups)

    def max_pages(self, max_model_len: int, block_size: int) -> int:
        return max(g.spec.max_pages(max_model_len, block_size) for g in self.groups)


def page_pools(groups: Sequence[CacheGroup]) -> tuple[PagePool, ...]:
    """The page pools the engine allocates for these groups (one; see the module doc);
    ``LinearState`` groups are left to the state pool (:func:`state_groups`)."""
    groups = [g for g in groups if not isinstance(g.spec, LinearState)]
    if not groups:
        raise NotImplementedError("a model without any attention layer has no page pool")
    fields = [{getattr(g.spec, f) for g in groups} for f in ("kv_heads", "head_dim", "dtype")]
    kv_heads, head_dim, dtype = (next(iter(v)) if len(v) == 1 else None for v in fields)
    windows = [g.spec.window if isinstance(g.spec, SlidingWindow) else None for g in groups]
    window = None if any(w is None for w in windows) else max(windows)
    return (PagePool(tuple(groups), kv_heads, head_dim, dtype, window),)


def group_pools(groups: Sequence[CacheGroup]) -> tuple[PagePool, ...]:
    """One page pool per paged group, each with its own page ids (``core.kv_cache_coordinator``):
    a sliding group's pool frees the pages out of its own window."""
    return tuple(PagePool((g,), g.spec.kv_heads, g.spec.head_dim, g.spec.dtype,
                          g.spec.window if isinstance(g.spec, SlidingWindow) else None)
                 for g in groups if g.paged)


def split_budget(pools: Sequence[PagePool], budget_bytes: int, *, block_size: int,
                 max_model_len: int, tp: int = 1, extra_page_bytes: int = 0) -> tuple[int, ...]:
    """Pages per pool from one byte budget, in proportion to what a full-length request needs
    in each (so every pool runs out at the same number of requests). ``extra_page_bytes``: what
    a page of the first pool costs elsewhere too (a draft model's pool shares its ids)."""
    per_page = [p.page_bytes(block_size, tp) // tp for p in pools]
    per_page[0] += extra_page_bytes
    if len(pools) == 1:
        return (int(budget_bytes // per_page[0]),)
    need = [p.max_pages(max_model_len, block_size) for p in pools]
    per_request = sum(n * b for n, b in zip(need, per_page))
    return tuple(int(budget_bytes * n // per_request) for n in need)


# -- the state pool (LinearState groups) ------------------------------------------------------

def state_groups(groups: Sequence[CacheGroup]) -> tuple[CacheGroup, ...]:
    """The ``LinearState`` groups: their layers share one slot index per running request."""
    return tuple(g for g in groups if isinstance(g.spec, LinearState))


def state_bytes_per_slot(groups: Sequence[CacheGroup]) -> int:
    """One slot across every LinearState layer, all devices together (under tensor parallelism
    each device holds ``1/tp`` of it: the pool splits over heads)."""
    return sum(g.spec.slot_bytes() * len(g.layers) for g in state_groups(groups))


# ----------------------------------------------------------------------------- capacity arithmetic

def group_request_pages(group: CacheGroup, max_model_len: int, block_size: int) -> int:
    """Pages one ``max_model_len`` request holds at once in ``group`` (a sliding group: its
    window's, since it frees the pages that fall out of it)."""
    return group.spec.max_pages(max_model_len, block_size)


def kv_bytes_per_token(groups: Sequence[CacheGroup], *, block_size: int, max_model_len: int,
                       tp: int = 1) -> float:
    """KV bytes a ``max_model_len`` request holds per context token when every paged group
    keeps only what its layers read (sliding groups their window); KV-sharing layers cost
    nothing. All devices together."""
    total = sum(group_request_pages(g, max_model_len, block_size) * len(g.layers)
                * g.spec.page_bytes(block_size, tp) for g in groups if g.paged)
    return total / max_model_len


def pooled_kv_bytes_per_token(groups: Sequence[CacheGroup], *, block_size: int,
                              max_model_len: int, tp: int = 1) -> float:
    """The same figure for one pool whose page ids index every owning layer (each at its own
    shape), freeing early pages only when every layer is windowed."""
    pools = page_pools(groups)
    return sum(p.max_pages(max_model_len, block_size) * p.page_bytes(block_size, tp)
               for p in pools) / max_model_len


def uniform_kv_bytes_per_token(groups: Sequence[CacheGroup], *, tp: int = 1) -> float:
    """One uniform pool: every layer that owns KV at the full-attention (global) shape, no
    page ever freed early."""
    full = [g.spec for g in groups if isinstance(g.spec, FullAttention)]
    if not full:
        raise ValueError("no full-attention group to take the uniform shape from")
    layers = sum(len(g.layers) for g in groups if g.paged)
    return layers * full[0].page_bytes(1, tp)


def max_concurrency(budget_bytes: float, bytes_per_token: float, max_model_len: int) -> float:
    """How many ``max_model_len`` requests a KV budget holds (vLLM's "Maximum concurrency")."""
    return budget_bytes / (bytes_per_token * max_model_len)

"""The prefix cache's host-memory tier (vLLM's native CPU offloading, ``--kv-offloading-size``):
the index side, host only (no jax; the copies are ``jaxserve.worker.kv_offload``).

Every full page that enters a device pool's prefix cache is also stored in host memory under
the same block hash (vLLM stores blocks as they complete), one host pool per device pool with
its own capacity and its own LRU. A device pool then evicts as before, and a later request
whose prefix continues past the device hits finds the rest of the chain here: the scheduler
allocates fresh device pages for those blocks, counts their tokens as computed, and the
engine copies the host blocks into the pages before the step that reads them.

Rules:
- a host block is the page bytes of one hash in one pool: LoRA, salt and image keys are in
  the hash, fp8 pages and their scales are just bytes, so nothing else is keyed;
- a prefix hit needs every pool's block of each page (cache groups are served together);
- models with recurrent-state pools have no prefix cache, so no host tier either (a cached
  attention prefix does not restore the state: such requests recompute, as without a tier);
- a store queued before a load of the same slot is copied first (the engine runs stores
  first), and loads are issued in the step that reserved them, so no slot is ever pinned.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from jaxserve.core.kv_events import BlockRemoved, BlockStored, block_hash_bytes
from jaxserve.core.request import Request

MEDIUM = "CPU"  # vLLM's medium name of the host tier in KV events
OFFLOADING_BACKENDS = ("native", "lmcache")  # vLLM's choices; jaxserve builds the native one


class HostBlockPool:
    """One device pool's host blocks: hash -> slot, least recently used first."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a host pool needs >= 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))

    def __contains__(self, h: int) -> bool:
        return h in self._slots

    def get(self, h: int) -> int | None:
        return self._slots.get(h)

    def touch(self, h: int) -> None:
        self._slots.move_to_end(h)

    def put(self, h: int) -> tuple[int, int | None]:
        """A slot for ``h`` (new, most recent) and the hash it evicted (None: a free slot)."""
        evicted = None
        if self._free:
            slot = self._free.pop()
        else:
            evicted, slot = self._slots.popitem(last=False)
        self._slots[h] = slot
        return slot, evicted

    def check_invariants(self) -> None:
        """Every slot is free or holds exactly one hash (tests)."""
        held = list(self._slots.values())
        assert len(set(held)) == len(held), "a host slot holds two blocks"
        assert not set(held) & set(self._free), "a held host slot is also free"
        assert len(held) + len(self._free) == self.num_blocks, "a host slot leaked"

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @property
    def num_stored(self) -> int:
        return len(self._slots)


class KVOffload:
    """The scheduler's view of the host tier: stores as pages get cached, lookups past the
    device hits, and the copies each step asks the engine for."""

    def __init__(self, num_blocks: int, num_pools: int, block_size: int,
                 record_events: bool = False):
        if num_pools < 1:
            raise ValueError(f"num_pools must be >= 1, got {num_pools}")
        self.block_size = block_size
        self.pools = [HostBlockPool(num_blocks) for _ in range(num_pools)]
        # (pool, device page, host slot): device -> host copies the engine runs before the
        # next step (the page may be reused by that step: the copy is enqueued first)
        self._stores: list[tuple[int, int, int]] = []
        self.queries = 0  # tokens of admitted requests looked up (vLLM's external queries)
        self.hits = 0  # tokens served from host memory
        self._events: list | None = [] if record_events else None

    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding a cached block (the fullest pool)."""
        return max(p.num_stored / p.num_blocks for p in self.pools)

    @property
    def num_pending(self) -> int:
        """Stores not handed to the engine yet."""
        return len(self._stores)

    # -- stores -------------------------------------------------------------------------------
    def on_cached(self, group: int, request: Request, index: int, h: int, page: int) -> None:
        """Page ``index`` of ``request`` entered pool ``group``'s device prefix cache (hash
        ``h``, device page ``page``): keep a host copy (a block already here becomes the most
        recent)."""
        pool = self.pools[group]
        if h in pool:
            pool.touch(h)
            return
        slot, evicted = pool.put(h)
        self._stores.append((group, page, slot))
        if self._events is not None:
            if evicted is not None:
                self._events.append(BlockRemoved([block_hash_bytes(evicted)], MEDIUM))
            bs = self.block_size
            parent = request.block_hashes[index - 1] if index else None
            self._events.append(BlockStored(
                [block_hash_bytes(h)], None if parent is None else block_hash_bytes(parent),
                [int(t) for t in request.all_token_ids[index * bs:(index + 1) * bs]], bs,
                request.lora_int_id or None, MEDIUM))

    def take_stores(self) -> list[tuple[int, int, int]]:
        stores, self._stores = self._stores, []
        return stores

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, request: Request, first_page: int) -> list[list[int]]:
        """Per pool, the host slots of the pages that continue the device hits (``first_page``
        of them) while every pool holds the page; at least one token is left to compute.
        ``request.block_hashes`` is filled by the device lookup."""
        max_pages = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        slots: list[list[int]] = [[] for _ in self.pools]
        for i in range(first_page, min(max_pages, len(hashes))):
            found = [p.get(hashes[i]) for p in self.pools]
            if any(s is None for s in found):
                break
            for out, s in zip(slots, found):
                out.append(s)
        return slots

    def admit(self, request: Request, first_page: int, slots: Sequence[Sequence[int]],
              pages: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """A request was admitted with the host hits ``slots``: record the query, mark the
        blocks most recent and return (host slots, device pages) per pool to load."""
        n = len(slots[0])
        self.queries += request.num_tokens
        self.hits += n * self.block_size
        hashes = request.block_hashes
        for pool in self.pools:
            for h in hashes[first_page:first_page + n]:
                pool.touch(h)
        return ([list(s) for s in slots],
                [list(p[first_page:first_page + n]) for p in pages])

    def record_miss(self, request: Request) -> None:
        """An admitted request that found nothing in host memory."""
        self.queries += request.num_tokens

    def reset(self) -> None:
        """Drop every host block (with the device prefix cache's reset)."""
        for p in self.pools:
            p.clear()
        self._stores.clear()

    def check_invariants(self) -> None:
        for p in self.pools:
            p.check_invariants()

    def take_events(self) -> list:
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

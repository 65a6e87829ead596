"""The host-memory tier's bytes (``--kv-offloading-size``): one numpy buffer per paged layer
array, indexed by host slot, and the copies between it and the device pools. The index (which
hash sits in which slot, LRU, hits) is ``jaxserve.core.kv_offload.KVOffload``.

Copies run on the engine's thread before a step is dispatched: stores first (a device gather,
enqueued ahead of the step that may reuse the page, copied to host asynchronously and written
into the buffer once ready or when a load needs it), then loads (the host blocks scattered into
the requests' fresh pages, enqueued ahead of the step that reads them). Page and slot counts are
padded to powers of two (the trash page, a scratch slot), so copies compile a few shapes only.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_offload import KVOffload

logger = logging.getLogger(__name__)


@jax.jit
def _read_blocks(kv_pages, idx):
    """Each paged layer's arrays at pages ``idx`` (one pool's layers, one dispatch)."""
    return [tuple(a[:, idx] for a in kv) for kv in kv_pages]


@functools.partial(jax.jit, donate_argnums=0)
def _write_blocks(kv_pages, idx, blocks):
    """Each paged layer's arrays with ``blocks`` written at its pool's pages ``idx`` (the pool
    donated: a load touches its pages only)."""
    return [tuple(a.at[:, i].set(b) for a, b in zip(kv, blk)) for kv, i, blk in
            zip(kv_pages, idx, blocks)]


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def build_kv_offload(cache_config, runner, block_manager, max_model_len: int, *,
                     record_events: bool = False, num_hosts: int = 1,
                     draft_model: bool = False):
    """The host tier's index (given to the scheduler and the pools' managers) and its buffers,
    or (None, None) when ``--kv-offloading-size`` is unset or there is no prefix cache."""
    size = cache_config.kv_offloading_size
    if not size:
        return None, None
    if runner.stages is not None:
        raise ValueError("kv_offloading_size: the host tier does not support pipeline "
                         "parallelism yet")
    if draft_model:  # its pages share the target's ids but are not stored here
        raise ValueError("kv_offloading_size: the host tier does not work with a draft "
                         "model (speculative_config method 'draft_model') yet")
    if num_hosts > 1:
        raise ValueError("kv_offloading_size: the host tier runs on one host")
    if not block_manager.enable_prefix_caching:
        logger.info("no host KV tier: prefix caching is off (a recurrent-state model, or "
                    "--no-enable-prefix-caching), so nothing is cached to offload")
        return None, None
    num_blocks = int(size * (1 << 30)) // runner.page_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_offloading_size {size} GiB holds no block ({runner.page_bytes} "
                         "bytes each, every pool together)")
    managers = getattr(block_manager, "managers", [block_manager])
    tier = KVOffload(num_blocks, len(managers), block_manager.block_size, record_events)
    for m in managers:
        m.offload = tier
    logger.info("host KV tier: %d blocks of %d tokens (%.2f GiB, %d bytes a block)",
                num_blocks, block_manager.block_size, num_blocks * runner.page_bytes / 2**30,
                runner.page_bytes)
    bs = block_manager.block_size
    host = HostKVCache(runner, num_blocks, max_chunk=-(-max_model_len // bs))
    host.warmup()
    return tier, host


class HostKVCache:
    """Host copies of cached pages, one buffer per array of every paged layer (``[..., slots
    + 1, ...]`` on the pages axis; the last slot takes padded copies)."""

    def __init__(self, runner, num_blocks: int, max_chunk: int):
        self.runner = runner
        self.num_blocks = num_blocks
        self.max_chunk = _bucket(max_chunk)  # most pages one copy moves (larger ones split)
        self.rows = runner._pool_rows()  # (layer, pool row) of each paged layer
        self.num_pools = max(r for _, r in self.rows) + 1
        pages = runner.kv_pages
        # np.empty: the OS maps the memory as blocks get written
        self.buffers = [tuple(np.empty(a.shape[:1] + (num_blocks + 1,) + a.shape[2:], a.dtype)
                              for a in pages[i]) for i, _ in self.rows]
        # gathered on the device, not written here yet: (slots, arrays per layer)
        self._pending: list[tuple[np.ndarray, list]] = []
        self.num_stored = 0  # blocks copied in (for stats and tests)
        self.num_loaded = 0

    # -- device -> host ------------------------------------------------------------------------
    def store(self, stores: list[tuple[int, int, int]]) -> None:
        """Gather (pool, device page, host slot) copies; their bytes arrive asynchronously
        (the earlier ones that arrived are written first)."""
        self.flush()
        if not stores:
            return
        by_pool: dict[int, tuple[list[int], list[int]]] = {}
        for g, page, slot in stores:
            pg, sl = by_pool.setdefault(g, ([], []))
            pg.append(page)
            sl.append(slot)
        for g, (pg, sl) in by_pool.items():
            for i in range(0, len(pg), self.max_chunk):
                self._gather(g, pg[i:i + self.max_chunk], sl[i:i + self.max_chunk])
        self.num_stored += len(stores)

    def _gather(self, g: int, pages: list[int], slots: list[int]) -> None:
        n = _bucket(len(pages))
        idx = jnp.asarray(np.asarray(pages + [0] * (n - len(pages)), np.int32))
        slots = np.asarray(slots + [self.num_blocks] * (n - len(slots)), np.int64)
        runner = self.runner
        mine = [k for k, (_, row) in enumerate(self.rows) if row == g]
        with runner._pool_lock:
            kv = runner.kv_pages
            got = _read_blocks([kv[self.rows[k][0]] for k in mine], idx)
        arrays = [None] * len(self.rows)
        for k, blk in zip(mine, got):
            for a in blk:
                a.copy_to_host_async()
            arrays[k] = blk
        self._pending.append((slots, arrays))

    def flush(self, wait: bool = False, slots_needed: set[int] | None = None) -> None:
        """Write the gathered blocks that reached host memory, oldest first (a slot may be
        reused by a later store, so a newer copy is never written before an older one); with
        ``wait`` also those still on their way (all of them, or every copy up to the last one
        writing ``slots_needed``)."""
        last = -1
        if wait:
            last = len(self._pending) - 1 if slots_needed is None else max(
                (k for k, (slots, _) in enumerate(self._pending)
                 if not slots_needed.isdisjoint(slots.tolist())), default=-1)
        done = 0
        for k, (slots, arrays) in enumerate(self._pending):
            if k > last and not all(a.is_ready() for got in arrays if got for a in got):
                break
            for buf, got in zip(self.buffers, arrays):
                if got is None:
                    continue
                for b, a in zip(buf, got):
                    b[:, slots] = np.asarray(a)
            done = k + 1
        del self._pending[:done]

    # -- host -> device ------------------------------------------------------------------------
    def load(self, loads) -> None:
        """Copy (request id, host slots per pool, device pages per pool) into the pools."""
        if not loads:
            return
        slots = [[] for _ in range(self.num_pools)]
        pages = [[] for _ in range(self.num_pools)]
        for _, sl, pg in loads:
            for g in range(self.num_pools):
                slots[g] += sl[g]
                pages[g] += pg[g]
        # a block stored since the step in flight began: wait for its bytes (only those)
        self.flush(wait=True, slots_needed={x for sl in slots for x in sl})
        self.num_loaded += sum(len(p) for p in pages)
        total = max(len(p) for p in pages)
        for i in range(0, total, self.max_chunk):
            self._scatter([p[i:i + self.max_chunk] for p in pages],
                          [s[i:i + self.max_chunk] for s in slots])

    def _scatter(self, pages: list[list[int]], slots: list[list[int]]) -> None:
        """Padding writes the trash page from the scratch slot."""
        n = _bucket(max(len(p) for p in pages))
        pages = [p + [0] * (n - len(p)) for p in pages]
        slots = [s + [self.num_blocks] * (n - len(s)) for s in slots]
        runner = self.runner
        with runner._pool_lock:
            pool = list(runner.kv_pages)
            layers = [i for i, _ in self.rows]
            written = _write_blocks(
                [pool[i] for i in layers],
                [jnp.asarray(np.asarray(pages[row], np.int32)) for _, row in self.rows],
                [tuple(jnp.asarray(b[:, slots[row]]) for b in buf)
                 for buf, (_, row) in zip(self.buffers, self.rows)])
            for i, kv in zip(layers, written):
                pool[i] = kv
            runner._set_pool(pool)

    def warmup(self) -> None:
        """Compile every copy shape now (trash page <-> scratch slot), not during serving."""
        n = 1
        while n <= self.max_chunk:
            for g in range(self.num_pools):
                self._gather(g, [0] * n, [self.num_blocks] * n)
            self._scatter([[0] * n] * self.num_pools, [[self.num_blocks] * n] * self.num_pools)
            n *= 2
        self.flush(wait=True)

"""Moves of a runner's pools between steps: pages and recurrent states to host memory and
back (preemption by swap), and n > 1 forks (a sibling's pages and state copied on the device).
Each write keeps the step's input sharding, so no step recompiles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import sharding
from jaxserve.worker.kv_cache import fork_copy, fork_pairs


@jax.jit
def write_slot(state_pools, slot, saved):
    """Each LinearState layer's arrays with ``saved`` written at ``slot``."""
    return [tuple(a.at[slot].set(sa) for a, sa in zip(arrs, s)) for arrs, s in
            zip(state_pools, saved)]


@jax.jit
def _scatter_pages(kv_pages, idx, saved):
    return [tuple(a.at[:, idx].set(sa) for a, sa in zip(kv, s)) for kv, s in
            zip(kv_pages, saved)]


def write_pages(kv_pages, idx, saved):
    """Each paged layer's ``(k, v)`` with the host copies ``saved`` written at pages ``idx``."""
    saved = [tuple(jnp.asarray(a) for a in kv) for kv in saved]
    return _scatter_pages(kv_pages, idx, saved)


class PoolMoves:
    """The runner's swap and fork (``worker.runner.ModelRunner``): on its pools, or on each
    pipeline stage's share of them (``worker.stage_pipeline``); pages per pool either way."""

    def _paged_layers(self) -> list[int]:
        return [i for i in range(len(self.kv_pages)) if i not in self.state_layers]

    def _pool_rows(self) -> list[tuple[int, int]]:
        """(layer, block-table row of its pool) of every layer that owns pages."""
        c = self.kv_config
        return [(i, c.row(c.pool_of_layer[i])) for i in c.paged_layers]

    def swap_out(self, pages: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Copy pages (ids per pool) to host memory, one (k, v) pair of ``[Hkv, n, block, D]``
        per layer that owns pages (LinearState layers hold slots, not pages:
        ``swap_out_state``)."""
        idx = [jnp.asarray(np.asarray(p, dtype=np.int32)) for p in pages]
        with self._pool_lock:
            return jax.device_get([tuple(a[:, idx[g]] for a in self.kv_pages[i])
                                   for i, g in self._pool_rows()])

    def swap_in(self, pages: list[list[int]], saved) -> None:
        with self._pool_lock:
            rows = self._pool_rows()
            if self.stages is not None:  # each stage its layers' share of every pool
                return self.stages.swap_in(pages, saved, rows)
            pool = list(self.kv_pages)
            for g, ids in enumerate(pages):  # one scatter per pool
                mine = [k for k, (_, r) in enumerate(rows) if r == g]
                if not mine or not ids:
                    continue
                idx = jnp.asarray(np.asarray(ids, dtype=np.int32))
                written = write_pages([pool[rows[k][0]] for k in mine], idx,
                                      [saved[k] for k in mine])
                for k, kv in zip(mine, written):
                    pool[rows[k][0]] = kv
            self._set_pool(pool)

    def swap_out_state(self, slot: int) -> list[tuple[np.ndarray, ...]]:
        """Copy one request's recurrent state (every LinearState layer's arrays at ``slot``)
        to host memory."""
        with self._pool_lock:
            return jax.device_get([tuple(a[slot] for a in self.kv_pages[i])
                                   for i in self.state_layers])

    def swap_in_state(self, slot: int, saved) -> None:
        """Write a swapped request's state into its (new) ``slot``."""
        with self._pool_lock:
            if self.stages is not None:
                return self.stages.swap_in_state(slot, saved)
            written = write_slot([self.kv_pages[i] for i in self.state_layers], jnp.int32(slot),
                                 [tuple(jnp.asarray(a) for a in arrs) for arrs in saved])
            pool = list(self.kv_pages)
            for i, arrs in zip(self.state_layers, written):
                pool[i] = arrs
            self._set_pool(pool)

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """n > 1 siblings start from their first child's computed prompt: its pages and
        recurrent state copied into theirs, on the device, in step order."""
        if self.stages is not None:
            with self._pool_lock:
                return self.stages.fork(pages, slots)
        src, dst = fork_pairs(pages, 0)  # page 0: the trash page
        trash_slot = self.kv_pages[self.state_layers[0]][0].shape[0] - 1 if self.state_layers \
            else 0
        ssrc, sdst = fork_pairs(slots, trash_slot)
        with self._pool_lock:
            self._set_pool(fork_copy(list(self.kv_pages), tuple(self._paged_layers()),
                                     tuple(self.state_layers), src, dst, ssrc, sdst))

    def _set_pool(self, pool) -> None:
        """Keep the step's input sharding (no recompile under tp): page pools split over KV
        heads, state pools over their channel/head axis."""
        if self.mesh is not None:
            kv = sharding.kv_pool_sharding(self.mesh)
            state = sharding.state_pool_sharding(self.mesh)
            pool = jax.device_put(pool, [state if i in self.state_layers else kv
                                         for i in range(len(pool))])
        self.kv_pages = pool


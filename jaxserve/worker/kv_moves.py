"""Writes into a KV pool between steps: swapped pages and recurrent states back in place
(preemption by swap), jitted once per shape."""
from __future__ import annotations

import jax
import jax.numpy as jnp


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

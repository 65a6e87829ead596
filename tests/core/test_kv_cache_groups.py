"""Pools per KV cache group: the capacity arithmetic of a Gemma-4-31B-shaped config and the
KV cache coordinator (allocation all-or-nothing, per-group windows, prefix hits)."""
from __future__ import annotations

from jaxserve.core.block_manager import NULL_PAGE, BlockManager
from jaxserve.core.kv_cache_coordinator import KVCacheCoordinator
from jaxserve.core.kv_cache_spec import (group_layers, group_pools, kv_bytes_per_token,
                                         pooled_kv_bytes_per_token, uniform_kv_bytes_per_token)
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams


def test_gemma4_31b_kv_bytes_per_token_at_32k_is_under_30_percent_of_a_uniform_pool():
    from jaxserve.models.gemma4 import cache_specs_of
    from jaxserve.testing.presets import preset_config

    hf = preset_config("gemma4-31b")
    groups = group_layers(cache_specs_of(hf, "float8_e4m3fn"))
    assert [len(g.layers) for g in groups] == [50, 10]
    grouped = kv_bytes_per_token(groups, block_size=16, max_model_len=32768)
    uniform = uniform_kv_bytes_per_token(groups)
    # by hand: 50 sliding layers hold 65 pages (1040 tokens) of 2*16*256 B; 10 global layers
    # every token's 2*4*512 B; uniform: 60 layers at 2*4*512 B
    assert grouped == (50 * 1040 * 2 * 16 * 256 + 10 * 32768 * 2 * 4 * 512) / 32768
    assert uniform == 60 * 2 * 4 * 512
    assert grouped <= 0.30 * uniform
    # one pool indexing every layer by the same page ids frees nothing early: far more
    assert pooled_kv_bytes_per_token(groups, block_size=16, max_model_len=32768) > 3 * grouped
    pools = group_pools(groups)
    assert [p.window for p in pools] == [1024, None]


def _req(rid, n, seed=0):
    import numpy as np

    ids = np.random.default_rng(seed).integers(5, 500, n).tolist()
    return Request(rid, ids, SamplingParams(max_tokens=50))


def test_grouped_manager_frees_out_of_window_pages_and_serves_prefix_hits():
    sliding = BlockManager(12, 4, sliding_window=8)
    full = BlockManager(40, 4, group=1)
    bm = KVCacheCoordinator([sliding, full])
    a = _req("a", 30)
    assert bm.allocate_slots(a, 30, [[], []])
    a.num_computed_tokens = 30
    bm.cache_full_blocks(a)
    assert bm.group_used_pages() == [8, 8]
    assert bm.release_out_of_window(a) == 0  # the full group keeps every page
    sw, fl = a.group_block_ids
    assert bm.group_used_pages() == [3, 8]
    assert len(fl) == 8 and fl[0] != NULL_PAGE
    assert sw[:5] == [NULL_PAGE] * 5 and NULL_PAGE not in sw[5:]  # only the window's pages
    bm.check_invariants([a])
    # the same prompt again: full pages from both groups (the sliding one only in its window)
    b = _req("b", 30)
    hits, n = bm.get_computed_blocks(b)
    assert n == 28 and hits[1] == fl[:7] and hits[0][:5] == [NULL_PAGE] * 5
    assert bm.allocate_slots(b, 2, hits)
    b.num_computed_tokens = n  # what the scheduler does with a hit
    assert b.group_block_ids[1][:7] == fl[:7] and b.group_block_ids[0][5:7] == sw[5:7]
    bm.check_invariants([a, b])
    # more than the sliding pool has: nothing is allocated in any group
    c = _req("c", 60, seed=1)
    used = bm.group_used_pages()
    assert not bm.allocate_slots(c, 60, [[], []])
    assert bm.group_used_pages() == used and not any(c.group_block_ids)
    for r in (a, b):
        bm.free(r)
    assert bm.group_used_pages() == [0, 0]


def test_grouped_cached_page_counts_are_the_fewest_of_any_group():
    """The scheduler skips ``cache_full_blocks`` while a request's computed pages are no more
    than ``cached_page_counts``: grouped, that must be the group furthest behind."""
    sliding, full = BlockManager(40, 4, sliding_window=8), BlockManager(40, 4, group=1)
    bm = KVCacheCoordinator([sliding, full])
    a = _req("a", 20)
    assert bm.allocate_slots(a, 20, [[], []])
    a.num_computed_tokens = 20
    bm.cache_full_blocks(a)
    assert bm.cached_page_counts.get("a", 0) == 5
    full._num_cached_blocks["a"] = 3  # one group behind
    assert bm.cached_page_counts.get("a", 0) == 3
    assert bm.cached_page_counts.get("nobody", 0) == 0

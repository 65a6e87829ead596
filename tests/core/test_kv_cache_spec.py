"""Cache specs, groups and the page budget (host side)."""
from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_spec import (FullAttention, LinearState, PagePool, SharedKV,
                                         group_pools,
                                         state_bytes_per_slot,
                                         state_groups,
                                         SlidingWindow, group_layers, page_pools, split_budget)

FULL = FullAttention(kv_heads=2, head_dim=64, dtype="bfloat16")
LOCAL = SlidingWindow(window=32, kv_heads=2, head_dim=64, dtype="bfloat16")


def test_layers_with_equal_specs_form_a_group_and_shared_layers_read_their_producer():
    specs = [LOCAL, LOCAL, FULL, SharedKV(producer_layer=2), LOCAL, SharedKV(0)]
    groups = group_layers(specs)
    assert [g.spec for g in groups] == [LOCAL, FULL]
    assert groups[0].layers == (0, 1, 4) and groups[0].readers == (5,)
    assert groups[1].layers == (2,) and groups[1].readers == (3,)
    with pytest.raises(ValueError, match="owns none"):
        group_layers([FULL, SharedKV(1), SharedKV(1)])


def test_one_page_shape_is_one_pool_freeing_only_when_every_layer_is_windowed():
    mixed, = page_pools(group_layers([LOCAL, FULL, LOCAL]))
    assert mixed.window is None and mixed.layers == (0, 1, 2)
    local, = page_pools(group_layers([LOCAL, dataclasses.replace(LOCAL, window=64)]))
    assert local.window == 64
    # one page id covers K and V of every owning layer
    assert mixed.page_bytes(16) == 3 * 2 * 2 * 16 * 64 * 2
    assert mixed.page_bytes(16, tp=4) == 3 * 2 * 4 * 16 * 64 * 2  # heads repeated per device


def test_linear_state_layers_go_to_the_state_pool_not_a_page_pool():
    state = LinearState(((4, 8), (2, 8, 8)), "float32")
    groups = group_layers([state, state, state, FULL])
    pool, = page_pools(groups)
    assert pool.layers == (3,)
    assert state_groups(groups)[0].layers == (0, 1, 2)
    assert state_bytes_per_slot(groups) == 3 * (4 * 8 + 2 * 8 * 8) * 4
    with pytest.raises(NotImplementedError, match="no page pool"):
        page_pools(group_layers([state]))


def test_page_shapes_may_differ_in_one_pool_or_a_pool_per_group():
    # different page shapes share the page ids; each layer's array has its own shape
    wide = dataclasses.replace(FULL, head_dim=128, kv_heads=1)
    mixed, = page_pools(group_layers([LOCAL, wide, SharedKV(1)]))
    assert mixed.head_dim is None and mixed.kv_heads is None and mixed.dtype == "bfloat16"
    assert mixed.page_bytes(16) == 2 * 2 * 16 * 64 * 2 + 2 * 1 * 16 * 128 * 2
    local_pool, wide_pool = group_pools(group_layers([LOCAL, wide, SharedKV(1)]))
    assert (local_pool.window, wide_pool.window) == (32, None)
    assert wide_pool.page_bytes(16) == 2 * 1 * 16 * 128 * 2


def test_budget_split_in_proportion_to_what_a_request_needs():
    one, = page_pools(group_layers([FULL]))
    assert split_budget([one], 10_000_000, block_size=16, max_model_len=4096) == (
        10_000_000 // one.page_bytes(16),)
    # two pools (what per-group pools will allocate): each holds the same number of requests
    a = PagePool(group_layers([FULL]), 2, 64, "bfloat16", None)
    b = PagePool(group_layers([LOCAL]), 2, 64, "bfloat16", 32)
    na, nb = split_budget([a, b], 100 << 20, block_size=16, max_model_len=4096)
    assert na * a.page_bytes(16) + nb * b.page_bytes(16) <= 100 << 20
    assert na // 256 == nb // 3  # 4096/16 full pages, 32/16 + 1 window pages per request


def test_every_family_declares_a_spec_per_layer(tiny_model_factory):
    from jaxserve.loaders.model_loader import load_model

    model, cfg, _ = load_model(str(tiny_model_factory("gemma2", layers=4)), dtype="float32")
    specs = model.cache_specs("float32")
    assert len(specs) == cfg.num_layers
    assert {type(s) for s in specs} == {FullAttention, SlidingWindow}
    window = next(s.window for s in specs if isinstance(s, SlidingWindow))
    assert window == cfg.sliding_window
    assert len(group_layers(specs)) == 2 and len(page_pools(group_layers(specs))) == 1
    mc = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=4)
    from jaxserve.worker.kv_cache_config import model_cache_specs
    assert model_cache_specs(None, mc, "float32") == [FullAttention(1, 4, "float32")] * 2

"""The one KV cache sizer (core.kv_cache_config): pools named by group, pages from one budget,
state slots, the MTP head's pool."""
from __future__ import annotations

import pytest

from jaxserve.core.kv_cache_config import Budget, size_kv_cache
from jaxserve.core.kv_cache_spec import (FullAttention, LinearState, SharedKV, SlidingWindow,
                                         group_layers, page_pools, state_bytes_per_slot)

FULL = FullAttention(kv_heads=2, head_dim=64, dtype="bfloat16")
LOCAL = SlidingWindow(window=32, kv_heads=2, head_dim=64, dtype="bfloat16")
STATE = LinearState(((4, 8), (2, 8, 8)), "float32")
KW = dict(block_size=16, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=256)


def test_state_budget_gives_each_full_length_request_a_slot_and_its_pages():
    specs = [STATE, FULL]
    groups = group_layers(specs)
    page, slot = page_pools(groups)[0].page_bytes(16), state_bytes_per_slot(groups)
    per_request = slot + 256 * page  # max_model_len 4096 / 16
    c = size_kv_cache(specs, Budget(10 * per_request), per_group_pools=False, **KW)
    assert c.num_state_slots == 10 and c.pool_pages == (10 * 256,)
    assert c.pool_of_layer == (None, "full") and c.state_layers == (0,)
    # max_num_seqs caps the slots; the rest of the budget goes to pages
    c = size_kv_cache(specs, Budget(10 * per_request), per_group_pools=False,
                      **{**KW, "max_num_seqs": 4})
    assert c.num_state_slots == 4 and c.pool_pages == ((10 * per_request - 4 * slot) // page,)
    # scratch slots (speculative snapshots) come off the budget first
    c = size_kv_cache(specs, Budget(10 * per_request), per_group_pools=False,
                      scratch_slots=per_request // slot, **KW)
    assert c.num_state_slots == 9 and c.scratch_slots == per_request // slot


def test_every_kind_in_one_model_gets_named_pools_state_slots_and_window_headroom():
    specs = [STATE, LOCAL, FULL, STATE, LOCAL, SharedKV(2), FULL]
    page = FULL.page_bytes(16)
    budget = 100 * (2 * 256 * page + 2 * 3 * page + state_bytes_per_slot(group_layers(specs)))
    c = size_kv_cache(specs, Budget(budget), per_group_pools=True, **KW)
    assert [p.name for p in c.pools] == ["sliding_32", "full"]
    assert c.pool_of_layer == (None, "sliding_32", "full", None, "sliding_32", "full", "full")
    assert c.row("full") == 1 and c.paged_layers == (1, 2, 4, 6)
    sliding, full = c.pool_pages
    headroom = 256 // 16 + 64  # one step's chunks past the windows
    # both pools run out at the same number of requests: 3 pages vs 256 a request
    assert sliding - headroom == pytest.approx(full * 3 / 256, abs=1)
    assert 0 < c.num_state_slots <= 64
    # one shared pool: every paged layer indexes it
    one = size_kv_cache(specs, Budget(budget), per_group_pools=False, **KW)
    assert [p.name for p in one.pools] == ["sliding_32+full"]
    assert one.kv_bytes_per_token(4096) > c.kv_bytes_per_token(4096)


def test_override_host_cap_mtp_layer_and_no_room():
    specs = [FULL, FULL, FULL]  # the last: an MTP head's attention layer
    c = size_kv_cache(specs, Budget(0, num_pages_override=40), per_group_pools=False,
                      mtp_layer=2, **KW)
    assert c.pool_pages == (40,) and c.mtp_pool == "full" and c.num_state_slots is None
    # host budget: every sequence at full length if it fits, at least two
    big = size_kv_cache(specs, Budget(1 << 40, host=True), per_group_pools=False, **KW)
    assert big.pool_pages == (64 * 256 + 1,)
    tiny = size_kv_cache(specs, Budget(1, host=True), per_group_pools=False, **KW)
    assert tiny.pool_pages == (2 * 256 + 1,)
    with pytest.raises(ValueError, match="no room for the KV cache"):
        size_kv_cache(specs, Budget(FULL.page_bytes(16)), per_group_pools=False, **KW)
    with pytest.raises(ValueError, match="draft"):
        size_kv_cache([LOCAL, FULL], Budget(1 << 30), per_group_pools=True,
                      extra_page_bytes=100, **KW)


def test_pipeline_stages_size_each_range_on_its_own_budget_and_share_the_pools():
    """Each stage holds only its layers' share of every pool (same names, rows, pages and
    slots); pages are what the fullest stage's budget holds, not the whole model's."""
    specs = [STATE, LOCAL, FULL, LOCAL, SharedKV(3), FULL, FULL]  # stages [0, 3), [3, 7)
    page = FULL.page_bytes(16)
    budget = Budget(50 * (256 * page + 3 * page) + 50 * state_bytes_per_slot(group_layers(specs)))
    whole = size_kv_cache(specs, budget, per_group_pools=True, **KW)
    staged = size_kv_cache(specs, budget, per_group_pools=True, stages=[(0, 3), (3, 7)], **KW)
    assert [p.name for p in staged.pools] == [p.name for p in whole.pools]
    assert staged.pool_of_layer == whole.pool_of_layer
    # the fullest stage (two full layers beside a sliding one) holds fewer layers than all
    assert all(s > w for s, w in zip(staged.pool_pages, whole.pool_pages))
    alone = size_kv_cache([LOCAL, SharedKV(0), FULL, FULL], budget, per_group_pools=True, **KW)
    assert staged.pool_pages == alone.pool_pages  # the second stage's fit is the fewest
    assert staged.num_state_slots >= whole.num_state_slots
    first, second = staged.layer_range(0, 3), staged.layer_range(3, 7)
    assert first.pool_pages == second.pool_pages == staged.pool_pages
    assert first.state_layers == (0,) and second.state_layers == ()
    assert first.num_state_slots == second.num_state_slots == staged.num_state_slots
    assert second.specs[1] == SharedKV(0)  # its producer, numbered within the stage
    assert second.pool_of_layer == ("sliding_32", "sliding_32", "full", "full")
    assert [p.layers for p in second.pools] == [(0,), (2, 3)]
    assert first.pool("full").page_bytes(16) == page  # one full layer on the first stage
    # the MTP head's layer belongs to the range that holds it
    mtp = size_kv_cache([FULL, FULL, FULL], Budget(0, num_pages_override=40),
                        per_group_pools=False, mtp_layer=2, stages=[(0, 1), (1, 3)], **KW)
    assert mtp.layer_range(1, 3).mtp_layer == 1 and mtp.layer_range(0, 1).mtp_layer is None

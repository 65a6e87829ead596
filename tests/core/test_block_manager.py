"""BlockManager: free list, ref counts, prefix-cache hash chain, LRU eviction."""
import random

import pytest

from jaxserve.core.block_manager import BlockManager, hash_page_tokens
from jaxserve.core.request import Request

BS = 4


def make_req(rid, tokens, salt=None):
    return Request(rid, tokens, cache_salt=salt)


def run_prefill(bm, req, hits=None):
    """Allocate the whole uncached part of a request, 'compute' it, register its full pages."""
    pages, n_hit = bm.get_computed_blocks(req) if hits is None else hits
    assert bm.allocate_slots(req, req.num_tokens - n_hit, pages)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return n_hit


def test_fresh_pool_never_hands_out_trash_page():
    bm = BlockManager(9, BS)
    assert bm.num_free_pages == 8 and bm.usage == 0.0
    r = make_req("a", range(32))  # exactly 8 pages
    assert bm.allocate_slots(r, 32)
    assert sorted(r.block_ids) == list(range(1, 9))
    assert bm.num_free_pages == 0 and bm.usage == 1.0
    assert not bm.allocate_slots(make_req("b", [1]), 1)
    bm.check_invariants([r])
    bm.free(r)
    assert bm.num_free_pages == 8 and r.block_ids == []
    assert all(rc == 0 for rc in bm.ref_counts)


def test_allocation_grows_one_page_per_block_size_tokens():
    bm = BlockManager(10, BS)
    r = make_req("a", range(5))
    assert bm.allocate_slots(r, 5)
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 5
    for n_tokens in range(6, 14):  # decode steps
        r.append_output_token(7)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        assert len(r.block_ids) == -(-n_tokens // BS)


def test_allocation_failure_leaves_state_unchanged():
    bm = BlockManager(6, BS)  # 5 usable
    a = make_req("a", range(12))
    run_prefill(bm, a)  # 3 full pages, cached
    a_pages = list(a.block_ids)
    bm.free(a)
    c = make_req("c", range(100, 116))
    assert bm.allocate_slots(c, 16)  # 4 pages: 2 never used, then a's tail pages (evicted)
    assert set(c.block_ids) >= set(a_pages[1:]) and a_pages[0] not in c.block_ids
    assert bm.num_cached_pages == 1
    b = make_req("b", list(range(12)) + [99] * 8)
    pages, n_hit = bm.get_computed_blocks(b)
    assert (pages, n_hit) == ([a_pages[0]], 4)
    snapshot = (list(bm.ref_counts), bm.free_page_ids(), list(bm.page_hash), bm.prefix_cache_queries)
    assert not bm.allocate_slots(b, b.num_tokens - n_hit, pages)  # needs 1 hit + 4 new > 1 free
    assert b.block_ids == []
    assert snapshot == (list(bm.ref_counts), bm.free_page_ids(), list(bm.page_hash), bm.prefix_cache_queries)
    bm.check_invariants([c])


def test_failed_allocation_with_free_cached_hits_changes_nothing():
    bm = BlockManager(5, BS)  # 4 usable
    a = make_req("a", range(9))
    run_prefill(bm, a)  # 3 pages, 2 full cached
    bm.free(a)
    b = make_req("b", list(range(8)) + list(range(50, 62)))  # 2 hits (free) + needs 3 new = 5 > 4
    pages, n_hit = bm.get_computed_blocks(b)
    assert n_hit == 8
    snapshot = (list(bm.ref_counts), bm.free_page_ids(), list(bm.page_hash))
    assert not bm.allocate_slots(b, b.num_tokens - n_hit, pages)
    assert snapshot == (list(bm.ref_counts), bm.free_page_ids(), list(bm.page_hash))
    assert b.block_ids == []


def test_shared_prefix_hits_ref_counts_and_hit_rate():
    bm = BlockManager(32, BS)
    system = list(range(1000, 1012))  # 3 full pages
    reqs = [make_req(f"r{i}", system + [i, i + 1, i + 2]) for i in range(5)]
    hits = [run_prefill(bm, r) for r in reqs]
    assert hits == [0, 12, 12, 12, 12]
    shared = reqs[0].block_ids[:3]
    for r in reqs[1:]:
        assert r.block_ids[:3] == shared  # copy-free sharing
        assert not set(r.block_ids[3:]) & set(shared)
    assert [bm.ref_counts[p] for p in shared] == [5, 5, 5]
    assert bm.prefix_cache_queries == 5 * 15 and bm.prefix_cache_hits == 4 * 12
    assert bm.hit_rate == pytest.approx(48 / 75)
    bm.check_invariants(reqs)
    for r in reqs:
        bm.free(r)
    assert bm.num_free_pages == 31 and all(rc == 0 for rc in bm.ref_counts)
    assert bm.num_cached_pages == 3  # freed pages stay cached
    late = make_req("late", system + [7])
    assert run_prefill(bm, late) == 12


def test_never_the_whole_prompt_is_a_hit():
    bm = BlockManager(16, BS)
    a = make_req("a", range(8))
    run_prefill(bm, a)
    same = make_req("same", range(8))
    pages, n = bm.get_computed_blocks(same)
    assert n == 4 and pages == a.block_ids[:1]  # the last token is always recomputed
    longer = make_req("longer", range(9))
    assert bm.get_computed_blocks(longer)[1] == 8


def test_hash_chain_depends_on_the_whole_prefix_and_salt():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # same second page, different first page: no hit at all
    assert bm.get_computed_blocks(make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert bm.get_computed_blocks(make_req("c", [1, 2, 3, 4, 5, 6, 7, 0, 9]))[1] == 4
    assert bm.get_computed_blocks(make_req("d", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="x"))[1] == 0
    assert hash_page_tokens(None, [1, 2]) != hash_page_tokens(hash_page_tokens(None, [0]), [1, 2])
    assert hash_page_tokens(None, [1, 2]) != hash_page_tokens(None, [1, 2], "lora1")


def test_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_req("a", range(9))
    run_prefill(bm, a)
    b = make_req("b", range(9))
    assert bm.get_computed_blocks(b) == ([], 0)
    assert run_prefill(bm, b) == 0
    assert not set(a.block_ids) & set(b.block_ids)
    assert bm.num_cached_pages == 0 and bm.hit_rate == 0.0


def test_lru_eviction_order_and_tail_first():
    bm = BlockManager(13, BS)  # 12 usable
    a = make_req("a", range(0, 12))  # 3 pages
    b = make_req("b", range(100, 112))
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)  # a freed first -> least recently used
    bm.free(b)
    assert bm.num_cached_pages == 6
    # the 6 never-used pages go first, then a's pages tail first, then b's tail first
    expected_cached_order = list(reversed(a.block_hashes)) + list(reversed(b.block_hashes))
    filler = make_req("f", range(500, 524))  # 6 pages: exactly the never-used ones
    assert bm.allocate_slots(filler, 24)
    assert bm.num_cached_pages == 6
    evicted = []
    for k in range(6):
        x = make_req(f"x{k}", [9000 + k])
        before = set(bm._cached)
        assert bm.allocate_slots(x, 1)
        (gone,) = before - set(bm._cached)
        evicted.append(gone)
    assert evicted == expected_cached_order


def test_hit_refreshes_lru_position():
    bm = BlockManager(9, BS)  # 8 usable
    a = make_req("a", range(0, 8))
    b = make_req("b", range(100, 108))
    run_prefill(bm, a)
    run_prefill(bm, b)
    a_pages = list(a.block_ids)
    bm.free(a)
    bm.free(b)
    # reuse a's first page (a hit): it leaves the free queue and comes back at the tail
    a2 = make_req("a2", list(range(0, 4)) + [77])
    assert run_prefill(bm, a2) == 4
    assert bm.num_free_pages == 6  # 8 - hit page - 1 new page
    bm.free(a2)
    order = bm.free_page_ids()
    assert order[-1] == a_pages[0]  # most recently used: evicted last
    assert order[0] not in a_pages  # a2's uncached tail page is reused first


def test_uncached_pages_are_reused_before_cached_ones():
    bm = BlockManager(5, BS)  # 4 usable
    a = make_req("a", range(8))
    run_prefill(bm, a)  # 2 cached pages
    bm.free(a)
    junk = make_req("j", [5, 6])  # 1 partial page, never cached
    assert bm.allocate_slots(junk, 2)
    (junk_page,) = junk.block_ids
    bm.free(junk)
    assert bm.free_page_ids()[0] == junk_page
    n = make_req("n", [42, 43])
    assert bm.allocate_slots(n, 2)
    assert bm.num_cached_pages == 2  # took the uncached page, not a cached one


def test_concurrent_identical_prompts_share_after_registration():
    bm = BlockManager(16, BS)
    a = make_req("a", range(9))
    b = make_req("b", range(9))
    # both miss (nothing cached yet), both compute their own copy
    pa, _ = bm.get_computed_blocks(a)
    pb, _ = bm.get_computed_blocks(b)
    assert pa == pb == []
    assert bm.allocate_slots(a, 9, pa) and bm.allocate_slots(b, 9, pb)
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)  # duplicate pages: not registered twice
    assert bm.num_cached_pages == 2
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_pages == 15 and bm.num_cached_pages == 2
    bm.check_invariants([])


def test_reset_prefix_cache():
    bm = BlockManager(16, BS)
    a = make_req("a", range(9))
    run_prefill(bm, a)
    assert not bm.reset_prefix_cache()  # pages in use
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.num_cached_pages == 0 and all(h is None for h in bm.page_hash)
    assert bm.get_computed_blocks(make_req("b", range(9))) == ([], 0)


def test_random_alloc_free_churn_has_no_leak():
    rnd = random.Random(0)
    bm = BlockManager(40, BS)
    live = []
    prefixes = [list(range(k * 100, k * 100 + 12)) for k in range(3)]
    for step in range(600):
        if live and (rnd.random() < 0.4 or bm.num_free_pages < 6):
            r = live.pop(rnd.randrange(len(live)))
            bm.free(r)
        else:
            toks = rnd.choice(prefixes)[: rnd.randrange(0, 13)] + [rnd.randrange(50) for _ in range(rnd.randrange(1, 10))]
            r = make_req(f"r{step}", toks)
            pages, n_hit = bm.get_computed_blocks(r)
            if bm.allocate_slots(r, r.num_tokens - n_hit, pages):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                live.append(r)
            else:
                assert r.block_ids == []
        bm.check_invariants(live)
    for r in live:
        bm.free(r)
    assert bm.num_free_pages == 39 and all(rc == 0 for rc in bm.ref_counts)
    assert bm.prefix_cache_hits > 0
    bm.check_invariants([])


def test_bad_construction():
    with pytest.raises(ValueError):
        BlockManager(1, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def _with_image(rid, tokens, image_hash, offset, n):
    from jaxserve.core.mm_inputs import ImageItem, MultiModalInputs

    req = make_req(rid, tokens)
    req.mm = MultiModalInputs([ImageItem(image_hash, offset, n, (1, 2, 2), b"", 1)], 99)
    return req


def test_image_hashes_key_the_pages_that_hold_their_placeholders():
    """Same text with the same picture hits; with another picture only the pages before the
    image's placeholders hit (the placeholder ids are the same, the pictures are not)."""
    bm = BlockManager(32, BS)
    tokens = [1, 2, 3, 4, 5, 99, 99, 99, 99, 6, 7, 8, 9]  # image at 5..8: pages 1 and 2
    run_prefill(bm, _with_image("a", tokens, "cat", 5, 4))
    assert bm.get_computed_blocks(_with_image("same", tokens, "cat", 5, 4))[1] == 12
    assert bm.get_computed_blocks(_with_image("other", tokens, "dog", 5, 4))[1] == 4
    assert bm.get_computed_blocks(make_req("text", tokens))[1] == 4

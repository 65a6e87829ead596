"""The prefix cache's host tier (core.kv_offload) with the scheduler, on the fake device of
test_scheduler (a KV store of token ids that checks every row's context through its block
table): host hits restore exactly the evicted prefix, LRU, events, flags and bad values."""
import numpy as np
import pytest

from jaxserve.args import EngineArgs
from jaxserve.config import CacheConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.kv_cache_coordinator import make_kv_cache_manager
from jaxserve.core.kv_events import BlockRemoved, BlockStored
from jaxserve.core.kv_offload import HostBlockPool, KVOffload
from jaxserve.core.request import RequestStatus
from jaxserve.entrypoints.cli import build_parser, engine_config_from_args

from tests.core.test_scheduler import FakeDevice, check_step, make_sched, req


class TierDevice(FakeDevice):
    """The fake device plus a host tier: stores copy pages out before the step (and before
    swap-outs), loads copy host blocks into the requests' fresh pages."""

    def __init__(self, sched):
        super().__init__(sched)
        self.blocks: dict[tuple[int, int], np.ndarray] = {}
        self.num_loaded = 0

    def step(self, out):
        bs = self.s.block_size
        for g, page, slot in self.s.kv_offload.take_stores():
            self.blocks[g, slot] = self.kv[page * bs:(page + 1) * bs].copy()
        for _, slots, pages in out.kv_loads:
            for g, (sl, pg) in enumerate(zip(slots, pages)):
                for s, p in zip(sl, pg):
                    self.kv[p * bs:(p + 1) * bs] = self.blocks[g, s]
                    self.num_loaded += 1
        return super().step(out)


def with_tier(sched, num_blocks, events=False):
    tier = KVOffload(num_blocks, 1, sched.block_size, record_events=events)
    sched.block_manager.offload = tier
    sched.kv_offload = tier
    return tier


def conversations(n, turns, seed=0, first=14, grow=6):
    """Per conversation, its prompt at each turn (a growing history)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h = rng.integers(0, 1000, first).tolist()
        conv = [list(h)]
        for _ in range(turns - 1):
            h = h + rng.integers(0, 1000, grow).tolist()
            conv.append(list(h))
        out.append(conv)
    return out


def run_turns(sched, dev, convs, max_tokens=3):
    """Each turn: every conversation's prompt (its history) as one request, run to the end."""
    outs = []
    for t in range(len(convs[0])):
        reqs = [req(f"c{i}t{t}", c[t], max_tokens=max_tokens) for i, c in enumerate(convs)]
        for r in reqs:
            sched.add_request(r)
        steps = 0
        while sched.has_unfinished():
            out = sched.schedule()
            check_step(sched, out)
            sampled = dev.step(out)
            for r in sched.update_after_dispatch(out, sampled):
                if r.num_output_tokens >= r.max_tokens:
                    sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
            steps += 1
            assert steps < 2000
        outs.append([(list(r.output_token_ids), r.num_cached_tokens) for r in reqs])
    return outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_hits_restore_evicted_prefixes(mode):
    """A pool too small for the conversations' histories: without the tier later turns
    recompute; with it they load the evicted blocks, and every context reads back right."""
    convs = conversations(6, 4)
    results = {}
    for tiered in (False, True):
        sched = make_sched(num_pages=14, block_size=4, budget=16, max_seqs=3, mode=mode)
        dev = TierDevice(sched) if tiered else FakeDevice(sched)
        tier = with_tier(sched, 200) if tiered else None
        results[tiered] = run_turns(sched, dev, convs)
        bm = sched.block_manager
        assert bm.num_used_pages == 0 and sched.num_swapped == 0
        if tiered:
            assert tier.hits > 0 and dev.num_loaded == tier.hits // 4
            assert all(p > 0 for _, p, _ in tier._stores)  # never the trash page
            tier.check_invariants()
    assert [[o for o, _ in t] for t in results[True]] == [[o for o, _ in t]
                                                        for t in results[False]]
    cached = lambda res: sum(c for t in res[1:] for _, c in t)  # noqa: E731
    assert cached(results[True]) > cached(results[False])


def test_second_turn_hits_the_host_tier_for_its_whole_history():
    sched = make_sched(num_pages=8, block_size=4, budget=32, max_seqs=2)
    dev = TierDevice(sched)
    tier = with_tier(sched, 64)
    a = list(range(100, 124))  # 6 full pages
    run_turns(sched, dev, [[a]])
    run_turns(sched, dev, [[list(range(200, 228))]])  # evicts every page of a's history
    device_hits = sched.block_manager.prefix_cache_hits
    (out, cached), = run_turns(sched, dev, [[a + [7, 8, 9]]])[0]
    assert sched.block_manager.prefix_cache_hits == device_hits  # evicted from the device
    assert cached == 24 and tier.hits == 24  # every page of the history, from host memory
    fresh = make_sched(num_pages=8, block_size=4, budget=32, max_seqs=2)
    (want, _), = run_turns(fresh, FakeDevice(fresh), [[a + [7, 8, 9]]])[0]
    assert out == want


def test_host_lru_evicts_least_recent_and_events_say_cpu():
    pool = HostBlockPool(2)
    assert pool.put(1) == (0, None) and pool.put(2) == (1, None)
    pool.touch(1)
    assert pool.put(3) == (1, 2)  # 2 was the least recent
    assert 2 not in pool and pool.get(1) == 0
    sched = make_sched(num_pages=6, block_size=4, budget=32)
    tier = with_tier(sched, 2, events=True)
    run_turns(sched, TierDevice(sched), [[list(range(10, 23))]])  # 3 full pages, 2 host blocks
    ev = tier.take_events()
    stored = [e for e in ev if isinstance(e, BlockStored)]
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert len(stored) == 3 and len(removed) == 1
    assert all(e.medium == "CPU" for e in stored + removed)
    assert stored[1].token_ids == list(range(14, 18))
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert removed[0].block_hashes == stored[0].block_hashes
    assert tier.usage == 1.0


def test_cache_groups_need_every_pool_on_host():
    """Two pools (full + sliding): a page is a host hit only when both pools hold it."""
    mgr = make_kv_cache_manager([("full", 16, None), ("sliding_8", 16, 8)], block_size=4,
                                num_state_slots=None, enable_prefix_caching=True)
    tier = KVOffload(8, 2, 4)
    for m in mgr.managers:
        m.offload = tier
    r = req("a", list(range(30, 43)))
    mgr.allocate_slots(r, 13, [])
    r.num_computed_tokens = 13
    mgr.cache_full_blocks(r)
    assert [s for _, _, s in tier.take_stores()] == [0, 1, 2, 0, 1, 2]
    probe = req("b", list(range(30, 43)) + [1])
    mgr.get_computed_blocks(probe)
    assert tier.lookup(probe, 0) == [[0, 1, 2], [0, 1, 2]]
    tier.pools[1]._slots.pop(r.block_hashes[1])  # the sliding pool lost page 1
    assert tier.lookup(probe, 0) == [[0], [0]]


def test_flags_parse_as_vllm_writes_them_and_bad_values_name_the_field():
    parse = build_parser().parse_args
    c = engine_config_from_args(parse(["serve", "m", "--kv-offloading-size", "8",
                                       "--kv-offloading-backend", "native"]))
    assert c.cache.kv_offloading_size == 8.0 and c.cache.kv_offloading_backend == "native"
    assert engine_config_from_args(parse(["serve", "m"])).cache.kv_offloading_size is None
    for bad in (["--kv-offloading-size", "-1"], ["--kv-offloading-size", "x"],
                ["--kv-offloading-backend", "disk"]):
        with pytest.raises(SystemExit):
            parse(["serve", "m", *bad])
    with pytest.raises(ValueError, match="kv_offloading_backend 'lmcache' is not supported"):
        engine_config_from_args(parse(["serve", "m", "--kv-offloading-size", "1",
                                       "--kv-offloading-backend", "lmcache"]))
    with pytest.raises(ValueError, match="kv_offloading_size"):
        CacheConfig(kv_offloading_size=0)
    with pytest.raises(ValueError, match="kv_offloading_backend needs kv_offloading_size"):
        CacheConfig(kv_offloading_backend="native")
    with pytest.raises(ValueError, match="kv_offloading_size"):
        EngineArgs(model="m", kv_offloading_size=-2.0).create_engine_config()
    assert BlockManager(4, 4).offload is None  # off unless the engine builds a tier

"""Scheduler: token budget, chunked prefill, priorities, prefix hits, preemption (both modes),
aborts, and random workloads driven to completion on a fake device.

The fake device is a real KV store of token ids: each step writes every fed token into its
slot (from the StepPlan's slot_mapping), checks that every earlier position of every row reads
back the right token through the block table, and "samples" a token that is a function of the
context it read. So a lost page, a wrong prefix hit or a bad swap changes the outputs.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.core.block_manager import BlockManager
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import ABORT_KV_CACHE_EXHAUSTED, Scheduler
from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import token_ladder
from jaxserve.testing.reference_plan import build_step_plan, to_rows
from jaxserve.worker.input_batch import InputBatch

VOCAB = 1000


def Params(max_tokens: int | None = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def make_sched(num_pages=64, block_size=4, budget=64, max_seqs=8, max_model_len=256,
               mode="recompute", chunked=True, prefix=True, swap_space=4.0, page_bytes=None):
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix, swap_space=swap_space)
    sc = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                         preemption_mode=mode, enable_chunked_prefill=chunked)
    bm = BlockManager(num_pages, block_size, enable_prefix_caching=prefix)
    return Scheduler(sc, cc, bm, max_model_len, page_bytes=page_bytes)


def req(rid, prompt, max_tokens=16, priority=0, arrival=None):
    return Request(rid, list(prompt), Params(max_tokens), arrival_time=arrival, priority=priority)


class FakeDevice:
    """KV pages holding token ids (-1 = never written); host swap space as a dict."""

    def __init__(self, sched: Scheduler):
        self.s = sched
        bs = sched.block_size
        self.kv = np.full(sched.block_manager.num_pages * bs, -1, dtype=np.int64)
        self.host: dict[str, np.ndarray] = {}
        self.ladder = token_ladder(sched.config.max_num_batched_tokens, 4)
        self.max_pages = sched.max_pages_per_seq  # the batch raises if a row needs more
        # the engine's builder: the persistent batch, changed by each step's diff
        self.batch = self._new_batch()

    def _new_batch(self) -> InputBatch:
        return InputBatch(max_rows=self.s.max_num_seqs, num_groups=1, max_pages=self.max_pages,
                          block_size=self.s.block_size, max_model_len=self.s.max_model_len,
                          max_num_seqs=self.s.max_num_seqs)

    def check_rebuild(self) -> None:
        """The persistent batch holds exactly what one rebuilt from the live requests would."""
        live = [r for r in self.s.running if r.in_batch]
        assert set(self.batch.row_of) == {r.request_id for r in live}
        fresh = self._new_batch()
        fresh.apply(BatchDiff(new_reqs=[NewRequestData(
            r.request_id, list(r.all_token_ids), r.num_prompt_tokens, r.sampling_params,
            [list(p) for p in r.pages_per_group()], r.lora_int_id, r.state_slot)
            for r in live]))
        assert self.batch.snapshot() == fresh.snapshot()

    def step(self, out) -> dict[str, int]:
        bs = self.s.block_size
        for rid in out.finished_req_ids:
            self.host.pop(rid, None)
        for rid, (pages,) in out.swap_out:  # before the step: the pages may be reused by it
            self.host[rid] = np.stack([self.kv[p * bs:(p + 1) * bs] for p in pages])
        for rid, (pages,) in out.swap_in:
            data = self.host.pop(rid)
            assert len(data) == len(pages)
            for p, d in zip(pages, data):
                self.kv[p * bs:(p + 1) * bs] = d
        self.batch.apply(out.batch)
        self.check_rebuild()
        if out.is_empty:
            return {}
        plan = self.batch.prepare_inputs(out.batch, ladder=self.ladder)
        # the rows' own builder agrees on everything the forward reads
        ref = build_step_plan(to_rows(out), block_size=bs, max_pages_per_seq=self.max_pages,
                              ladder=self.ladder, max_num_seqs=self.s.max_num_seqs)
        for f in ("token_ids", "positions", "slot_mapping", "query_start", "seq_lens",
                  "block_tables", "logits_indices", "sample_mask", "state_slots"):
            assert np.array_equal(getattr(plan, f), getattr(ref, f)), f
        n = plan.num_tokens
        self.kv[plan.slot_mapping[0, :n]] = plan.token_ids[:n]
        sampled = {}
        for i, s in enumerate(out.scheduled):
            L = int(plan.seq_lens[i])
            pos = np.arange(L)
            ctx = self.kv[plan.block_tables[0, i, pos // bs] * bs + pos % bs]
            expect = np.asarray(s.request.all_token_ids[:L])
            assert np.array_equal(ctx, expect), f"{s.request_id}: KV context corrupted"
            if s.sample:
                sampled[s.request_id] = int((ctx * np.arange(1, L + 1)).sum() % VOCAB)
        rows = plan.token_rows[:plan.num_seqs]
        ids = np.array([sampled.get(s.request_id, -1) for s in out.scheduled], np.int32)
        self.batch.record(rows, self.batch.generation[np.maximum(rows, 0)],
                          plan.seq_lens[:plan.num_seqs], ids)
        return sampled


def check_step(sched, out):
    assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    ids = [s.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    for s in out.scheduled:
        r = s.request
        assert s.num_new_tokens >= 1 and s.start_pos == r.num_computed_tokens
        assert s.new_token_ids == r.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens]
        assert s.sample == (s.start_pos + s.num_new_tokens == r.num_tokens)
        assert s.start_pos + s.num_new_tokens <= sched.max_model_len
        assert r.status == RequestStatus.RUNNING
    live = list(sched.requests.values())
    bm = sched.block_manager
    bm.check_invariants(live)
    for r in live:  # a cached page in a request's table is exactly its own prefix's page
        for i, p in enumerate(r.block_ids):
            if bm.page_hash[p] is not None:
                assert i < len(r.block_hashes) and r.block_hashes[i] == bm.page_hash[p]
    for r in sched.waiting:
        assert r.block_ids == []


def run_all(sched, requests, abort_at=None, max_steps=5000):
    """Engine loop: stop at max_tokens. ``abort_at``: {step: [ids]}. Returns (outputs, steps)."""
    dev = FakeDevice(sched)
    for r in requests:
        sched.add_request(r)
    done = {}
    steps = 0
    while sched.has_unfinished():
        for rid in (abort_at or {}).get(steps, []):
            sched.abort_request(rid)
        out = sched.schedule()
        check_step(sched, out)
        assert out.scheduled or out.finished_outputs or not sched.has_unfinished() or \
            out.preempted, "scheduler idles with work left (deadlock)"
        sampled = dev.step(out)
        for r in sched.update_after_dispatch(out, sampled):
            if r.num_output_tokens >= r.max_tokens:
                sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        steps += 1
        assert steps < max_steps, "did not terminate"
    for r in requests:
        assert r.is_finished
        done[r.request_id] = list(r.output_token_ids)
    bm = sched.block_manager
    assert bm.num_free_pages == bm.num_pages - 1
    assert all(rc == 0 for rc in bm.ref_counts)
    assert sched.num_swapped == 0 and not dev.host
    return done, steps


def workload(n=12, seed=0, shared=12, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, shared).tolist()
    reqs = []
    for i in range(n):
        tail = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
        prompt = (system if i % 2 == 0 else []) + tail
        reqs.append(req(f"r{i}", prompt, max_tokens=int(rng.integers(1, 20)), arrival=float(i)))
    return reqs


# -- validation --------------------------------------------------------------------------------
def test_add_request_validation_and_length_cap():
    s = make_sched(max_model_len=32, num_pages=64)
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req("long", range(33)))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req("empty", []))
    assert e.value.param == "prompt"
    r = req("edge", range(32), max_tokens=100)
    s.add_request(r)
    assert r.max_tokens == 1  # prompt == max_model_len: one token, like vLLM
    r2 = req("cap", range(20), max_tokens=100)
    s.add_request(r2)
    assert r2.max_tokens == 12
    r3 = req("none", range(10), max_tokens=None)
    s.add_request(r3)
    assert r3.max_tokens == 22
    with pytest.raises(InvalidRequestError) as e:
        s.add_request(req("cap", [1]))
    assert e.value.param == "request_id"
    small = make_sched(num_pages=3, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="pages"):
        small.add_request(req("huge", range(12)))  # 3 pages > 2 usable
    with pytest.raises(ValueError, match="chunked"):
        make_sched(chunked=False, budget=16, max_model_len=64)


def test_requests_at_max_model_len_never_exceed_it():
    s = make_sched(max_model_len=24, budget=8)
    reqs = [req("a", range(24), max_tokens=50), req("b", range(10), max_tokens=50),
            req("c", range(23), max_tokens=None)]
    out, _ = run_all(s, reqs)
    assert [len(out[k]) for k in "abc"] == [1, 14, 1]


# -- budget, chunking, ordering ---------------------------------------------------------------
def test_chunked_prefill_respects_budget():
    s = make_sched(budget=32, block_size=4)
    r = req("long", range(100), max_tokens=2)
    s.add_request(r)
    chunks = []
    while not r.is_finished:
        out = s.schedule()
        check_step(s, out)
        (sr,) = out.scheduled
        chunks.append((sr.start_pos, sr.num_new_tokens, sr.sample))
        got = s.update_after_dispatch(out, {"long": 5} if sr.sample else {})
        if got and r.num_output_tokens >= r.max_tokens:
            s.finish_request("long", RequestStatus.FINISHED_LENGTH)
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True), (100, 1, True)]
    assert r.output_token_ids == [5, 5]


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    s = make_sched(budget=16, max_seqs=8)
    a = req("a", range(10), max_tokens=50, arrival=0)
    s.add_request(a)
    out = s.schedule()
    s.update_after_dispatch(out, {"a": 1})
    b = req("b", range(100, 140), max_tokens=5, arrival=1)
    c = req("c", range(200, 203), max_tokens=5, arrival=2)
    s.add_request(b)
    s.add_request(c)
    out = s.schedule()
    check_step(s, out)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]
    s.update_after_dispatch(out, {"a": 2})
    out = s.schedule()
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 15)]


def test_chunked_prefill_disabled_schedules_whole_prompts():
    s = make_sched(budget=64, chunked=False, max_model_len=64)
    s.add_request(req("a", range(40), arrival=0))
    s.add_request(req("b", range(40), arrival=1))
    out = s.schedule()
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 40)]


def test_max_num_seqs():
    s = make_sched(max_seqs=3, budget=256)
    reqs = [req(f"r{i}", range(5), arrival=i) for i in range(7)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == ["r0", "r1", "r2"]
    assert s.num_running == 3 and s.num_waiting == 4


def test_priority_then_arrival_order():
    s = make_sched(max_seqs=1)
    specs = [("low-early", 5, 0.0), ("high-late", -1, 3.0), ("mid", 0, 1.0), ("mid-late", 0, 2.0),
             ("high", -1, 4.0)]
    reqs = [req(n, range(6), max_tokens=3, priority=p, arrival=t) for n, p, t in specs]
    order = []
    dev = FakeDevice(s)
    for r in reqs:
        s.add_request(r)
    while s.has_unfinished():
        out = s.schedule()
        for x in out.scheduled:
            if not order or order[-1] != x.request_id:
                order.append(x.request_id)
        for r in s.update_after_dispatch(out, dev.step(out)):
            if r.num_output_tokens >= r.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)
    assert order == ["high-late", "high", "mid", "mid-late", "low-early"]
    assert all(r.finish_reason == "stop" for r in reqs)


def test_prefix_cache_hit_at_first_schedule():
    s = make_sched(block_size=4)
    system = list(range(500, 520))
    a = req("a", system + [1, 2], max_tokens=2, arrival=0)
    out, _ = run_all(s, [a])
    b = req("b", system + [3], max_tokens=2, arrival=1)
    s.add_request(b)
    o = s.schedule()
    (sb,) = o.scheduled
    assert b.num_cached_tokens == 20 and sb.start_pos == 20 and sb.num_new_tokens == 1
    assert s.block_manager.hit_rate > 0


def test_prefix_caching_on_off_same_outputs():
    on, _ = run_all(make_sched(prefix=True), workload(seed=1))
    off, _ = run_all(make_sched(prefix=False), workload(seed=1))
    assert on == off
    s = make_sched(prefix=True, max_seqs=2)
    run_all(s, workload(seed=1))
    assert s.block_manager.prefix_cache_hits > 0


def test_n_siblings_share_the_parents_prompt_pages():
    s = make_sched(block_size=4, budget=64, max_seqs=8)
    prompt = list(range(300, 322))  # 22 tokens: 5 full pages
    parent = req("p", prompt, max_tokens=4, arrival=0)
    kids = [Request(f"p-{k}", prompt, Params(4), arrival_time=0, prefix_parent="p")
            for k in range(1, 4)]
    dev = FakeDevice(s)
    for r in [parent] + kids:
        s.add_request(r)
    first = s.schedule()
    assert [x.request_id for x in first.scheduled] == ["p"]  # siblings wait for the prompt
    s.update_after_dispatch(first, dev.step(first))
    second = s.schedule()
    assert {x.request_id for x in second.scheduled} == {"p", "p-1", "p-2", "p-3"}
    for k in kids:
        assert k.num_cached_tokens == 20 and k.block_ids[:5] == parent.block_ids[:5]
    assert [s.block_manager.ref_counts[p] for p in parent.block_ids[:5]] == [4] * 5
    s.update_after_dispatch(second, dev.step(second))
    while s.has_unfinished():
        out = s.schedule()
        for r in s.update_after_dispatch(out, dev.step(out)):
            if r.num_output_tokens >= r.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    # the fake sampler is deterministic, so all siblings generate the same tokens
    assert all(k.output_token_ids == parent.output_token_ids for k in kids)
    assert s.block_manager.num_free_pages == s.block_manager.num_pages - 1


def test_sibling_of_an_aborted_or_unknown_parent_is_not_blocked():
    s = make_sched()
    ghost = req("ghost", range(8))  # never added
    kid = Request("kid", list(range(8)), Params(2), prefix_parent=ghost.request_id)
    s.add_request(kid)
    assert [x.request_id for x in s.schedule().scheduled] == ["kid"]


def test_prompt_logprobs_requests_skip_prefix_cache_reads():
    s = make_sched(block_size=4)
    run_all(s, [req("a", range(20), max_tokens=1)])
    b = Request("b", list(range(20)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    s.add_request(b)
    (x,) = s.schedule().scheduled
    assert x.start_pos == 0 and x.num_new_tokens == 20 and b.num_cached_tokens == 0


def test_stats_and_reset_prefix_cache():
    s = make_sched()
    run_all(s, workload(n=6, seed=4))
    st_ = s.stats()
    assert st_["num_requests_running"] == 0 and st_["kv_cache_usage_perc"] == 0.0
    assert st_["prefix_cache_queries"] > 0
    assert s.reset_prefix_cache() and s.block_manager.num_cached_pages == 0


# -- preemption -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_tiny_pool_completes_with_same_outputs(mode):
    ref, _ = run_all(make_sched(num_pages=256, max_seqs=16), workload(n=16, seed=2))
    s = make_sched(num_pages=16, block_size=4, max_seqs=16, budget=32, mode=mode)
    reqs = workload(n=16, seed=2)
    out, _ = run_all(s, reqs)
    assert s.num_preemptions_total > 0
    if mode == "swap":
        assert s.num_swap_outs_total > 0
    assert out == ref
    for r in reqs:
        assert len(r.output_token_ids) == r.max_tokens
        assert r.finish_reason == "length"


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    # 1 page of host swap space: most preemptions must recompute
    page_bytes = 1 << 30
    s = make_sched(num_pages=16, block_size=4, max_seqs=16, budget=32, mode="swap",
                   swap_space=1.0, page_bytes=page_bytes)
    assert s.swap_capacity_pages == 1
    ref, _ = run_all(make_sched(num_pages=256, max_seqs=16), workload(n=16, seed=3))
    out, _ = run_all(s, workload(n=16, seed=3))
    assert out == ref
    assert s.num_preemptions_total > s.num_swap_outs_total


def test_swap_output_lists_pages_then_swaps_back_in():
    s = make_sched(num_pages=7, block_size=4, budget=64, max_seqs=4, mode="swap")  # 6 usable
    a = req("a", range(8), max_tokens=12, arrival=0)  # 19 tokens = 5 pages each, 10 > 6
    b = req("b", range(100, 108), max_tokens=12, arrival=1)
    dev = FakeDevice(s)
    s.add_request(a)
    s.add_request(b)
    swap_outs, swap_ins = [], []
    while s.has_unfinished():
        out = s.schedule()
        check_step(s, out)
        swap_outs += out.swap_out
        swap_ins += out.swap_in
        for r in s.update_after_dispatch(out, dev.step(out)):
            if r.num_output_tokens >= r.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    assert swap_outs and swap_outs[0][0] == "b"  # the later request is the victim
    assert [x[0] for x in swap_ins] == [x[0] for x in swap_outs]
    assert all(len(o[1][0]) == len(i[1][0]) for o, i in zip(swap_outs, swap_ins))
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert len(a.output_token_ids) == len(b.output_token_ids) == 12


def test_request_that_cannot_fit_alone_is_aborted_not_spun():
    # 4 usable pages of 4 tokens = 16 tokens; "big" needs 30
    s = make_sched(num_pages=5, block_size=4, budget=16, max_model_len=64)
    big = req("big", range(10), max_tokens=20, arrival=0)
    small = req("small", range(50, 53), max_tokens=4, arrival=1)
    out, steps = run_all(s, [big, small])
    assert big.status == RequestStatus.FINISHED_ABORTED and big.finish_reason == "abort"
    assert big.abort_reason == ABORT_KV_CACHE_EXHAUSTED
    assert 0 < len(out["big"]) < 20
    assert len(out["small"]) == 4 and small.finish_reason == "length"


# -- aborts -----------------------------------------------------------------------------------
def test_abort_mid_prefill_and_mid_decode_frees_pages():
    s = make_sched(budget=8, num_pages=32)
    a = req("a", range(40), max_tokens=10, arrival=0)  # long prefill
    b = req("b", range(3), max_tokens=10, arrival=1)
    dev = FakeDevice(s)
    s.add_request(a)
    s.add_request(b)
    for _ in range(2):
        out = s.schedule()
        s.update_after_dispatch(out, dev.step(out))
    assert 0 < a.num_computed_tokens < 40 and a.block_ids
    s.abort_request("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert s.get_request("a") is None
    for _ in range(4):
        out = s.schedule()
        assert "a" in out.finished_req_ids or _ > 0
        s.update_after_dispatch(out, dev.step(out))
    assert b.num_output_tokens > 0 and b.block_ids
    s.abort_request(["b", "unknown"])
    assert not s.has_unfinished()
    bm = s.block_manager
    assert bm.num_free_pages == bm.num_pages - 1 and all(rc == 0 for rc in bm.ref_counts)


def test_abort_while_step_in_flight_is_ignored_by_update():
    s = make_sched()
    r = req("a", range(5))
    s.add_request(r)
    out = s.schedule()
    s.abort_request("a")
    assert s.update_after_dispatch(out, {"a": 3}) == []
    assert r.output_token_ids == [] and r.block_ids == []


def test_abort_swapped_request_releases_host_space():
    s = make_sched(num_pages=7, block_size=4, budget=64, mode="swap")
    a = req("a", range(8), max_tokens=20, arrival=0)
    b = req("b", range(100, 108), max_tokens=20, arrival=1)
    dev = FakeDevice(s)
    s.add_request(a)
    s.add_request(b)
    while b.status != RequestStatus.SWAPPED:
        out = s.schedule()
        s.update_after_dispatch(out, dev.step(out))
    assert s.num_swapped == 1
    s.abort_request("b")
    assert s.num_swapped == 0 and s.swap_used_pages == 0
    out = s.schedule()
    assert "b" in out.finished_req_ids


def test_scheduler_aborts_with_random_client_aborts():
    reqs = workload(n=14, seed=5)
    s = make_sched(num_pages=14, budget=16, max_seqs=6)
    out, _ = run_all(s, reqs, abort_at={3: ["r1", "r2"], 9: ["r5"], 20: ["r13"]})
    for rid in ("r1", "r2", "r5"):
        assert s.get_request(rid) is None
        assert next(r for r in reqs if r.request_id == rid).finish_reason == "abort"


# -- property-based ---------------------------------------------------------------------------
@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 64))
    num_pages = draw(st.integers(2, 40))
    budget = draw(st.integers(1, 48))
    chunked = draw(st.booleans()) if budget >= max_model_len else True
    cfg = dict(block_size=block_size, max_model_len=max_model_len, num_pages=num_pages,
               budget=budget, max_seqs=draw(st.integers(1, 8)), chunked=chunked,
               mode=draw(st.sampled_from(["recompute", "swap"])), prefix=draw(st.booleans()),
               page_bytes=draw(st.sampled_from([None, 1 << 30, 1 << 32])))
    prefixes = [draw(st.lists(st.integers(0, 9), min_size=0, max_size=16)) for _ in range(2)]
    n = draw(st.integers(1, 10))
    reqs = []
    for i in range(n):
        pre = prefixes[draw(st.integers(0, 1))]
        tail = draw(st.lists(st.integers(0, 9), min_size=1, max_size=24))
        reqs.append(dict(rid=f"r{i}", prompt=(pre + tail)[:max_model_len],
                         max_tokens=draw(st.integers(1, 12)), priority=draw(st.integers(0, 2)),
                         arrival=float(draw(st.integers(0, 5))), at_step=draw(st.integers(0, 12)),
                         parent=draw(st.one_of(st.none(), st.integers(0, max(0, i - 1)))) if i else None,
                         salt=draw(st.sampled_from([None, None, "s"]))))
    aborts = draw(st.dictionaries(st.integers(0, 30), st.lists(st.sampled_from(
        [f"r{i}" for i in range(n)]), max_size=2), max_size=3))
    return cfg, reqs, aborts


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants(w):
    cfg, specs, aborts = w
    s = make_sched(**cfg)
    accepted, by_id = [], {}
    dev = FakeDevice(s)
    steps = 0
    pending = sorted(specs, key=lambda sp: sp["at_step"])
    while pending or s.has_unfinished():
        while pending and pending[0]["at_step"] <= steps:
            sp = pending.pop(0)
            r = Request(sp["rid"], sp["prompt"], Params(sp["max_tokens"]), arrival_time=sp["arrival"],
                        priority=sp["priority"], cache_salt=sp["salt"],
                        prefix_parent=getattr(by_id.get(f"r{sp['parent']}"), "request_id", None)
                        if sp["parent"] is not None else None)
            by_id[r.request_id] = r
            try:
                s.add_request(r)
                accepted.append(r)
            except InvalidRequestError as e:
                assert e.param == "prompt"  # only "too big for the pool" can fail here
        for rid in aborts.get(steps, []):
            s.abort_request(rid)
        out = s.schedule()
        check_step(s, out)
        assert out.scheduled or out.finished_outputs or not s.has_unfinished(), "idle step"
        for r in s.update_after_dispatch(out, dev.step(out)):
            if r.num_output_tokens >= r.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        steps += 1
        assert steps < 3000, "did not terminate"
    bm = s.block_manager
    assert bm.num_free_pages == bm.num_pages - 1 and all(rc == 0 for rc in bm.ref_counts)
    bm.check_invariants([])
    for r in accepted:
        assert r.is_finished
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
            assert r.num_prompt_tokens + r.num_output_tokens <= max(cfg["max_model_len"], r.num_prompt_tokens + 1)
        else:
            assert r.status == RequestStatus.FINISHED_ABORTED
            client_abort = any(r.request_id in v for v in aborts.values())
            assert client_abort or r.abort_reason == ABORT_KV_CACHE_EXHAUSTED
            if r.abort_reason == ABORT_KV_CACHE_EXHAUSTED:  # really could not fit the pool
                assert -(-r.num_tokens // cfg["block_size"]) > cfg["num_pages"] - 1


def test_token_limit_caps_each_step_until_lifted():
    s = make_sched(budget=64)
    s.add_request(req("a", range(40)))
    s.limit_tokens(8)  # what warm-up sets while bigger buckets compile
    out = s.schedule()
    assert out.num_batched_tokens == 8
    s.update_after_dispatch(out)
    s.limit_tokens(None)
    assert s.schedule().num_batched_tokens == 32


def test_check_stop_on_ids():
    from jaxserve.core.sampling_params import SamplingParams

    cc, sc = CacheConfig(block_size=4), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(sc, cc, BlockManager(64, 4), 256, eos_token_ids=[2])
    cases = {  # request -> (params, tokens it samples, how it ends)
        "eos": (SamplingParams(max_tokens=9), [5, 2], ("finished_stopped", None)),
        # EOS counts once min_tokens are out: the second EOS stops it
        "min": (SamplingParams(max_tokens=9, min_tokens=2), [2, 2], ("finished_stopped", None)),
        "ign": (SamplingParams(max_tokens=3, ignore_eos=True), [2, 2, 2], ("finished_length", None)),
        "ids": (SamplingParams(max_tokens=9, stop_token_ids=[7]), [5, 7], ("finished_stopped", 7)),
    }
    reqs = {rid: Request(rid, [1, 3], p) for rid, (p, _, _) in cases.items()}
    for r in reqs.values():
        s.add_request(r)
    for step in range(3):
        out = s.schedule()
        s.update_after_dispatch(out, {sr.request_id: cases[sr.request_id][1][step]
                                   for sr in out.scheduled})
        for sr in out.scheduled:
            r = sr.request
            stopped = s.check_stop(r, r.output_token_ids[-1])
            assert stopped == (step == len(cases[r.request_id][1]) - 1), (r.request_id, step)
    for rid, r in reqs.items():
        assert (r.status.value, r.stop_reason) == cases[rid][2], rid
        assert r.output_token_ids == cases[rid][1] and not r.block_ids


def test_pipelined_steps_are_micro_batches_of_different_requests():
    """Pipeline parallel (the engine core's batch queue): a request whose token is in flight is not
    scheduled again until it arrives, and a step takes at most ``max_seqs_per_step`` rows, so
    four requests admitted together form two micro-batches that alternate."""
    s = make_sched(max_seqs=4)
    s.skip_pending, s.max_seqs_per_step = True, 2
    for i in range(4):
        s.add_request(req(f"r{i}", [1, 2, 3]))
    first = s.schedule()
    s.update_after_dispatch(first)  # placeholders: the tokens are in flight
    second = s.schedule()
    s.update_after_dispatch(second)
    ids = lambda out: [x.request.request_id for x in out.scheduled]  # noqa: E731
    assert ids(first) == ["r0", "r1"] and ids(second) == ["r2", "r3"]
    assert s.schedule().scheduled == []  # every request waits for its token
    for x in first.scheduled:
        x.request.resolve_pending(7)
    third = s.schedule()
    assert ids(third) == ["r0", "r1"] and all(x.num_new_tokens == 1 for x in third.scheduled)


def test_update_from_output_resolves_stops_and_reports_one_output_per_request():
    """The fetch half of a step, host only: placeholders resolved with the step's ids, logprobs
    kept, stops on ids, one CoreOutput per request that gained ids; a row of a request aborted
    while its step ran, and the token sampled past a stop, are dropped."""
    from types import SimpleNamespace

    from jaxserve.core.sampling_params import SamplingParams

    cc, sc = CacheConfig(block_size=4), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(sc, cc, BlockManager(64, 4), 256, eos_token_ids=[2])
    a = Request("a", [1, 3], SamplingParams(max_tokens=9, logprobs=0))
    b = Request("b", [1, 3, 4], SamplingParams(max_tokens=9))
    c = Request("c", [5], SamplingParams(max_tokens=9))
    for r in (a, b, c):
        s.add_request(r)

    def fetched(ids):
        return SimpleNamespace(token_ids=np.array(ids), logprobs=-np.arange(1.0, len(ids) + 1),
                               ranks=np.ones(len(ids), int), topk_ids=None, prompt_logprobs=None)

    first = s.schedule()
    s.update_after_dispatch(first)  # three placeholders in flight
    second = s.schedule()  # async: the next decode of each is scheduled before the read
    s.update_after_dispatch(second)
    assert [r.output_token_ids for r in (a, b, c)] == [[-1, -1]] * 3
    s.abort_request("c")
    outs = s.update_from_output(first, fetched([7, 2, 9]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [7], None), ("b", [2], "stop")]  # b hit EOS; c was aborted: no output
    assert [(t.token_id, t.logprob, t.rank) for t in outs[0].new_logprobs] == [(7, -1.0, 1)]
    assert b.output_token_ids == [2] and b.is_finished  # its next token (in flight) dropped
    assert a.metrics.first_token_time is not None and s.generation_tokens_total == 2
    outs = s.update_from_output(second, fetched([8, 4, 6]))
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [8])]
    assert a.output_token_ids == [7, 8] and s.generation_tokens_total == 3


def _with_images(r, *runs):
    """``r`` with image placeholder runs ``(offset, num_tokens)``."""
    from jaxserve.core.mm_inputs import ImageItem, MultiModalInputs

    r.mm = MultiModalInputs([ImageItem(f"h{o}", o, n, (1, 1, n), b"", 1) for o, n in runs], 7)
    return r


def test_whole_image_runs_never_end_a_chunk_inside_an_image():
    """Bidirectional image tokens (Gemma 4 "vision"): a chunk stops before a run it cannot
    finish, the run then waits for a step that holds it whole (nobody is admitted meanwhile),
    and a run over the budget is refused at admission naming the image."""
    s = make_sched(budget=32, block_size=4)
    s.whole_image_runs = True
    with pytest.raises(InvalidRequestError, match="max-num-batched-tokens") as e:
        s.add_request(_with_images(req("big", range(60)), (3, 20), (25, 33)))
    assert e.value.param == "multi_modal_data.image[1]"
    c = req("c", range(200, 204), max_tokens=3, arrival=0)
    a = _with_images(req("a", range(100, 150), max_tokens=2, arrival=1), (4, 32))
    b = req("b", range(300, 308), max_tokens=2, arrival=2)
    s.add_request(c)
    s.add_request(a)
    chunks = []
    while not all(r.is_finished for r in (a, b, c)):
        if len(chunks) == 1:
            s.add_request(b)
        out = s.schedule()
        check_step(s, out)
        chunks.append([(sr.request_id, sr.start_pos, sr.num_new_tokens) for sr in out.scheduled])
        for r in s.update_after_dispatch(out, {sr.request_id: 5 for sr in out.scheduled
                                                if sr.sample}):
            if r.num_output_tokens >= r.max_tokens:
                s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
    # a's first chunk stops at the run; while c decodes the run (32) does not fit and waits,
    # and b is not admitted into the budget it needs; then the run goes whole
    assert chunks[:4] == [[("c", 0, 4), ("a", 0, 4)], [("c", 4, 1)], [("c", 5, 1)],
                          [("a", 4, 32)]]
    assert ("b", 0, 8) in chunks[4]

"""Pages that fall out of every layer's sliding window are freed (vLLM's hybrid allocator idea).

Host side: a fake device keeps token ids in the KV pages and checks, every step, that each
row reads the right token at every position its window covers (through the block table), and
"samples" a function of that window only; so a page released too early, a wrong prefix hit or a
bad swap changes the outputs, which must equal an unfreed reference run. Engine side: a tiny
random Mistral (window 16) generates past its window with freeing on and off, equal to HF, while
its page count stays bounded; aborts leave nothing held; a Gemma 2 (global layers) frees nothing.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.core.block_manager import NULL_PAGE, BlockManager, cdiv
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.step_plan import token_ladder
from jaxserve.testing.reference_plan import build_step_plan, to_rows

VOCAB = 1000


@dataclass
class Params:
    max_tokens: int | None = 16


def make_sched(window, num_pages=64, block_size=4, budget=64, max_seqs=8, max_model_len=128,
               mode="recompute", prefix=True):
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix)
    sc = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                         preemption_mode=mode)
    bm = BlockManager(num_pages, block_size, enable_prefix_caching=prefix, sliding_window=window)
    return Scheduler(sc, cc, bm, max_model_len)


def live_pages(r: Request) -> int:
    return sum(p != NULL_PAGE for p in r.block_ids)


class WindowDevice:
    """KV pages of token ids; a query at q reads positions > q - window (all without one)."""

    def __init__(self, sched: Scheduler, window: int):
        self.s, self.w = sched, window
        bs = sched.block_size
        self.kv = np.full(sched.block_manager.num_pages * bs, -1, dtype=np.int64)
        self.host: dict[str, np.ndarray] = {}
        self.ladder = token_ladder(sched.config.max_num_batched_tokens, 4)

    def step(self, out) -> dict[str, int]:
        bs = self.s.block_size
        for rid in out.finished_req_ids:
            self.host.pop(rid, None)
        for rid, (pages,) in out.swap_out:
            assert NULL_PAGE not in pages
            self.host[rid] = np.stack([self.kv[p * bs:(p + 1) * bs] for p in pages])
        for rid, (pages,) in out.swap_in:
            data = self.host.pop(rid)
            assert len(data) == len(pages) and NULL_PAGE not in pages
            for p, d in zip(pages, data):
                self.kv[p * bs:(p + 1) * bs] = d
        if out.is_empty:
            return {}
        plan = build_step_plan(to_rows(out), block_size=bs,
                               max_pages_per_seq=self.s.max_pages_per_seq, ladder=self.ladder,
                               max_num_seqs=self.s.max_num_seqs)
        n = plan.num_tokens
        assert np.all(plan.slot_mapping[0, :n] // bs != NULL_PAGE), "a new token written to null"
        self.kv[plan.slot_mapping[0, :n]] = plan.token_ids[:n]
        sampled = {}
        for i, s in enumerate(out.scheduled):
            L = int(plan.seq_lens[i])
            pos = np.arange(max(0, s.start_pos - self.w + 1), L)  # what this step's queries read
            ctx = self.kv[plan.block_tables[0, i, pos // bs] * bs + pos % bs]
            expect = np.asarray(s.request.all_token_ids[:L])[pos]
            assert np.array_equal(ctx, expect), f"{s.request_id}: windowed KV context corrupted"
            if s.sample:
                last = ctx[pos > L - 1 - self.w]  # the last query's window
                sampled[s.request_id] = int((last * np.arange(1, len(last) + 1)).sum() % VOCAB)
        return sampled


def run(sched, window, specs, aborts=None, on_step=None, max_steps=4000):
    """Drive requests to max_tokens. specs: (rid, prompt, max_tokens, at_step). Returns outputs
    and finish statuses by id. The device (its pages) lives as long as the scheduler."""
    if not hasattr(sched, "device"):
        sched.device = WindowDevice(sched, window)
    dev = sched.device
    reqs, pending, steps = {}, sorted(specs, key=lambda sp: sp[3]), 0
    while pending or sched.has_unfinished():
        while pending and pending[0][3] <= steps:
            rid, prompt, mt, _ = pending.pop(0)
            reqs[rid] = Request(rid, prompt, Params(mt), arrival_time=float(len(reqs)))
            sched.add_request(reqs[rid])
        for rid in (aborts or {}).get(steps, []):
            sched.abort_request(rid)
        out = sched.schedule()
        live = list(sched.requests.values())
        sched.block_manager.check_invariants(live)
        for r in sched.waiting:
            assert r.block_ids == []
        for r in live:  # a cached page in a request's table is exactly its own prefix's page
            for i, p in enumerate(r.block_ids):
                if p != NULL_PAGE and sched.block_manager.page_hash[p] is not None:
                    assert r.block_hashes[i] == sched.block_manager.page_hash[p]
        for r in sched.update_after_dispatch(out, dev.step(out)):
            if r.num_output_tokens >= r.max_tokens:
                sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
        if on_step:
            on_step(sched, out)
        steps += 1
        assert steps < max_steps, "did not terminate"
    bm = sched.block_manager
    assert bm.num_used_pages == 0 and all(rc == 0 for rc in bm.ref_counts)
    assert sched.num_swapped == 0 and not dev.host
    return {rid: (r.output_token_ids, r.status) for rid, r in reqs.items()}


def test_decode_past_the_window_holds_window_pages():
    w, bs = 16, 4
    rng = np.random.default_rng(0)
    spec = [("a", rng.integers(0, VOCAB, 40).tolist(), 60, 0)]
    held = []
    freed = make_sched(w, budget=16)
    got = run(freed, w, spec, on_step=lambda s, o: held.append(
        [live_pages(r) for r in s.running]))
    unfreed = make_sched(None, budget=16)
    want = run(unfreed, w, spec)
    assert got == want
    decode = [h[0] for h in held[3:] if h]  # after the 40-token prompt's 3 chunks of 16
    assert max(decode) == cdiv(w, bs) + 1 and min(decode) >= cdiv(w, bs)
    assert len(decode) > 40  # generated well past the window


def test_lookahead_pages_are_counted_and_bounded():
    """A verify step of k drafts reads back to its first query's window: live pages stay within
    ceil((window + k) / block) + 1."""
    w, bs, k = 10, 4, 3
    bm = BlockManager(64, bs, sliding_window=w)
    r = Request("a", list(range(30)), Params(None))
    assert bm.allocate_slots(r, 30)
    r.num_computed_tokens = 30
    for step in range(40):
        r.append_output_token(7)
        assert bm.allocate_slots(r, 1 + k)  # the known token + k drafts
        first = r.num_computed_tokens
        assert len(r.block_ids) * bs >= first + 1 + k
        dead = bm.num_dead_pages(first)
        assert r.block_ids[:dead] == [NULL_PAGE] * dead and NULL_PAGE not in r.block_ids[dead:]
        assert live_pages(r) <= cdiv(w + k, bs) + 1
        r.num_computed_tokens += 1 + step % (k + 1)  # some drafts accepted
        while r.num_tokens < r.num_computed_tokens:
            r.append_output_token(7)
        bm.check_invariants([r])
    bm.free(r)
    assert bm.num_used_pages == 0


def test_released_pages_stay_prefix_cache_hits_until_evicted():
    w, bs = 8, 4
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, 33).tolist()
    s = make_sched(w, num_pages=24, budget=64)
    first = run(s, w, [("a", prompt, 4, 0)])
    bm = s.block_manager
    assert bm.num_cached_pages == 9  # 36 known tokens: every full page, released or not
    b = Request("b", prompt + [5], Params(4))
    hits, n_hit = bm.get_computed_blocks(b)
    assert n_hit == 32
    assert bm.allocate_slots(b, b.num_tokens - n_hit, hits)
    dead = bm.num_dead_pages(n_hit)
    assert dead == 6 and b.block_ids[:dead] == [NULL_PAGE] * dead  # hits out of the window
    assert b.block_ids[dead:dead + 2] == hits[dead:]  # are not taken; the rest are
    bm.free(b)
    # a second run sharing the prefix reads the right tokens through its hits
    again = run(s, w, [("c", prompt, 4, 0)])
    assert again["c"] == first["a"]
    assert bm.prefix_cache_hits > 0
    # evict the pool (other prompts), then the same prefix is computed again, correctly
    run(s, w, [(f"x{i}", rng.integers(0, VOCAB, 40).tolist(), 2, 0) for i in range(4)])
    assert run(s, w, [("d", prompt, 4, 0)])["d"] == first["a"]


def test_swap_out_copies_only_the_pages_inside_the_window():
    w, bs = 8, 4
    rng = np.random.default_rng(2)
    s = make_sched(w, num_pages=12, budget=16, mode="swap")
    swapped = []
    specs = [(f"r{i}", rng.integers(0, VOCAB, 30).tolist(), 30, i) for i in range(3)]
    got = run(s, w, specs, on_step=lambda sc, o: swapped.extend(len(p) for _, (p,) in o.swap_out))
    assert swapped and max(swapped) <= cdiv(w, bs) + 1
    want = run(make_sched(None, num_pages=64, budget=16), w, specs)
    assert got == want


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    cfg = dict(block_size=bs, num_pages=draw(st.integers(6, 40)), budget=draw(st.integers(4, 32)),
               max_seqs=draw(st.integers(1, 6)), mode=draw(st.sampled_from(["recompute", "swap"])),
               prefix=draw(st.booleans()), max_model_len=64)
    window = draw(st.integers(1, 20))
    shared = draw(st.lists(st.integers(0, 9), min_size=0, max_size=24))
    specs = []
    for i in range(draw(st.integers(1, 8))):
        tail = draw(st.lists(st.integers(0, 9), min_size=1, max_size=30))
        prompt = ((shared if draw(st.booleans()) else []) + tail)[:40]
        specs.append((f"r{i}", prompt, draw(st.integers(1, 20)), draw(st.integers(0, 10))))
    aborts = draw(st.dictionaries(st.integers(0, 30), st.lists(
        st.sampled_from([sp[0] for sp in specs]), max_size=2), max_size=3))
    # every prompt fits the pool (add_request refuses one that cannot), with little to spare
    cfg["num_pages"] = max(cfg["num_pages"], max(cdiv(len(sp[1]), bs) for sp in specs) + 1)
    return cfg, window, specs, aborts


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_the_unfreed_reference(w):
    """Preemption (both modes), prefix hits, chunked prefill, client aborts: every windowed read
    is right, outputs equal the run that keeps every page, and nothing stays held."""
    cfg, window, specs, aborts = w
    freed = run(make_sched(window, **cfg), window, specs, aborts)
    ref = run(make_sched(None, **{**cfg, "num_pages": 512}), window, specs, aborts)
    for rid, (toks, status) in freed.items():
        if status == RequestStatus.FINISHED_LENGTH and ref[rid][1] == status:
            assert toks == ref[rid][0], rid


def test_attention_window_needs_every_layer_windowed():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4)
    mistral = ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 16})
    assert mistral.attention_window() == 16
    phi3 = ModelConfig.from_hf_config({**base, "model_type": "phi3", "sliding_window": 2047})
    assert phi3.attention_window() == 2047
    assert ModelConfig.from_hf_config({**base, "model_type": "mistral"}).attention_window() is None
    for mt in ("gemma2", "gemma3_text"):  # default local/global patterns: a global layer
        assert ModelConfig.from_hf_config(
            {**base, "model_type": mt, "sliding_window": 16}).attention_window() is None
    local = ModelConfig.from_hf_config({**base, "model_type": "gemma3_text", "sliding_window": 16,
                                        "layer_types": ["sliding_attention"] * 6})
    assert local.attention_window() == 16


# ---- engine: a tiny random Mistral (window 16) and a Gemma 2 ---------------------------------
torch = pytest.importorskip("torch")
BLOCK = 4
PROMPT = 40  # > the window of 16
NEW = 28


def _llm(path, **kw):
    from jaxserve import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 16)  # one token bucket: one compile
    kw.setdefault("min_token_bucket", 16)
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_gpu_blocks_override", 80)
    return LLM(str(path), **kw)


def _generate(llm, prompts, max_tokens=NEW):
    """Greedy, step by step; returns (token lists, the most live pages any request held while
    its context was past the window)."""
    from jaxserve import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, sp)
    outs, most = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        for r in eng.scheduler.running:
            if r.num_computed_tokens > PROMPT:
                most = max(most, live_pages(r))
        eng.block_manager.check_invariants(list(eng.scheduler.requests.values()))
    assert eng.block_manager.num_used_pages == 0
    return [outs[str(i)] for i in range(len(prompts))], most


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("mistral", layers=2)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rng = random.Random(3)
    passage = [rng.randrange(3, 500) for _ in range(10)]
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)],
               (passage * 5)[:PROMPT]]  # repeats: n-gram drafts find matches
    refs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                            do_sample=False, min_new_tokens=NEW, pad_token_id=0)
            refs.append(g[0, PROMPT:].tolist())
    return path, prompts, refs


def test_mistral_frees_window_pages_with_hf_greedy_tokens(mistral):
    path, prompts, refs = mistral
    freed = _llm(path)
    assert freed.llm_engine.block_manager.sliding_window == 16
    got, most = _generate(freed, prompts)
    assert got == refs
    assert most <= cdiv(16, BLOCK) + 1
    unfreed = _llm(path, disable_hybrid_kv_cache_manager=True)
    assert unfreed.llm_engine.block_manager.sliding_window is None
    got_ref, most_ref = _generate(unfreed, prompts)
    assert got_ref == got
    assert most_ref == cdiv(PROMPT + NEW - 1, BLOCK)  # every page kept


def test_mistral_speculation_and_aborts_with_freed_pages(mistral):
    """n-gram drafts (lookahead slots) past the window: greedy tokens unchanged; a burst with
    aborts mid-prefill and mid-decode leaves no page held."""
    from jaxserve import SamplingParams

    path, prompts, refs = mistral
    llm = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 2},
               num_gpu_blocks_override=30)
    eng = llm.llm_engine
    got, most = _generate(llm, prompts)
    assert got == refs and eng.spec_stats.num_drafts > 0
    assert most <= cdiv(16 + 3, BLOCK) + 1
    rng = random.Random(4)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(8):  # more than the pool holds at once: some wait for pages
        eng.add_request(f"b{i}", [rng.randrange(3, 500) for _ in range(rng.randint(20, 45))], sp)
    step = 0
    while eng.has_unfinished_requests():
        eng.step()
        step += 1
        if step in (2, 9, 15):
            eng.abort_request([f"b{step % 8}", f"b{(step + 3) % 8}"])
        eng.block_manager.check_invariants(list(eng.scheduler.requests.values()))
    assert eng.block_manager.num_used_pages == 0
    assert all(rc == 0 for rc in eng.block_manager.ref_counts)


def test_gemma2_with_global_layers_frees_nothing(tiny_model_factory):
    llm = _llm(tiny_model_factory("gemma2"))
    assert llm.llm_engine.block_manager.sliding_window is None
    rng = random.Random(5)
    _, most = _generate(llm, [[rng.randrange(3, 500) for _ in range(PROMPT)]], max_tokens=12)
    assert most == cdiv(PROMPT + 12 - 1, BLOCK)


# ---- kernels: dead block-table columns point at the null page --------------------------------
@pytest.mark.slow  # the Pallas kernel in interpret mode: ~30 s on CPU
def test_attention_backends_ignore_null_pages_before_the_window():
    """Each CPU-runnable backend gives the same output whether the columns before every row's
    window hold the row's own (stale) pages or the null page 0 full of garbage: the jnp
    reference and the XLA path read and mask them (weight exactly 0 for finite values, and page
    0 only ever holds padding K/V), the Pallas kernel (interpret mode) starts at the window's
    first page, so not even NaN there reaches its output (the columns past the context, which
    it may read at block granularity, hold stale real pages here so that only the dead columns
    point at page 0)."""
    import jax.numpy as jnp

    from pallas_kernels import reference, xla_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    page, m, d, hkv, group, w = 4, 16, 16, 2, 2, 8
    rows = [(1, 50), (4, 41), (12, 60), (3, 9), (1, 8)]  # (new tokens, context after the step)
    rng = np.random.default_rng(0)
    n_pages = 1 + sum(cdiv(c, page) for _, c in rows)
    kp = rng.standard_normal((hkv, n_pages, page, d)).astype(np.float32)
    vp = rng.standard_normal((hkv, n_pages, page, d)).astype(np.float32)
    t = 32
    q = jnp.asarray(rng.standard_normal((t, hkv * group, d)), jnp.float32)
    s = 8
    qs = np.zeros(s + 1, np.int32)
    qs[1:len(rows) + 1] = np.cumsum([r[0] for r in rows])
    qs[len(rows) + 1:] = qs[len(rows)]
    sl = np.zeros(s, np.int32)
    sl[:len(rows)] = [c for _, c in rows]
    own = np.zeros((s, m), np.int32)
    free = list(rng.permutation(np.arange(1, n_pages)))
    null = own.copy()
    n_dead = 0
    for i, (ql, c) in enumerate(rows):
        own[i, :cdiv(c, page)] = [free.pop() for _ in range(cdiv(c, page))]
        own[i, cdiv(c, page):] = rng.integers(1, n_pages, m - cdiv(c, page))  # stale tail
        dead = max(0, c - ql - w + 1) // page
        null[i] = own[i]
        null[i, :dead] = NULL_PAGE
        n_dead += dead
    assert n_dead >= 20
    args = lambda bt, k, v: (q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(qs),  # noqa: E731
                             jnp.asarray(sl), jnp.asarray(bt))
    kw = dict(sm_scale=d ** -0.5, sliding_window=w)
    garbage_k, garbage_v = kp.copy(), vp.copy()
    garbage_k[:, NULL_PAGE] = 1e4  # huge scores if they were ever unmasked
    garbage_v[:, NULL_PAGE] = -1e4
    backends = {
        "reference": lambda *a: reference.ragged_paged_attention(*a, **kw),
        "xla": lambda *a: xla_attention.attention(*a, **kw),
        "pallas": lambda *a: ragged_paged_attention(*a, interpret=True, prefill_block_m=16,
                                                    prefill_block_kv=16, decode_block_kv=16,
                                                    decode_num_splits=3,
                                                    decode_min_kv_per_split=16, **kw),
    }
    want = np.asarray(backends["reference"](*args(own, kp, vp)))
    for name, fn in backends.items():
        got = np.asarray(fn(*args(null, garbage_k, garbage_v)))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)
    nan_k, nan_v = kp.copy(), vp.copy()
    nan_k[:, NULL_PAGE] = np.nan
    nan_v[:, NULL_PAGE] = np.nan
    got = np.asarray(backends["pallas"](*args(null, nan_k, nan_v)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg="pallas with NaN")

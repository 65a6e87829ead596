"""The prefix cache's host tier end to end (--kv-offloading-size) on tiny random models: greedy
multi-turn outputs with the tier equal those without it under a pool that forces eviction and
preemption (recompute and swap), later turns load their evicted histories from host memory,
and aborts leave no page or pending copy behind."""
from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("torch")

from jaxserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GIB = 0.004  # ~4 MiB of host blocks: every history of these tests fits


def _llm(model_dir, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("min_token_bucket", 16)
    return LLM(str(model_dir), **kw)


def _turns(llm, n_conv=4, turns=3, seed=0, first=40, grow=12):
    """Conversations with growing histories (the previous answer and a new user turn); the
    outputs and cached-token counts per turn."""
    rng = random.Random(seed)
    hist = [[rng.randrange(3, 500) for _ in range(first)] for _ in range(n_conv)]
    outs, cached = [], []
    for _ in range(turns):
        res = llm.generate(hist, GREEDY, use_tqdm=False)
        outs.append([list(r.outputs[0].token_ids) for r in res])
        cached.append([r.num_cached_tokens for r in res])
        hist = [h + o + [rng.randrange(3, 500) for _ in range(grow)]
                for h, o in zip(hist, outs[-1])]
    return outs, cached


def _no_leaks(llm):
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_used_pages == 0
    eng.block_manager.check_invariants([])
    tier = eng.scheduler.kv_offload
    if tier is not None:  # every host slot free or holding one block; no copy in flight
        tier.check_invariants()
        eng.host_kv.flush(wait=True)
        assert not eng.host_kv._pending


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llama_ref(llama_dir):
    return _turns(_llm(llama_dir, num_gpu_blocks_override=12))[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_llama_outputs_equal_and_later_turns_hit_host(llama_dir, llama_ref, mode):
    llm = _llm(llama_dir, num_gpu_blocks_override=12, preemption_mode=mode,
               kv_offloading_size=GIB)
    outs, cached = _turns(llm)
    assert outs == llama_ref
    eng = llm.llm_engine
    s = eng.stats()
    from jaxserve.entrypoints.openai.metrics import ServerMetrics
    text = ServerMetrics(eng.stats, "m", prefix="vllm").render().decode()
    assert (f'vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} '
            f'{float(s["external_prefix_cache_hits"])}') in text
    assert "vllm:external_prefix_cache_queries_total" in text
    assert "vllm:kv_offload_usage_perc" in text
    assert eng.scheduler.num_preemptions_total > 0  # the pool forces preemption
    assert s["external_prefix_cache_hits"] > 0
    assert eng.host_kv.num_loaded == s["external_prefix_cache_hits"] // 16
    # every later turn finds at least its first turn's 2 full pages (device or host)
    assert all(c >= 32 for t in cached[1:] for c in t)
    _no_leaks(llm)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])  # fp8 pages are stored as bytes
def test_second_turn_after_eviction_loads_its_history_from_host(llama_dir, kv_dtype):
    rng = random.Random(3)
    a = [rng.randrange(3, 500) for _ in range(80)]  # 5 full pages
    others = [[rng.randrange(3, 500) for _ in range(90)] for _ in range(3)]
    results = {}
    for size in (None, GIB):
        llm = _llm(llama_dir, num_gpu_blocks_override=10, kv_offloading_size=size,
                   kv_cache_dtype=kv_dtype)
        first = llm.generate([a], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.generate(others, GREEDY, use_tqdm=False)  # evicts a's pages from the device
        second = llm.generate([a + list(first) + [7, 8]], GREEDY, use_tqdm=False)[0]
        results[size] = (list(first), list(second.outputs[0].token_ids))
        if size is not None:
            s = llm.llm_engine.stats()
            assert second.num_cached_tokens == 80 and s["external_prefix_cache_hits"] == 80
        else:
            assert second.num_cached_tokens == 0
        _no_leaks(llm)
    assert results[None] == results[GIB]


def test_aborts_leave_no_pages_or_copies(llama_dir):
    llm = _llm(llama_dir, num_gpu_blocks_override=12, kv_offloading_size=GIB)
    eng = llm.llm_engine
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(50)] for _ in range(4)]
    llm.generate(prompts, GREEDY, use_tqdm=False)  # cached on host
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p + [9], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.block_manager.num_used_pages > 0 and eng.host_kv.num_loaded > 0
    eng.abort_request([f"r{i}" for i in range(4)])
    eng.step()
    _no_leaks(llm)
    assert eng.scheduler.kv_offload.num_pending == 0 and not eng.host_kv._pending
    assert eng.block_manager.num_free_pages == eng.runner.num_pages - 1


@pytest.mark.slow
def test_gemma4_cache_groups_outputs_equal(tmp_path_factory):
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    path = make_tiny_gemma4(tmp_path_factory.mktemp("g4off") / "gemma4")
    outs = {}
    for size in (None, GIB):
        llm = _llm(path, num_gpu_blocks_override=12, kv_offloading_size=size,
                   max_num_batched_tokens=32, max_model_len=128)
        outs[size], cached = _turns(llm, turns=2, first=36)
        if size is not None:
            assert len(llm.llm_engine.block_manager.managers) > 1  # sliding + full pools
            assert llm.llm_engine.stats()["external_prefix_cache_hits"] > 0
        _no_leaks(llm)
    assert outs[GIB] == outs[None]


@pytest.mark.slow
def test_qwen3_5_state_model_has_no_host_tier_and_same_outputs(tmp_path_factory):
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("q35off") / "q35", moe=False, vl=False,
                             mtp=False)
    outs = {}
    for size in (None, GIB):
        llm = _llm(path, num_gpu_blocks_override=8, kv_offloading_size=size,
                   preemption_mode="swap", max_num_seqs=2, max_num_batched_tokens=32,
                   max_model_len=128)
        outs[size], _ = _turns(llm, n_conv=3, turns=2, first=56, grow=8)
        assert llm.llm_engine.scheduler.num_swap_outs_total > 0
        assert llm.llm_engine.scheduler.kv_offload is None  # no prefix cache: recompute
        _no_leaks(llm)
    assert outs[GIB] == outs[None]


def test_host_tier_events_say_cpu_and_rebuild_its_blocks(llama_dir):
    """A subscriber of the engine's KV events rebuilds the host tier's blocks from the
    medium "CPU" events alone (and the device pool's from the "GPU" ones)."""
    zmq = pytest.importorskip("zmq")
    from jaxserve.core.kv_events import BlockRemoved, BlockStored, block_hash_bytes, decode_batch

    llm = _llm(llama_dir, num_gpu_blocks_override=10, kv_offloading_size=12 * 8192 / 2**30,
               kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": "tcp://127.0.0.1:*", "topic": "kv"})
    eng = llm.llm_engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(eng.kv_event_publisher.endpoint)
    time.sleep(0.5)  # a SUB socket misses what is sent before it has joined
    try:
        _turns(llm, n_conv=4, turns=3)
        host: set[bytes] = set()
        removed = 0
        while sub.poll(1000):
            _, _, payload = sub.recv_multipart()
            for e in decode_batch(payload).events:
                if getattr(e, "medium", None) != "CPU":
                    continue
                if isinstance(e, BlockStored):
                    host.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    host.difference_update(e.block_hashes)
                    removed += 1
        tier = eng.scheduler.kv_offload
        assert tier.num_blocks == 12 and removed > 0  # the host tier evicted too
        assert host == {block_hash_bytes(h) for h in tier.pools[0]._slots}
    finally:
        sub.close(0)

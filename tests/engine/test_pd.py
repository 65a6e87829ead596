"""Disaggregated prefill/decode in one process: two engines with ``kv_transfer_config``, the
NIXL protocol through ``SamplingParams.extra_args["kv_transfer_params"]``, both transports
(``jax.experimental.transfer`` and host-staged ZMQ), the held pages' timeout and a pull that
never arrives (counted pages: nothing leaks)."""
from __future__ import annotations

import random
from dataclasses import replace as dataclasses_replace
import time

import numpy as np
import pytest
import zmq

from jaxserve import LLM, SamplingParams
from jaxserve.core.request import Request
from jaxserve.core.kv_transfer import KVTransferConfig, parse_request_params
from jaxserve.errors import InvalidRequestError
from jaxserve.worker import kv_transfer as pages_io

KW = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
          min_token_bucket=8, num_gpu_blocks_override=24, block_size=16)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def kv_config(transport: str, **extra) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 0,
            "kv_connector_extra_config": {"transport": transport, **extra}}


def test_config_as_vllm_writes_it_and_errors_name_the_field():
    c = KVTransferConfig.parse('{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
    assert c.is_producer and c.is_consumer and c.kv_port == 14579
    assert KVTransferConfig.parse({"kv_connector": "JaxTransferConnector",
                                   "kv_role": "kv_consumer"}).is_producer is False
    with pytest.raises(ValueError, match="kv_connector 'LMCacheConnectorV1'"):
        KVTransferConfig.parse({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_role": "both"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['kv_rolee'\]"):
        KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_rolee": "kv_both"})
    with pytest.raises(ValueError, match="kv_connector_extra_config: unknown key"):
        KVTransferConfig.parse(kv_config("auto", timeout=3))
    with pytest.raises(ValueError, match="kv_load_timeout must be a positive"):
        KVTransferConfig.parse(kv_config("auto", kv_load_timeout=0))
    with pytest.raises(ValueError, match="transport must be one of"):
        KVTransferConfig.parse(kv_config("nccl"))


def test_request_params_are_checked():
    assert parse_request_params({"do_remote_decode": True}) == (True, None)
    for bad, match in [([1], "must be an object"), ({"do_remote_decod": True}, "unknown key"),
                       ({"do_remote_prefill": True}, "needs"),
                       ({"do_remote_decode": 1}, "booleans")]:
        with pytest.raises(InvalidRequestError, match=match) as e:
            parse_request_params(bad)
        assert e.value.param == "kv_transfer_params"


@pytest.fixture(scope="module")
def engines(tiny_model_factory):
    d = str(tiny_model_factory("llama"))
    a = LLM(d, kv_transfer_config=kv_config("auto", abort_request_timeout=30), **KW)
    b = LLM(d, kv_transfer_config=kv_config("zmq", kv_load_timeout=2.5), **KW)
    yield a, b
    for llm in (a, b):
        llm.llm_engine.kv_connector.close()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def full_pool(llm) -> bool:
    bm = llm.llm_engine.block_manager
    return bm.num_free_pages == bm.num_usable_pages


def prefill(llm, ids, **params) -> dict:
    out = llm.generate([ids], SamplingParams(
        temperature=0, max_tokens=6, extra_args={"kv_transfer_params": {
            "do_remote_decode": True}}, **params), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1  # prefill only
    return out.kv_transfer_params


def decode(llm, ids, params):
    return llm.generate([ids], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True,
        extra_args={"kv_transfer_params": params}), use_tqdm=False)[0]


def test_both_transports_match_colocated_and_free_the_held_pages(engines):
    a, b = engines
    assert a.llm_engine.kv_connector.transport == "jax"
    assert b.llm_engine.kv_connector.transport == "zmq"
    for i, (src, dst) in enumerate([(a, a), (a, b), (b, a), (b, b)]):
        ids = prompt(i, 20 + 13 * i)  # partial last pages, 2-5 pages
        want = a.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        params = prefill(src, ids)
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(ids)
        assert len(params["remote_block_ids"]) == -(-len(ids) // 16)
        held = src.llm_engine.kv_connector.state.held[params["remote_request_id"]]
        # what the decode pulls: every page but the last token's, bit for bit
        n_pages = -(-(len(ids) - 1) // 16)
        src_pages = [np.asarray(x) for x in pages_io.gather_pages(
            src.llm_engine.runner, [p[:n_pages] for p in held.pages])]
        got = decode(dst, ids, params)
        assert got.outputs[0].token_ids == want
        assert got.num_cached_tokens == len(ids) - 1  # computed remotely, not here
        conn = dst.llm_engine.kv_connector
        assert conn.state.num_loaded_total >= 1
        if dst is not src:  # the pulled full pages, found in the decode's prefix cache
            hits, n_hit = dst.llm_engine.block_manager.get_computed_blocks(
                Request("probe", ids, SamplingParams()))
            assert n_hit == (len(ids) - 1) // 16 * 16 and hits
            dst_pages = [np.asarray(x) for x in pages_io.gather_pages(dst.llm_engine.runner,
                                                                      [hits])]
            for x, y in zip(src_pages, dst_pages):
                np.testing.assert_array_equal(x[:, :len(hits)], y[:, :len(hits)])
        src.llm_engine.core_step()  # the pull is reported: the held pages go back
        assert not src.llm_engine.kv_connector.state.held and full_pool(src) and full_pool(dst)


def test_unpulled_prefill_is_freed_after_its_timeout(engines):
    _, b = engines
    params = prefill(b, prompt(10, 40))
    st = b.llm_engine.kv_connector.state
    assert st.num_held_pages == 3 and not full_pool(b)
    b.llm_engine.core_step()
    assert st.num_held_pages == 3  # not yet
    clock = st.clock
    st.clock = lambda: clock() + 481  # past vLLM's default abort_request_timeout (480 s)
    try:
        b.llm_engine.core_step()
    finally:
        st.clock = clock
    assert st.num_held_pages == 0 and full_pool(b) and st.num_expired_total >= 1
    out = decode(b, prompt(10, 40), params)  # too late: a clear error, nothing leaks
    assert out.outputs[0].finish_reason == "error"
    assert "refused the pull" in out.outputs[0].stop_reason
    assert "already pulled, or expired" in out.outputs[0].stop_reason
    assert full_pool(b)


def test_pull_that_never_arrives_fails_after_the_timeout_and_frees_pages(engines):
    _, b = engines  # kv_load_timeout 2.5 s
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # a producer that never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        ids = prompt(11, 50)
        params = dict(do_remote_prefill=True, remote_block_ids=[1, 2, 3, 4],
                      remote_engine_id="gone", remote_host="127.0.0.1", remote_port=port,
                      remote_request_id="x", remote_num_tokens=len(ids))
        t, wall = time.perf_counter(), time.time()
        out, beside = b.generate([ids, prompt(12, 10)], [SamplingParams(
            temperature=0, max_tokens=6, extra_args={"kv_transfer_params": params}), GREEDY],
            use_tqdm=False)
        took = time.perf_counter() - t
    finally:
        silent.close(0)
    # the waiting decode holds nobody up: the other request ran meanwhile
    assert beside.outputs[0].finish_reason == "length"
    assert beside.metrics.finished_time - wall < 1.0
    assert out.outputs[0].finish_reason == "error"
    assert f"127.0.0.1:{port}" in out.outputs[0].stop_reason
    assert "within 2.5 s" in out.outputs[0].stop_reason
    assert 2.5 <= took < 15
    assert full_pool(b) and not b.llm_engine.kv_connector.state.loading


def test_role_and_protocol_errors(engines):
    a, b = engines
    ids = prompt(13, 20)
    with pytest.raises(InvalidRequestError, match="remote_num_tokens 99 differs") as e:
        decode(a, ids, dict(do_remote_prefill=True, remote_block_ids=[1], remote_engine_id="e",
                            remote_host="h", remote_port=1, remote_request_id="r",
                            remote_num_tokens=99))
    assert e.value.param == "kv_transfer_params"
    with pytest.raises(InvalidRequestError, match="needs n = 1"):
        prefill(a, ids, n=2)
    assert full_pool(a)
    # another prompt of the same length: refused by the producer, which then lets go
    params = prefill(a, ids)
    out = decode(b, prompt(14, 20), params)
    assert out.outputs[0].finish_reason == "error"
    assert "prompt differs from the prefilled one" in out.outputs[0].stop_reason
    a.llm_engine.core_step()
    assert full_pool(a) and full_pool(b)


# ---- the scheduler's side alone (host only) ------------------------------------------------
def _scheduler(policy: str = "fail"):
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.core.block_manager import BlockManager
    from jaxserve.core.kv_transfer import KVTransferState
    from jaxserve.core.scheduler import Scheduler

    bm = BlockManager(17, 4, enable_prefix_caching=True)  # 16 usable pages of 4 tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                  CacheConfig(block_size=4), bm, 64)
    cfg = KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                  "kv_load_failure_policy": policy})
    s.kv_transfer = KVTransferState(cfg, 4, ("10.0.0.1", 5555))
    return s, bm


def _remote(n: int) -> dict:
    return dict(do_remote_prefill=True, remote_block_ids=[1, 2, 3], remote_engine_id="e",
                remote_host="h", remote_port=1, remote_request_id="p", remote_num_tokens=n)


def test_scheduler_parks_a_decode_while_its_kv_is_pulled():
    from jaxserve.core.request import Request, RequestStatus

    s, bm = _scheduler()
    d = Request("d", list(range(3, 13)), SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": _remote(10)}))
    other = Request("o", list(range(20, 26)), SamplingParams(max_tokens=4))
    s.add_request(d)
    s.add_request(other)
    out = s.schedule()
    # d holds pages for its first 9 tokens and waits beside the queue; o runs meanwhile
    assert [r.request.request_id for r in out.scheduled] == ["o"]
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(d.block_ids) == 3
    (load,) = s.kv_transfer.loads_to_start()
    assert load.num_tokens == 9 and load.pages == [d.block_ids]
    assert s.stats()["num_requests_waiting"] == 1
    s.remote_kv_loaded("d")
    out = s.schedule()
    (row,) = [r for r in out.scheduled if r.request.request_id == "d"]
    assert row.start_pos == 9 and row.num_new_tokens == 1 and d.num_cached_tokens == 9


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_scheduler_failed_pull_frees_pages_or_recomputes(policy):
    from jaxserve.core.request import Request, RequestStatus

    s, bm = _scheduler(policy)
    free = bm.num_free_pages
    d = Request("d", list(range(3, 13)), SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": _remote(10)}))
    s.add_request(d)
    s.schedule()
    assert bm.num_free_pages == free - 3
    out = s.remote_kv_failed("d", "kv_transfer_params: gone")
    if policy == "fail":
        assert out.finish_reason == "error" and out.stop_reason == "kv_transfer_params: gone"
        assert d.status == RequestStatus.FINISHED_ERROR and bm.num_free_pages == free
    else:
        assert out is None and bm.num_free_pages == free
        (row,) = s.schedule().scheduled
        assert row.start_pos == 0 and row.num_new_tokens == 10  # the whole prompt, here


def test_scheduler_holds_a_finished_prefill_until_released():
    from jaxserve.core.request import Request, RequestStatus

    s, bm = _scheduler()
    free = bm.num_free_pages
    p = Request("p", list(range(3, 13)), SamplingParams(
        max_tokens=16, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    s.add_request(p)
    assert p.max_tokens == 1  # prefill only
    s.schedule()
    p.num_computed_tokens = 10
    p.append_output_token(7)
    assert s.check_stop(p, 7)
    out = p.take_output()
    assert out.kv_transfer_params["remote_block_ids"] == p.block_ids[:3]
    assert out.kv_transfer_params["remote_host"] == "10.0.0.1"
    assert bm.num_free_pages == free - 3 and s.kv_transfer.num_held_pages == 3
    assert s.kv_transfer.release("p", pulled=True) is p
    bm.free(p)
    assert bm.num_free_pages == free
    # an aborted prefill holds nothing
    q = Request("q", list(range(3, 13)), SamplingParams(
        max_tokens=16, extra_args={"kv_transfer_params": {"do_remote_decode": True}}))
    s.add_request(q)
    s.schedule()
    s.abort_request("q")
    assert q.status == RequestStatus.FINISHED_ABORTED and not s.kv_transfer.held
    assert bm.num_free_pages == free


# ---- cache groups: a pool per group (Gemma 4: sliding-window and full attention) -----------
@pytest.fixture(scope="module")
def gemma4_pair(tmp_path_factory):
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    d = str(make_tiny_gemma4(tmp_path_factory.mktemp("pd_g4") / "gemma4"))  # window 16
    kw = dict(KW, max_num_batched_tokens=32)  # long prompts prefill in chunks
    a = LLM(d, kv_transfer_config=kv_config("auto"), **kw)
    b = LLM(d, kv_transfer_config=kv_config("zmq"), **kw)
    yield a, b
    for llm in (a, b):
        llm.llm_engine.kv_connector.close()


def pools_free(llm) -> bool:
    bm = llm.llm_engine.block_manager
    return all(m.num_free_pages == m.num_usable_pages for m in bm.managers)


def test_cache_groups_pull_every_pool_and_match_colocated(gemma4_pair):
    a, b = gemma4_pair
    managers = a.llm_engine.block_manager.managers
    assert len(managers) > 1 and any(m.sliding_window for m in managers)
    full = next(g for g, m in enumerate(managers) if m.sliding_window is None)
    # 47: the producer's window at its last token has dropped a page the decode's last
    # token still reads; 70: the producer's chunks released pages (0 in its params)
    for i, (n, src, dst) in enumerate([(20, a, b), (47, b, a), (70, a, b), (70, b, b)]):
        ids = prompt(30 + i, n)
        want = a.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        params = prefill(src, ids)
        groups = params["remote_group_block_ids"]
        assert len(groups) == len(managers) and params["remote_block_ids"] == groups[full]
        assert all(len(g) == -(-n // 16) for g in groups)
        if n == 70:
            assert 0 in [b_ for g in groups for b_ in g]  # released out of the window
        got = decode(dst, ids, params)
        assert got.outputs[0].token_ids == want, (n, src is a, dst is a)
        assert got.num_cached_tokens == n - 1
        src.llm_engine.core_step()  # the pull is reported: the held pages go back
        assert not src.llm_engine.kv_connector.state.held
        assert pools_free(a) and pools_free(b)
    # a consumer of several groups needs them all: vLLM's single list is refused clearly
    with pytest.raises(InvalidRequestError, match="remote_group_block_ids"):
        decode(b, ids, {k: v for k, v in params.items() if k != "remote_group_block_ids"})
    assert pools_free(b)


def test_scheduler_takes_only_the_window_pages_of_a_sliding_pool():
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.core.kv_cache_coordinator import make_kv_cache_manager
    from jaxserve.core.kv_transfer import KVTransferState
    from jaxserve.core.request import Request, RequestStatus
    from jaxserve.core.scheduler import Scheduler

    bm = make_kv_cache_manager([("full", 17, None), ("sliding", 17, 8)], block_size=4,
                               num_state_slots=None, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                  CacheConfig(block_size=4), bm, 64)
    cfg = KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    s.kv_transfer = KVTransferState(cfg, 4, ("h", 1), num_rows=2)
    groups = [[1, 2, 3, 4, 5], [0, 6, 7, 8, 9]]
    d = Request("d", list(range(3, 23)), SamplingParams(max_tokens=4, extra_args={
        "kv_transfer_params": dict(_remote(20), remote_block_ids=groups[0],
                                   remote_group_block_ids=groups)}))
    s.add_request(d)
    s.schedule()
    assert d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (load,) = s.kv_transfer.loads_to_start()
    # 19 tokens: 5 pages in the full pool; the sliding pool only the window of the last
    # prompt token (position 19 reads 12..19: pages 3 and 4)
    assert [len(p) for p in load.pages] == [5, 5] and load.pages[1][:3] == [0, 0, 0]
    assert all(load.pages[1][3:]) and bm.managers[1].num_used_pages == 2
    from jaxserve.engine.kv_connector import remote_pages
    assert remote_pages(load.remote, load.pages) == [groups[0], [8, 9]]
    s.remote_kv_loaded("d")
    (row,) = s.schedule().scheduled
    assert row.start_pos == 19 and row.num_new_tokens == 1
    bm.check_invariants([d])
    s.abort_request("d")
    assert bm.managers[0].num_used_pages == 0 and bm.managers[1].num_used_pages == 0
    # a prefix longer than the producer's window kept: a clear error
    short = dataclasses_replace(load.remote, group_block_ids=((1, 2, 3, 4, 5), (0, 0, 0, 0, 9)))
    with pytest.raises(ValueError, match=r"no page at position\(s\) \[3\]"):
        remote_pages(short, load.pages)
    with pytest.raises(InvalidRequestError,
                       match="2 cache groups: the params need remote_group_block_ids"):
        s.add_request(Request("e", list(range(3, 23)), SamplingParams(
            max_tokens=4, extra_args={"kv_transfer_params": _remote(20)})))


# ---- recurrent state (Qwen 3.5: a state slot per request beside the attention pages) -------
def test_recurrent_state_moves_with_the_pages_and_matches_colocated(tmp_path_factory):
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    d = str(make_tiny_qwen3_5(tmp_path_factory.mktemp("pd_q35") / "q35", moe=False, vl=False,
                              mtp=False))
    kw = dict(KW, max_num_batched_tokens=32)
    a = LLM(d, kv_transfer_config=kv_config("auto"), **kw)
    b = LLM(d, kv_transfer_config=kv_config("zmq"), **kw)
    try:
        slots = a.llm_engine.block_manager.state_slots
        assert slots is not None
        for i, (n, src, dst) in enumerate([(20, a, b), (47, b, a), (70, a, a)]):
            ids = prompt(50 + i, n)
            want = a.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            params = prefill(src, ids)
            held = src.llm_engine.kv_connector.state.held[params["remote_request_id"]]
            assert held.state_slot >= 0  # the state before the last prompt token, kept
            src.llm_engine.block_manager.check_invariants([held.request])
            got = decode(dst, ids, params)
            assert got.outputs[0].token_ids == want, (n, src is a, dst is a)
            assert got.num_cached_tokens == n - 1
            src.llm_engine.core_step()
            for llm in (a, b):
                bm = llm.llm_engine.block_manager
                assert bm.num_used_pages == 0 and bm.state_slots.num_used == 0
    finally:
        for llm in (a, b):
            llm.llm_engine.kv_connector.close()

"""KV-cache events (``kv_events_config``): the block manager's record, the config's checks, and a
ZMQ subscriber that rebuilds the set of cached blocks from a real engine's events and finds the
engine's own set."""
from __future__ import annotations

import random
import time

import pytest
import zmq

from jaxserve import LLM, SamplingParams
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventsConfig,
                                     block_hash_bytes, decode_batch)
from jaxserve.core.request import Request

ZMQ_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}


def apply(events, blocks: set[bytes]) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            blocks.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            blocks.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            blocks.clear()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="unknown field.*'endpointt'"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "endpointt": "x"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{enable")
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True}).enabled  # null publisher
    assert KVEventsConfig.parse(ZMQ_EVENTS).enabled


def test_block_manager_records_stores_evictions_and_clears():
    bm = BlockManager(num_pages=5, block_size=4, record_events=True)  # 4 usable pages
    a = Request("a", list(range(1, 13)), SamplingParams(max_tokens=1))  # 3 full pages
    assert bm.allocate_slots(a, 12, [])
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    stored = bm.take_events()
    assert [type(e) for e in stored] == [BlockStored] * 3
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert stored[2].token_ids == [9, 10, 11, 12] and stored[2].block_size == 4
    assert bm.take_events() == []
    bm.free(a)
    b = Request("b", list(range(100, 116)), SamplingParams(max_tokens=1))  # needs all 4 pages
    assert bm.allocate_slots(b, 16, [])
    removed = bm.take_events()
    assert all(isinstance(e, BlockRemoved) for e in removed) and len(removed) == 3
    blocks: set[bytes] = set()
    apply(stored + removed, blocks)
    assert blocks == {block_hash_bytes(h) for h in bm.cached_block_hashes()} == set()
    bm.free(b)
    assert bm.reset_prefix_cache()
    assert [type(e) for e in bm.take_events()] == [AllBlocksCleared]


def test_no_events_recorded_unless_asked():
    bm = BlockManager(num_pages=5, block_size=4)
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=1))
    assert bm.allocate_slots(a, 8, [])
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.take_events() == []


def drain(sub: zmq.Socket, blocks: set[bytes], quiet_s: float = 1.0) -> list:
    """Read batches until none arrives for ``quiet_s``; returns every event read."""
    seen, last_seq = [], None
    while sub.poll(int(quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seq = int.from_bytes(seq, "big")
        assert last_seq is None or seq == last_seq + 1, "a batch was lost"
        last_seq = seq
        batch = decode_batch(payload)
        assert batch.ts > 0
        apply(batch.events, blocks)
        seen.extend(batch.events)
    return seen


def test_subscriber_rebuilds_the_engines_cached_blocks(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", max_model_len=128,
              max_num_seqs=2, max_num_batched_tokens=32, min_token_bucket=8,
              num_gpu_blocks_override=14, block_size=16, kv_events_config=ZMQ_EVENTS)
    engine = llm.llm_engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(engine.kv_event_publisher.endpoint)
    time.sleep(0.5)  # a SUB socket misses what is sent before it has joined
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    blocks: set[bytes] = set()
    events = []
    try:
        # rounds of prompts with a common prefix (hits) and more distinct pages than the pool
        # holds (evictions)
        for _ in range(3):
            prompts = [shared + [rng.randrange(3, 500) for _ in range(rng.randint(20, 60))]
                       for _ in range(4)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
            events += drain(sub, blocks)
            want = {block_hash_bytes(h) for h in engine.block_manager.cached_block_hashes()}
            assert want and blocks == want
        assert any(isinstance(e, BlockRemoved) for e in events), "no eviction happened"
        assert engine.block_manager.prefix_cache_hits > 0, "no prefix hit happened"
        assert engine.reset_prefix_cache()
        drain(sub, blocks)
        assert blocks == set() == engine.block_manager.cached_block_hashes()
    finally:
        sub.close(0)

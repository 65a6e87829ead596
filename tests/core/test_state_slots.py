"""The recurrent-state pool's slots on the host: admission needs a free slot, the slot goes
with the pages (finish, abort, recompute preemption), and the plan carries it per row."""
from dataclasses import dataclass

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.kv_cache_coordinator import KVCacheCoordinator
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.state_slots import StateSlots
from jaxserve.core.step_plan import token_ladder
from jaxserve.testing.reference_plan import build_step_plan, to_rows


@dataclass
class Params:
    max_tokens: int | None = 4


def make(num_pages=64, slots=2, max_seqs=4, budget=64):
    cc = CacheConfig(block_size=4, enable_prefix_caching=False)
    sc = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    bm = KVCacheCoordinator([BlockManager(num_pages, 4, enable_prefix_caching=False)],
                            StateSlots(slots))
    return Scheduler(sc, cc, bm, 128)


def test_slots_are_handed_out_and_taken_back():
    s = StateSlots(2)
    a, b = s.allocate("a"), s.allocate("b")
    assert (a, b) == (0, 1) and s.num_free == 0
    with pytest.raises(RuntimeError, match="no free"):
        s.allocate("c")
    s.free(a)
    with pytest.raises(RuntimeError, match="not in use"):
        s.free(a)
    assert s.allocate("c") == 0


def test_prefix_caching_with_a_state_pool_is_refused():
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheCoordinator([BlockManager(16, 4, enable_prefix_caching=True)], StateSlots(2))


def test_admission_waits_for_a_free_slot_and_the_plan_carries_it():
    sched = make(slots=2, max_seqs=4)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [5 + i] * 6, Params()))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]  # r2: no slot though room
    assert sorted(s.request.state_slot for s in out.scheduled) == [0, 1]
    plan = build_step_plan(to_rows(out), block_size=4, max_pages_per_seq=32,
                           ladder=token_ladder(64, 4), max_num_seqs=4)
    assert plan.state_slots[:2].tolist() == [0, 1] and set(plan.state_slots[2:]) == {-1}
    sched.update_after_dispatch(out, {"r0": 1, "r1": 1})
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.state_slots.num_free == 1
    out = sched.schedule()
    r2 = next(s for s in out.scheduled if s.request_id == "r2")
    assert r2.request.state_slot == 0  # the aborted request's slot
    sched.block_manager.check_invariants(list(sched.requests.values()))


def test_recompute_preemption_drops_the_slot():
    sched = make(num_pages=6, slots=2, max_seqs=2, budget=64)  # 5 usable pages of 4 tokens
    sched.add_request(Request("a", [5] * 8, Params(max_tokens=20)))
    sched.add_request(Request("b", [6] * 8, Params(max_tokens=20)))
    preempted = []
    for _ in range(10):
        out = sched.schedule()
        preempted += out.preempted
        sched.update_after_dispatch(out, {s.request_id: 7 for s in out.scheduled if s.sample})
        for r in sched.running + sched.waiting:
            assert (r.state_slot >= 0) == (r in sched.running)
        sched.block_manager.check_invariants(list(sched.requests.values()))
    assert preempted
    victim = sched.get_request(preempted[0])
    assert victim is None or victim.num_computed_tokens == 0 or victim.state_slot >= 0
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert sched.block_manager.state_slots.num_free == 2
    assert np.all(np.asarray(sched.block_manager.managers[0].ref_counts) == 0)


def test_n_siblings_fork_one_token_before_the_prompt_end():
    """fork_prompts: the first child stops one token short of its prompt while its siblings
    wait; they are then admitted at its progress, with its pages and slot to copy, and each
    computes the last prompt token itself. A sibling with no slot then computes its own
    prompt."""
    sched = make(slots=3, max_seqs=4)
    sched.siblings.fork_prompts = True
    prompt = list(range(10, 20))  # 10 tokens: the fork point is 9, in the third page of 4
    kids = [Request("k0", prompt, Params())] + [
        Request(f"k{i}", prompt, Params(), prefix_parent="k0") for i in (1, 2, 3)]
    for k in kids:
        sched.add_request(k)
    first = sched.schedule()
    assert [(s.request_id, s.num_new_tokens) for s in first.scheduled] == [("k0", 9)]
    sched.update_after_dispatch(first)
    second = sched.schedule()
    assert [(s.request_id, s.start_pos, s.num_new_tokens, s.sample)
            for s in second.scheduled] == [("k0", 9, 1, True), ("k1", 9, 1, True),
                                           ("k2", 9, 1, True)]  # k3: no free slot
    k0, k1, k2, k3 = kids
    assert second.fork_pages == (list(zip(k0.block_ids[:3], k1.block_ids[:3]))
                                 + list(zip(k0.block_ids[:3], k2.block_ids[:3])))
    assert second.fork_states == [(k0.state_slot, k1.state_slot), (k0.state_slot, k2.state_slot)]
    assert len({k.state_slot for k in kids[:3]}) == 3 and (k1.num_cached_tokens == 9)
    sched.update_after_dispatch(second, {s.request_id: 7 for s in second.scheduled})
    sched.finish_request("k1", RequestStatus.FINISHED_ABORTED)  # frees a slot for k3
    third = sched.schedule()
    late = next(s for s in third.scheduled if s.request_id == "k3")
    assert (late.start_pos, late.num_new_tokens) == (0, 10)  # its chance passed: recompute
    assert not third.fork_pages and k3.prefix_parent is None
    sched.block_manager.check_invariants(list(sched.requests.values()))

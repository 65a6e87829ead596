"""Host side of multi-LoRA (no jax): the scheduler's max_loras rule, the device-slot LRU and
host cache, prefix-cache keys per adapter, LoRARequest's checks."""
from __future__ import annotations

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.errors import InvalidRequestError
from jaxserve.lora.cache import LoRAManager
from jaxserve.lora.request import LoRARequest


def _lora(i):
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def _scheduler(max_loras, pages=64):
    bm = BlockManager(pages, 4)
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                     CacheConfig(block_size=4), bm, max_model_len=64, max_loras=max_loras)


def test_scheduler_runs_at_most_max_loras_adapters():
    s = _scheduler(max_loras=2)
    # arrival order: a1, a2, a3, base, a1, a3
    order = [1, 2, 3, 0, 1, 3]
    for k, i in enumerate(order):
        s.add_request(Request(f"r{k}", [5, 6, 7], None, arrival_time=k,
                              lora_request=_lora(i) if i else None))
    out = s.schedule()
    got = [r.request_id for r in (x.request for x in out.scheduled)]
    assert got == ["r0", "r1", "r3", "r4"]  # a3 waits: a1 and a2 fill the two slots
    assert {x.request.lora_int_id for x in out.scheduled} - {0} == {1, 2}
    # once every a2 request is gone, a3 runs
    s.finish_request("r1", RequestStatus.FINISHED_STOPPED)
    s.update_after_dispatch(out, {x.request_id: 9 for x in out.scheduled})
    out2 = s.schedule()
    assert {x.request.lora_int_id for x in out2.scheduled} == {0, 1, 3}
    assert {x.request_id for x in out2.scheduled} >= {"r2", "r5"}


def test_prefix_cache_never_shared_across_adapters():
    bm = BlockManager(32, 4)
    prompt = list(range(10, 22))  # three full pages
    first = Request("x", prompt, None, lora_request=_lora(1))
    assert bm.allocate_slots(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(first)
    same = Request("y", prompt, None, lora_request=_lora(1))
    other = Request("z", prompt, None, lora_request=_lora(2))
    base = Request("w", prompt, None)
    assert bm.get_computed_blocks(same)[1] == 8  # the last page is always recomputed
    assert bm.get_computed_blocks(other)[1] == 0
    assert bm.get_computed_blocks(base)[1] == 0


def test_slot_lru_and_host_cache():
    loads, writes = [], []

    def load(r):
        loads.append(r.lora_int_id)
        return f"weights-{r.lora_int_id}"

    m = LoRAManager(2, 3, load, lambda slot, ad: writes.append((slot, ad)))
    for i in (1, 2, 3):
        m.add(_lora(i))
    assert loads == [1, 2, 3]
    assert m.prepare([_lora(1), _lora(2)]) == {1: 0, 2: 1}
    assert m.prepare([_lora(2)]) == {2: 1}  # resident: no write
    assert m.prepare([_lora(3), _lora(2)]) == {3: 0, 2: 1}  # evicts a1, the LRU slot
    assert writes == [(0, "weights-1"), (1, "weights-2"), (0, "weights-3")]
    m.add(_lora(4))  # host cache of 3: a1 (oldest) leaves it
    assert m.prepare([_lora(1)]) == {1: 1}  # a2 is the LRU slot now; a1 is read again
    assert loads == [1, 2, 3, 4, 1]
    with pytest.raises(ValueError, match="3 adapters > max_loras 2"):
        m.prepare([_lora(1), _lora(2), _lora(3)])
    with pytest.raises(InvalidRequestError, match="'other'.*lora_int_id 1 is already used"):
        m.add(LoRARequest("other", 1, "/elsewhere"))
    assert m.remove(1) and not m.remove(1)


def test_lora_request_checks():
    r = LoRARequest("x", 3, "/p")
    assert (r.adapter_id, r.name, r.path) == (3, "x", "/p")
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/p")
    import jaxserve
    from jaxserve.lora.request import LoRARequest as direct
    assert jaxserve.LoRARequest is direct

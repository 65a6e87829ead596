"""``--gpu-memory-utilization`` is a fraction of the device's total memory (vLLM's meaning), not
of JAX's allocator pool: the sizing arithmetic on a faked 80 GiB device."""
from __future__ import annotations

import pytest

from jaxserve.config import ModelConfig, engine_config_from_kwargs
from jaxserve.worker import kv_cache_config, memory_budget
from jaxserve.worker.kv_cache import page_bytes

GiB = 2**30


def test_total_memory_from_the_allocator_limit():
    assert memory_budget.device_total_bytes(int(0.75 * 80 * GiB), 0.75) == 80 * GiB
    assert memory_budget.device_total_bytes(int(0.9 * 80 * GiB), 0.9) == 80 * GiB


def test_budget_is_a_fraction_of_total_memory():
    # allocator set to 0.9 as the core process does: 72 GiB usable, 16 GiB weights, 2 GiB reserve
    b = memory_budget.kv_cache_budget(80 * GiB, 0.9, int(0.9 * 80 * GiB), 16 * GiB, 2 * GiB)
    assert b == pytest.approx(54 * GiB, rel=1e-9)
    # JAX's default pool (75 %) when the backend had started before us: never more than it holds
    b = memory_budget.kv_cache_budget(80 * GiB, 0.9, int(0.75 * 80 * GiB), 16 * GiB, 2 * GiB)
    assert b == pytest.approx(42 * GiB, rel=1e-9)
    # a small utilization caps below the pool
    b = memory_budget.kv_cache_budget(80 * GiB, 0.5, int(0.9 * 80 * GiB), 16 * GiB, 2 * GiB)
    assert b == pytest.approx(22 * GiB, rel=1e-9)


def test_allocator_fraction_reads_the_variable(monkeypatch):
    monkeypatch.delenv(memory_budget.ALLOCATOR_FRACTION_ENV, raising=False)
    assert memory_budget.allocator_fraction() == 0.75
    monkeypatch.setenv(memory_budget.ALLOCATOR_FRACTION_ENV, "0.95")
    assert memory_budget.allocator_fraction() == 0.95
    monkeypatch.setenv(memory_budget.ALLOCATOR_FRACTION_ENV, "lots")
    assert memory_budget.allocator_fraction() == 0.75


class _FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


@pytest.mark.parametrize("fraction", [0.9, 0.75])
def test_pages_sized_from_total_memory(monkeypatch, fraction):
    """The runner's pool on a faked 80 GiB GPU whose allocator took ``fraction`` of it:
    utilization 0.9 gives 0.9 x 80 GiB minus weights and reserve (capped by the pool)."""
    mc = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=64)
    ec = engine_config_from_kwargs("m", gpu_memory_utilization=0.9, max_num_seqs=8,
                                   max_num_batched_tokens=64)
    limit, in_use = int(fraction * 80 * GiB), 10 * GiB
    monkeypatch.setenv(memory_budget.ALLOCATOR_FRACTION_ENV, str(fraction))
    monkeypatch.setattr(kv_cache_config.jax, "local_devices", lambda: [
        _FakeDevice({"bytes_limit": limit, "bytes_in_use": in_use})])
    n = kv_cache_config.num_pages_for(mc, ec, "bfloat16", 1024, param_bytes=in_use)
    per_page = page_bytes(mc, ec.cache.block_size, "bfloat16")
    kv_bytes = n * per_page
    usable = min(0.9 * 80 * GiB, limit)
    assert usable - in_use - GiB < kv_bytes <= usable - in_use  # reserve is < 1 GiB here
    if fraction == 0.9:  # the old reading (0.9 of the pool) would have left 7.2 GiB less
        assert kv_bytes > 0.9 * limit - in_use

"""The metrics registry under both prefixes, and the throughput gauges' arithmetic."""
from __future__ import annotations

import re

import pytest

from jaxserve.entrypoints.openai.metrics import ServerMetrics, ThroughputMeter

STATS = dict(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=10,
             prefix_cache_hits=4, prompt_tokens_total=100, generation_tokens_total=50,
             num_preemptions=0, cpu_cache_usage_perc=0.25, num_pages=9, num_free_pages=3,
             num_compiles=2)


def names(prefix: str) -> set[str]:
    text = ServerMetrics(lambda: STATS, "m", prefix).render().decode()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M)}


def test_vllm_prefix_renames_every_metric_and_nothing_else():
    ours, theirs = names("jaxserve"), names("vllm")
    assert ours and all(n.startswith("jaxserve:") for n in ours)
    assert theirs == {"vllm:" + n.split(":", 1)[1] for n in ours}
    assert {"vllm:cpu_cache_usage_perc", "vllm:avg_prompt_throughput_toks_per_s",
            "vllm:avg_generation_throughput_toks_per_s", "vllm:gpu_cache_usage_perc"} <= theirs


def test_unknown_prefix_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerMetrics(lambda: STATS, "m", "sglang")


def test_throughput_is_the_rate_between_readings():
    meter = ThroughputMeter()
    assert meter.update(0.0, 100, 10) == (0.0, 0.0)  # first reading: no interval yet
    assert meter.update(2.0, 300, 50) == (100.0, 20.0)
    # closer than the minimum interval: the last figure, and the reading is not consumed
    assert meter.update(2.5, 1000, 1000) == (100.0, 20.0)
    assert meter.update(4.0, 500, 80) == (100.0, 15.0)

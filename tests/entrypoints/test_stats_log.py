"""The periodic stats log lines (vLLM's format) computed from two snapshots of the engine's
counters: rates over the interval, the spec-decode line only when something was drafted."""
from __future__ import annotations

import asyncio
import logging

import pytest

from jaxserve.entrypoints.openai.stats_log import log_stats_forever, stats_lines


def _snap(prompt, gen, drafts=None, drafted=0, accepted=0, per_pos=(), running=1):
    s = dict(prompt_tokens_total=prompt, generation_tokens_total=gen, num_running=running,
             num_waiting=0, kv_cache_usage=0.25, prefix_cache_hit_rate=0.5)
    if drafts is not None:
        s.update(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=drafted,
                 spec_decode_num_accepted_tokens=accepted,
                 spec_decode_num_accepted_tokens_per_pos=list(per_pos))
    return s


def test_spec_decode_line_over_the_interval():
    before = _snap(100, 50, drafts=10, drafted=30, accepted=12, per_pos=[8, 3, 1])
    # in the interval: 20 drafts of 3 tokens, 25 accepted: 14 at position 0, 8 at 1, 3 at 2
    now = _snap(300, 150, drafts=30, drafted=90, accepted=37, per_pos=[22, 11, 4])
    general, spec = stats_lines(now, before, 10.0)
    assert general == ("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: "
                       "10.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, KV cache usage: "
                       "25.0%, Prefix cache hit rate: 50.0%")
    assert spec == ("SpecDecoding metrics: Mean acceptance length: 2.25, Accepted throughput: "
                    "2.50 tokens/s, Drafted throughput: 6.00 tokens/s, Accepted: 25 tokens, "
                    "Drafted: 60 tokens, Per-position acceptance rate: 0.700, 0.400, 0.150, "
                    "Avg Draft acceptance rate: 41.7%")


def test_no_spec_line_without_speculation_or_drafts_and_quiet_when_idle():
    assert len(stats_lines(_snap(10, 20), _snap(0, 0), 1.0)) == 1  # no speculation
    same = _snap(10, 20, drafts=4, drafted=8, accepted=2, per_pos=[2, 0])
    more = _snap(10, 30, drafts=4, drafted=8, accepted=2, per_pos=[2, 0])
    assert len(stats_lines(more, same, 1.0)) == 1  # tokens but no drafts in the interval
    assert stats_lines(dict(same, num_running=0), dict(same, num_running=0), 1.0) == []


def test_the_loop_logs_each_interval(caplog):
    snaps = iter([_snap(0, 0, drafts=0, per_pos=[0, 0]),
                  _snap(8, 4, drafts=2, drafted=4, accepted=3, per_pos=[2, 1])]
                 + [_snap(8, 4, drafts=2, drafted=4, accepted=3, per_pos=[2, 1],
                          running=0)] * 10)
    ticks = iter(range(100))

    async def run():
        task = asyncio.create_task(log_stats_forever(lambda: next(snaps), 0.01,
                                                     clock=lambda: float(next(ticks))))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai.stats_log"):
        asyncio.run(run())
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2  # one busy interval, then idle ones stay quiet
    assert msgs[1].startswith("SpecDecoding metrics: Mean acceptance length: 2.50")
    assert "Per-position acceptance rate: 1.000, 0.500" in msgs[1]

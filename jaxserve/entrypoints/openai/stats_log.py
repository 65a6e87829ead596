"""The server's periodic stats log lines (vLLM's ``LoggingStatLogger``): every
``interval`` seconds, throughput over the interval and the scheduler's gauges, and when the
engine speculates vLLM's spec-decode line (mean acceptance length, accepted and drafted tokens,
per-position acceptance rate) over the same interval. Computed from the engine's counters
(``engine.stats()``), so the numbers are the ones ``/metrics`` exports.
"""
from __future__ import annotations

import asyncio
import logging
import os

logger = logging.getLogger(__name__)

# vLLM's VLLM_LOG_STATS_INTERVAL; JAXSERVE_LOG_STATS_INTERVAL overrides it (seconds)
DEFAULT_INTERVAL_S = 10.0


def log_interval_s() -> float:
    return float(os.environ.get("JAXSERVE_LOG_STATS_INTERVAL", DEFAULT_INTERVAL_S))


def _delta(now: dict, before: dict, key: str) -> float:
    return float(now.get(key, 0) or 0) - float(before.get(key, 0) or 0)


def stats_lines(now: dict, before: dict, seconds: float) -> list[str]:
    """The log lines for the interval between two ``engine.stats()`` snapshots; none when
    nothing ran in it (an idle server stays quiet)."""
    prompt = _delta(now, before, "prompt_tokens_total")
    gen = _delta(now, before, "generation_tokens_total")
    busy = prompt or gen or now.get("num_running") or now.get("num_waiting")
    if not busy:
        return []
    seconds = max(seconds, 1e-9)
    lines = [
        f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, Avg generation throughput: "
        f"{gen / seconds:.1f} tokens/s, Running: {int(now.get('num_running', 0))} reqs, "
        f"Waiting: {int(now.get('num_waiting', 0))} reqs, KV cache usage: "
        f"{100 * float(now.get('kv_cache_usage', 0)):.1f}%, Prefix cache hit rate: "
        f"{100 * float(now.get('prefix_cache_hit_rate', 0) or 0):.1f}%"]
    if "spec_decode_num_drafts" in now:
        line = spec_decode_line(now, before, seconds)
        if line:
            lines.append(line)
    return lines


def spec_decode_line(now: dict, before: dict, seconds: float) -> str | None:
    """vLLM's "SpecDecoding metrics" line over the interval; None when nothing was drafted."""
    drafts = _delta(now, before, "spec_decode_num_drafts")
    drafted = _delta(now, before, "spec_decode_num_draft_tokens")
    accepted = _delta(now, before, "spec_decode_num_accepted_tokens")
    if drafts <= 0:
        return None
    per_pos_now = now.get("spec_decode_num_accepted_tokens_per_pos", [])
    per_pos_before = before.get("spec_decode_num_accepted_tokens_per_pos") or [0] * len(
        per_pos_now)
    rates = [(a - b) / drafts for a, b in zip(per_pos_now, per_pos_before)]
    return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted throughput: {accepted / seconds:.2f} tokens/s, Drafted throughput: "
            f"{drafted / seconds:.2f} tokens/s, Accepted: {int(accepted)} tokens, Drafted: "
            f"{int(drafted)} tokens, Per-position acceptance rate: "
            f"{', '.join(f'{r:.3f}' for r in rates)}, Avg Draft acceptance rate: "
            f"{100 * accepted / drafted if drafted else 0:.1f}%")


async def log_stats_forever(stats, interval_s: float, clock=None) -> None:
    """Every ``interval_s``: log the lines of the interval (``stats()`` -> the engine's dict)."""
    loop = asyncio.get_running_loop()
    clock = clock or loop.time
    before, t0 = dict(stats()), clock()
    while True:
        await asyncio.sleep(interval_s)
        try:
            now, t1 = dict(stats()), clock()
        except Exception:  # noqa: BLE001 - a dead engine is reported by /health, not here
            continue
        for line in stats_lines(now, before, t1 - t0):
            logger.info("%s", line)
        before, t0 = now, t1

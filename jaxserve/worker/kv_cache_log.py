"""The start-up log of a runner's KV cache: pools, bytes per context token (vLLM's figure) and
the maximum concurrency at ``max_model_len``."""
from __future__ import annotations

import logging

import numpy as np

from jaxserve.core.kv_cache_spec import (kv_bytes_per_token, pooled_kv_bytes_per_token,
                                         state_bytes_per_slot)

logger = logging.getLogger("jaxserve.worker.runner")


def log_kv_cache(runner, max_model_len: int) -> None:
    """The pools and vLLM's figures: KV bytes a max_model_len request holds per context
    token, and how many such requests the pools hold at once."""
    per_token = kv_bytes_per_token if runner.grouped else pooled_kv_bytes_per_token
    runner.kv_bytes_per_token = per_token(runner.cache_groups, block_size=runner.block_size,
                                        max_model_len=max_model_len)
    runner.max_concurrency = min(
        (n - 1) / p.max_pages(max_model_len, runner.block_size)
        for n, p in zip(runner.pool_pages, runner.pools))
    total = sum(n * p.page_bytes(runner.block_size) for n, p in zip(runner.pool_pages,
                                                                   runner.pools))
    logger.info("KV cache: %s pages of %d tokens in %d pool(s) (%.1f MiB, %s); KV bytes "
                "per context token: %.0f; Maximum concurrency for %d tokens per request: "
                "%.2fx", "+".join(map(str, runner.pool_pages)), runner.block_size,
                len(runner.pools), total / 2**20, np.dtype(runner.kv_dtype).name,
                runner.kv_bytes_per_token, max_model_len, runner.max_concurrency)

def log_hybrid_cache(runner, max_model_len: int, tp: int) -> None:
    """What the page pool and the state pool hold: requests and context tokens."""
    page = runner.pools[0].page_bytes(runner.block_size, tp) // tp
    slot = state_bytes_per_slot(runner.cache_groups) // tp
    tokens = (runner.num_pages - 1) * runner.block_size
    logger.info(
        "KV cache: %d pages of %d tokens (%.1f MiB, %d attention layers, %.0f bytes per "
        "context token); state pool: %d slots of %.2f MiB a device (%d LinearState layers, "
        "float32): %d requests at once, %d context tokens in all (%.1f requests at max_model_len %d)",
        runner.num_pages, runner.block_size, runner.num_pages * page / 2**20,
        len(runner.pools[0].layers), page / runner.block_size, runner.num_state_slots,
        slot / 2**20, len(runner.state_layers), runner.num_state_slots, tokens,
        min(runner.num_state_slots, tokens / max_model_len), max_model_len)
    if runner.snapshots is not None:
        n = runner.max_num_seqs * runner.num_spec_tokens
        logger.info("state pool: %d more slots (%.1f MiB) for the per-token snapshots of "
                    "speculative verify rows (%d per row)", n, n * slot / 2**20,
                    runner.num_spec_tokens)


def log_kv_config(runner, max_model_len: int, tp: int) -> None:
    """The pools by name (and the state pool) of ``runner.kv_config`` and vLLM's figures."""
    c = runner.kv_config
    runner.kv_bytes_per_token = c.kv_bytes_per_token(max_model_len)
    runner.max_concurrency = c.max_concurrency(max_model_len)
    total = sum(p.num_pages * p.page_bytes(runner.block_size) for p in c.pools)
    logger.info("KV cache: %s (pages of %d tokens; %.1f MiB, %s); KV bytes per context "
                "token: %.0f; Maximum concurrency for %d tokens per request: %.2fx",
                ", ".join(f"{p.name} {p.num_pages}" for p in c.pools), runner.block_size,
                total / 2**20, np.dtype(runner.kv_dtype).name, runner.kv_bytes_per_token,
                max_model_len, runner.max_concurrency)
    if c.num_state_slots is not None:
        slot = c.state_slot_bytes() // tp
        logger.info("state pool: %d slots of %.2f MiB a device (%d LinearState layers)%s",
                    c.num_state_slots, slot / 2**20, len(runner.state_layers),
                    f" + {c.scratch_slots} for speculative verify rows' snapshots"
                    if c.scratch_slots else "")

"""The start-up log of a runner's KV cache: pools, bytes per context token (vLLM's figure) and
the maximum concurrency at ``max_model_len``."""
from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger("jaxserve.worker.runner")


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

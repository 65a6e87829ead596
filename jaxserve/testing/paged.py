"""One harness for tests that run a model's paged forward by hand: rows of new tokens on given
pages become the step's inputs through the engine's own builder (``InputBatch``), and the
attention metadata through the runner's own ``attention_metadata``. So a model test plans its
steps exactly as the engine does."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import StepPlan, token_ladder
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_functions import attention_metadata
from jaxserve.worker.step_inputs import StepInputs

_GREEDY = SamplingParams(temperature=0.0)


def step_inputs(rows: Sequence[tuple], *, block_size: int, max_pages: int,
                ladder: Sequence[int] | None = None, max_num_seqs: int | None = None
                ) -> StepPlan:
    """``rows``: (new token ids, first position, pages): ``pages`` one list (one pool) or one
    list per cache group. The smallest bucket of ``ladder`` (default: powers of two from 8)
    that holds them; every row samples (greedy)."""
    n = len(rows)
    max_num_seqs = max_num_seqs or max(n, 1)
    groups = [[list(map(int, p)) for p in pages] if pages and isinstance(pages[0], (list, tuple))
              else [list(map(int, pages))] for _, _, pages in rows]
    batch = InputBatch(max_rows=max_num_seqs, num_groups=len(groups[0]), max_pages=max_pages,
                       block_size=block_size, max_model_len=max_pages * block_size,
                       max_num_seqs=max_num_seqs)
    ids = [f"row{i}" for i in range(n)]
    batch.apply(BatchDiff(new_reqs=[NewRequestData(rid, [], 0, _GREEDY, g)
                                    for rid, g in zip(ids, groups)]))
    tokens = [[int(t) for t in r[0]] for r in rows]
    total = sum(map(len, tokens))
    return batch.prepare_inputs(BatchDiff(
        req_ids=ids, num_tokens=[len(t) for t in tokens], token_ids=[t for ts in tokens for t in ts],
        start_pos=[int(r[1]) for r in rows], sample=[True] * n, num_draft=[0] * n,
        num_output=[0] * n), ladder=ladder or token_ladder(max(total, n, 8), min_bucket=8))


def metadata(plan: StepPlan, **kwargs):
    """The plan's ``AttentionMetadata`` on the device (``kwargs``: state or snapshot slots)."""
    inputs = jax.tree_util.tree_map(jnp.asarray, StepInputs.from_plan(plan))
    return attention_metadata(inputs, **kwargs)

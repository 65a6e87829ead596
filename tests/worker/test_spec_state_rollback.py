"""Speculative decoding on models with recurrent state, piece by piece: the verify step's
per-token state snapshots and their rollback (``jaxserve.worker.runner``), the MTP proposer's
hand-out of on-device drafts (``jaxserve.core.spec_decode``), and the plan's next known token
per row. End to end: tests/models/test_qwen3_5_mtp.py."""
from __future__ import annotations

import numpy as np

def test_snapshot_slots_and_rollback_copy_the_last_accepted_tokens_state():
    """Row b keeps its state after token i < num_draft in scratch slot base + b*k + i; the
    rollback copies snapshot a (the last accepted token) into the row's slot when a < num_draft,
    and leaves every other slot as it was."""
    import jax.numpy as jnp

    from jaxserve.worker.step_functions import rollback_fn, snapshot_slots

    base, k = 5, 3  # 5 request slots, then 4 rows x 3 scratch slots, then the trash slot
    nd = jnp.asarray([3, 0, 2, 3], jnp.int32)
    assert snapshot_slots(nd, base, k).tolist() == [
        [5, 6, 7, -1], [-1, -1, -1, -1], [11, 12, -1, -1], [14, 15, 16, -1]]
    n = base + 4 * k + 1
    pool = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    slots = jnp.asarray([2, 0, 4, -1], jnp.int32)  # row 3: padding
    emitted = jnp.asarray([2, 1, 3, 1], jnp.int32)  # accepted 1, -, all 2, 0
    [(out,)] = rollback_fn(base, k)([(jnp.asarray(pool),)], slots, nd, emitted)
    want = pool.copy()
    want[2] = pool[base + 0 * k + 1]  # row 0 kept 1 of 3 drafts: its snapshot after token 1
    want[-1] = out[-1]  # the trash slot takes whatever
    np.testing.assert_array_equal(np.asarray(out), want)


def test_mtp_proposer_hands_out_each_rows_drafts_once():
    from types import SimpleNamespace as NS

    from jaxserve.core.spec_decode import MtpProposer

    p = MtpProposer(3)
    reqs = [NS(request_id=r) for r in "abc"]
    rows = [NS(request=reqs[0], sample=True), NS(request=reqs[1], sample=False),
            NS(request=reqs[2], sample=True)]
    p.observe(rows, NS(draft_ids=np.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]])))
    # b's row did not sample (a prefill chunk): nothing for it; c has room for 2 tokens only
    assert p.propose(reqs, [5, 5, 2]) == [[1, 2, 3], [], [7, 8]]
    assert p.propose(reqs, [5, 5, 5]) == [[], [], []]  # read once
    p.observe(rows, NS(draft_ids=np.asarray([[1, 2, 3], [4, 5, 6], [7, 8, 9]])))
    p.override = lambda req, d: [x + 100 for x in d]
    assert p.propose(reqs[:1], [5]) == [[101, 102, 103]]


def test_step_plan_carries_each_rows_next_known_token():
    from jaxserve.core.step_plan import ScheduledSeq
    from jaxserve.testing.reference_plan import build_step_plan

    rows = [ScheduledSeq(list(range(10, 18)), 0, [[1]], sample=False, next_token=18),
            ScheduledSeq([5], 9, [[2, 3]], next_token=-1)]
    kw = dict(block_size=8, max_pages_per_seq=4, ladder=(16,), max_num_seqs=4)
    plan = build_step_plan(rows, num_spec_tokens=2, **kw)
    assert plan.next_token_ids.tolist() == [18, -1, -1, -1]
    assert build_step_plan(rows, **kw).next_token_ids is None  # only speculating steps

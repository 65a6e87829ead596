"""The StepPlan: one typed, frozen plan built in one place, with its extras padded."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.sampling_metadata import SamplingRow
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import FORWARD_FIELDS, ScheduledSeq
from jaxserve.testing.reference_plan import build_step_plan


def _plan(rows, **kw):
    return build_step_plan(rows, block_size=4, max_pages_per_seq=4, ladder=(4, 8, 16),
                           max_num_seqs=4, history_len=32, **kw)


def test_block_tables_and_slots_per_cache_group():
    rows = [ScheduledSeq([1, 2, 3, 4, 5], 0, [[1, 2], [7, 8]]), ScheduledSeq([9], 6, [[3, 4], [5, 6]])]
    plan = _plan(rows)
    assert plan.block_tables.shape == (2, plan.seq_bucket, 4)
    assert plan.block_tables[:, 1, :2].tolist() == [[3, 4], [5, 6]]
    # token 4 of row 0 (position 4) is page 1 offset 0; row 1's token (position 6) page 1 offset 2
    assert plan.slot_mapping[:, 4].tolist() == [2 * 4, 8 * 4]
    assert plan.slot_mapping[:, 5].tolist() == [4 * 4 + 2, 6 * 4 + 2]
    assert np.all(plan.slot_mapping[:, 6:] == 0)  # padding writes to the trash page
    with pytest.raises(ValueError, match="one page list per cache group"):
        _plan([ScheduledSeq([1], 0, [[1]]), ScheduledSeq([1], 0, [[1], [2]])])


def test_the_plan_is_frozen_and_every_extra_is_filled_at_build():
    greedy = SamplingParams(temperature=0.0, presence_penalty=0.5)
    rows = [ScheduledSeq([5, PLACEHOLDER], 3, [[1, 2]], prev_row=2,
                         sampling=SamplingRow(greedy, [4, PLACEHOLDER], [1, 2, 3], None, 2),
                         history_ref=(2, 4)),
            ScheduledSeq([1, 2, 3], 0, [[3]], sample=False, prompt_next_ids=[2, 3])]
    mask = np.array([[0b1010], [0]], np.int32)
    plan = _plan(rows, token_bitmask=mask)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.token_bitmask = None
    assert plan.prev_ref[:2].tolist() == [-1, 2] and plan.token_ids[1] == 0
    assert plan.history_ref[0].tolist() == [2, 4] and np.all(plan.history_ref[1:] == -1)
    assert plan.token_bitmask.shape == (plan.seq_bucket, 1)
    assert plan.token_bitmask[:, 0].tolist() == [0b1010, 0] + [-1] * (plan.seq_bucket - 2)
    assert plan.prompt_next_ids.shape == (plan.token_bucket,)
    assert plan.prompt_next_ids[2:4].tolist() == [2, 3]  # row 1 starts at token 2
    assert plan.sampling["temperature"][0] == 0.0 and plan.sampling["presence_penalty"][0] == 0.5
    assert plan.sampling["history"].shape == (plan.seq_bucket, 32)  # a penalty: full layout
    assert plan.state_slots.tolist() == [-1] * plan.seq_bucket
    assert plan.lora_slots.tolist() == [-1] * plan.token_bucket
    assert plan.spec_logits_indices is None and plan.draft_token_ids is None
    assert set(plan.forward_arrays()) == set(FORWARD_FIELDS) | {"num_seqs"}


def test_greedy_is_decided_once_on_the_host():
    rows = [ScheduledSeq([1], 0, [[1]], sampling=SamplingRow(
        SamplingParams(temperature=5e-6, top_p=0.5, top_k=3), [], [1], None, 0))]
    s = _plan(rows).sampling
    assert (s["temperature"][0], s["top_p"][0], s["top_k"][0]) == (0.0, 1.0, 0)

"""The persistent batch: diffs in, the step's inputs out, equal to what the rows' own builder
makes of the same step (sampling included), with pending ids named by their batch row.

The random add / finish / preempt / resume sequences run in tests/core/test_scheduler.py,
whose fake device builds every step through ``InputBatch`` and checks it against a batch
rebuilt from the live requests after each one."""
import numpy as np
import pytest

from jaxserve.core.batch_diff import BatchDiff, NewRequestData, PageUpdate
from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.sampling_metadata import SamplingRow
from jaxserve.testing.reference_plan import build_sampling_arrays
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch

LADDER = (8, 16, 32, 64)
EOS = [2, 3]


def make_batch(rows=8, max_model_len=64, groups=1, spec=0):
    return InputBatch(max_rows=rows, num_groups=groups, max_pages=max_model_len // 4,
                      block_size=4, max_model_len=max_model_len, max_num_seqs=rows,
                      eos_token_ids=EOS, num_spec_tokens=spec, seed=0)


def new(rid, tokens, params=None, pages=(1, 2), prompt=None, **kw):
    return NewRequestData(rid, list(tokens), len(tokens) if prompt is None else prompt,
                          params or SamplingParams(max_tokens=8), [list(pages)], **kw)


def step(rows):
    """rows: (req_id, token_ids, start, sample, num_output)."""
    return BatchDiff(req_ids=[r[0] for r in rows], num_tokens=[len(r[1]) for r in rows],
                     token_ids=[t for r in rows for t in r[1]],
                     start_pos=[r[2] for r in rows], sample=[r[3] for r in rows],
                     num_draft=[0] * len(rows), num_output=[r[4] for r in rows])


def test_diffs_that_name_unknown_requests_fail_loudly():
    b = make_batch()
    b.apply(BatchDiff(new_reqs=[new("a", range(5))]))
    with pytest.raises(ValueError, match="already in the batch"):
        b.apply(BatchDiff(new_reqs=[new("a", range(5))]))
    with pytest.raises(ValueError, match="not in the batch"):
        b.apply(BatchDiff(page_updates=[PageUpdate("ghost", 0, 2, [3])]))
    with pytest.raises(ValueError, match="not in the batch"):
        b.prepare_inputs(step([("ghost", [1], 0, True, 0)]), ladder=LADDER)
    with pytest.raises(ValueError, match="from entry 5"):  # pages the batch never heard of
        b.apply(BatchDiff(page_updates=[PageUpdate("a", 0, 5, [9])]))
    with pytest.raises(ValueError, match="pages, needs"):  # a row past its pages
        b.prepare_inputs(step([("a", range(9), 0, True, 0)]), ladder=LADDER)


def test_rows_are_reused_and_a_freed_row_is_padding_again():
    b = make_batch(rows=2)
    b.apply(BatchDiff(new_reqs=[new("a", [5, 6, 7], SamplingParams(temperature=0.7, seed=3)),
                                new("b", [8, 9])]))
    with pytest.raises(ValueError, match="full"):
        b.apply(BatchDiff(new_reqs=[new("c", [1])]))
    ra = b.row_of["a"]
    b.apply(BatchDiff(removed=["a", "never-added"], new_reqs=[new("c", [1, 2], pages=(4,))]))
    assert b.row_of["c"] == ra  # the lowest free row
    fresh = make_batch(rows=2)
    fresh.apply(BatchDiff(new_reqs=[new("b", [8, 9]), new("c", [1, 2], pages=(4,))]))
    assert b.snapshot() == fresh.snapshot()


def test_sampling_arrays_equal_the_rows_builder():
    """Every layout decision and field, for greedy, random, penalty, bias, min_tokens,
    logprobs and seeded rows (seeds of unseeded rows are the batch's own)."""
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.1, seed=2**40 + 7),
              SamplingParams(temperature=1.0, logit_bias={4: 1.5, 9: -2.0}, logprobs=3),
              SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[11]),
              SamplingParams(temperature=0.5, repetition_penalty=1.3, presence_penalty=0.2,
                             frequency_penalty=0.1)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [12, 13, 14]]
    outputs = [[21], [], [22, 23], [24], [25, 26]]
    b = make_batch()
    b.apply(BatchDiff(new_reqs=[new(f"r{i}", p + o, params[i], pages=(i + 1, i + 9),
                                    prompt=len(p))
                                for i, (p, o) in enumerate(zip(prompts, outputs))]))
    # each row decodes its last known token, except r1 (prefill of its last prompt token)
    # and r3, which skips sampling (a chunk that does not finish: num_output unchanged)
    rows = [(f"r{i}", [(p + o)[-1]], len(p + o) - 1, i != 3, len(o))
            for i, (p, o) in enumerate(zip(prompts, outputs))]
    plan = b.prepare_inputs(step(rows), ladder=LADDER)
    ref = build_sampling_arrays(
        [SamplingRow(params[i], outputs[i], prompts[i], EOS, len(outputs[i])) if i != 3 else None
         for i in range(5)], plan.seq_bucket, history_len=64)
    assert set(plan.sampling) == set(ref)
    for k in ref:
        if k == "seeds":
            continue
        assert plan.sampling[k].shape == ref[k].shape, k
        assert np.array_equal(plan.sampling[k], ref[k]), k
    assert plan.sampling["history"].shape[1] == 64  # the penalty row asks for the full layout
    assert tuple(plan.sampling["seeds"][1]) == (7, 2**8)  # the 64-bit seed, split
    seeds = plan.sampling["seeds"].copy()
    plan2 = b.prepare_inputs(step(rows), ladder=LADDER)  # unseeded rows keep their seed
    assert np.array_equal(plan2.sampling["seeds"], seeds)
    assert np.all(plan.sampling["seeds"][5:] == 0)


def test_pending_ids_name_their_row_and_read_back_ids_fill_the_history():
    """Async scheduling: a decode's id is still on the device; prev_ref names the batch row
    that sampled it (the device keeps each row's last id), a penalty row's history_ref too;
    once read back, the id joins the row's tokens."""
    b = make_batch()
    pen = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    b.apply(BatchDiff(new_reqs=[new("x", [1, 2, 3]), new("y", [4, 5], pen)]))
    b.apply(BatchDiff(removed=["x"]))  # y keeps its row; rows are not condensed
    ry = b.row_of["y"]
    assert ry == 1
    p1 = b.prepare_inputs(step([("y", [4, 5], 0, True, 0)]), ladder=LADDER)
    assert list(p1.token_rows[:1]) == [ry]
    p2 = b.prepare_inputs(step([("y", [PLACEHOLDER], 2, True, 1)]), ladder=LADDER)
    assert p2.prev_ref[0] == ry and p2.token_ids[0] == 0
    assert list(p2.history_ref[0]) == [ry, 2]
    assert list(p2.sampling["history"][0, :3]) == [4, 5, -1]  # the pending one: on device
    b.record(p1.token_rows[:1], b.generation[[ry]], p1.seq_lens[:1], np.array([30]))
    p3 = b.prepare_inputs(step([("y", [PLACEHOLDER], 3, True, 2)]), ladder=LADDER)
    assert list(p3.sampling["history"][0, :4]) == [4, 5, 30, -1]
    assert list(p3.history_ref[0]) == [ry, 3]


def test_read_back_ids_of_a_row_that_changed_hands_are_dropped():
    b = make_batch(rows=1)
    b.apply(BatchDiff(new_reqs=[new("a", [1, 2])]))
    gen = b.generation[[0]].copy()
    b.apply(BatchDiff(removed=["a"], new_reqs=[new("b", [7, 8, 9])]))
    b.record(np.array([0]), gen, np.array([2]), np.array([99]))  # a's late id
    assert b.snapshot()["b"]["token_ids"] == [7, 8, 9]
    b.record(np.array([0]), b.generation[[0]], np.array([3]), np.array([42]))
    assert b.snapshot()["b"]["token_ids"] == [7, 8, 9, 42]


def test_prompt_logprob_spans_lora_slots_and_state_slots():
    b = make_batch()
    b.apply(BatchDiff(new_reqs=[new("a", [5, 6, 7, 8], lora_int_id=3, state_slot=2),
                                new("b", [9, 10], pages=(5,))]))
    d = step([("a", [5, 6, 7], 0, False, 0), ("b", [9, 10], 0, True, 0)])
    d.prompt_spans = {0: (0, 3)}
    plan = b.prepare_inputs(d, ladder=LADDER, lora_slots={3: 1})
    assert list(plan.prompt_next_ids[:3]) == [6, 7, 8]
    assert list(plan.lora_slots[:5]) == [1, 1, 1, -1, -1]
    assert list(plan.state_slots[:2]) == [2, -1]
    assert list(plan.token_rows[:2]) == [-1, 1]  # a samples nothing this step


def test_a_pending_id_in_a_row_added_this_step_fails_loudly():
    """The device's last id of a row that just changed hands is the previous request's."""
    b = make_batch()
    b.apply(BatchDiff(new_reqs=[new("a", [1, 2])]))
    b.apply(BatchDiff(removed=["a"], new_reqs=[new("b", [3, 4])]))
    with pytest.raises(ValueError, match="entered the batch this step"):
        b.prepare_inputs(step([("b", [PLACEHOLDER], 2, True, 1)]), ladder=LADDER)
    b.apply(BatchDiff())  # a step later the row's id is b's own
    assert b.prepare_inputs(step([("b", [PLACEHOLDER], 2, True, 1)]), ladder=LADDER).prev_ref[0] == 0

"""The step's jit boundary: packed pytrees round-trip exactly, layouts are interned, and the
step inputs and attention metadata are made in one place each."""
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.step_inputs import SamplerInputs, StepInputs, pack, unpack

PACKAGE = Path(__file__).parents[2] / "jaxserve"


def _random_tree(rng, t: int):
    return {
        "ids": rng.integers(-5, 1000, size=t, dtype=np.int32),
        "table": rng.integers(0, 50, size=(2, 3, t), dtype=np.int32),
        "temps": rng.standard_normal(t).astype(np.float32),
        "seeds": rng.integers(0, 2**32, size=(t, 2), dtype=np.uint32),
        "mask": rng.random(t) < 0.5,
        "count": np.asarray(t, np.int32),
        "nested": (np.full((t, 0), 7, np.int32), np.float32(-0.0) + rng.random(1, np.float32)),
    }


@pytest.mark.parametrize("t", [1, 5, 64])
def test_pack_then_unpack_inside_jit_returns_every_leaf_bit_for_bit(t):
    tree = _random_tree(np.random.default_rng(t), t)
    buf, layout = pack(tree)
    assert buf.dtype == np.int32 and buf.ndim == 1 and buf.size == layout.size
    out = jax.jit(unpack, static_argnums=1)(buf, layout)
    flat, _ = jax.tree_util.tree_flatten(tree)
    got, _ = jax.tree_util.tree_flatten(out)
    assert len(flat) == len(got)
    for want, have in zip(flat, got):
        have = np.asarray(have)
        assert have.dtype == np.asarray(want).dtype and have.shape == np.shape(want)
        assert have.tobytes() == np.asarray(want).tobytes()


def test_layouts_are_interned_per_structure_and_shape():
    rng = np.random.default_rng(0)
    a, b = _random_tree(rng, 8), _random_tree(rng, 8)
    assert pack(a)[1] is pack(b)[1]  # same shapes: the same object (a cheap static argument)
    assert pack(_random_tree(rng, 16))[1] != pack(a)[1]
    b["ids"] = b["ids"].astype(np.float32)
    assert pack(b)[1] != pack(a)[1]


def test_pack_refuses_a_leaf_it_cannot_carry_by_bit_pattern():
    with pytest.raises(TypeError, match="float64"):
        pack({"x": np.zeros(3, np.float64)})


def _plan(num_spec_tokens: int):
    batch = InputBatch(max_rows=4, num_groups=1, max_pages=4, block_size=4, max_model_len=16,
                       max_num_seqs=4, num_spec_tokens=num_spec_tokens, seed=0)
    batch.apply(BatchDiff(new_reqs=[NewRequestData("a", [1, 2, 3], 3, SamplingParams(), [[1]]),
                                    NewRequestData("b", [4, 5], 2, SamplingParams(), [[2]])]))
    return batch.prepare_inputs(BatchDiff(
        req_ids=["a", "b"], num_tokens=[3, 2], token_ids=[1, 2, 3, 4, 5], start_pos=[0, 0],
        sample=[True, True], num_draft=[0, 0], num_output=[0, 0]), ladder=(8,))


@pytest.mark.parametrize("k", [0, 2])
def test_inputs_have_one_shape_whatever_a_step_uses(k):
    """Features a step does not use are fields at their off values, so the forward's and the
    sampler's layouts depend on the bucket and the engine only."""
    plan = _plan(k)
    inputs, sampler = StepInputs.from_plan(plan), SamplerInputs.from_plan(plan, k)
    s = plan.seq_bucket
    assert np.all(inputs.lora_slots == -1) and np.all(inputs.num_draft == 0)
    assert np.all(inputs.next_token_ids[inputs.seq_lens == 0] == -1)
    assert inputs.logits_indices.shape == ((s,) if k == 0 else (s, k + 1))
    assert sampler.draft_token_ids.shape == (s, k) and sampler.speculating == (k > 0)
    assert int(inputs.num_seqs) == 2
    assert pack(inputs)[1] is pack(StepInputs.from_plan(_plan(k)))[1]


def _calls(pattern: str) -> list[str]:
    hits = []
    for path in PACKAGE.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line) and not line.lstrip().startswith(("class ", "#")):
                hits.append(f"{path.relative_to(PACKAGE)}:{i}")
    return hits


def test_one_constructor_of_attention_metadata_and_of_the_step_plan():
    # (a reference forward in jaxserve/testing may build its own, without pages)
    metadata = [h for h in _calls(r"\bAttentionMetadata\(") if not h.startswith("testing/")]
    assert len(metadata) == 1 and metadata[0].startswith("worker/step_functions.py"), metadata
    plans = [h for h in _calls(r"\bStepPlan\(") if not h.startswith("testing/")]
    assert len(plans) == 1 and plans[0].startswith("worker/input_batch.py"), plans
    assert _calls(r"\bStepInputs\(") == []  # only StepInputs.from_plan's cls(...)


def test_warmup_when_max_model_len_is_below_the_token_budget(tiny_llama_dir):
    """Warm-up rows never exceed max_model_len, even when one bucket holds more tokens than a
    request may have; every bucket is compiled and nothing compiles afterwards."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), max_model_len=22, max_num_batched_tokens=64, max_num_seqs=4,
              min_token_bucket=16, enforce_eager=False)
    engine = llm.llm_engine
    before = engine.runner.num_compiles
    out = llm.generate([[5, 6, 7] * 4] * 3, SamplingParams(max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6, 6]
    assert engine.runner.num_compiles == before

"""Structured outputs below the server: the sampler's bitmask, the spec's validation, the
scheduler's grammar rules, and LLM answers that follow their grammar (a random-weight model:
only the mask makes them valid), the same with async scheduling on and off, with no compile."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.testing.reference_plan import build_sampling_arrays
from jaxserve.errors import InvalidRequestError
from jaxserve.worker import sampler as sampler_lib


def _bitmask_of(allowed: np.ndarray) -> np.ndarray:
    """[S, V] bool -> [S, ceil(V/32)] int32 (bit t%32 of word t//32)."""
    S, V = allowed.shape
    W = (V + 31) // 32
    padded = np.zeros((S, W * 32), bool)
    padded[:, :V] = allowed
    bits = padded.reshape(S, W, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    return bits.sum(-1).astype(np.uint32).view(np.int32)


_jit_sample = jax.jit(sampler_lib.sample)


# ---- sampler ---------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [500, 512])
def test_bitmask_forbids_exactly_the_masked_tokens(V):
    rng = np.random.default_rng(V)
    S = 6
    allowed = rng.random((S, V)) < 0.3
    allowed[1] = True  # unconstrained row
    allowed[2, :] = False
    allowed[2, [0, V - 1]] = True  # first and last token of the vocabulary (bit 0 / top bits)
    allowed[3, :] = False  # a row that allows nothing is left alone
    logits = rng.normal(size=(S, V)).astype(np.float32)
    out = np.asarray(sampler_lib.apply_token_bitmask(jnp.asarray(logits),
                                                     jnp.asarray(_bitmask_of(allowed))))
    for r in (0, 1, 2, 4, 5):
        assert np.array_equal(np.isneginf(out[r]), ~allowed[r]), r
        assert np.array_equal(out[r][allowed[r]], logits[r][allowed[r]])
    assert np.array_equal(out[3], logits[3])
    ones = np.full(((S, (V + 31) // 32)), -1, np.int32)  # all ones: the logits as they were
    assert np.array_equal(np.asarray(sampler_lib.apply_token_bitmask(
        jnp.asarray(logits), jnp.asarray(ones))), logits)


def test_sampler_samples_only_allowed_tokens_greedy_and_random():
    rng = np.random.default_rng(0)
    S, V = 8, 300
    allowed = rng.random((S, V)) < 0.05
    allowed[:, 7] = True
    logits = rng.normal(size=(S, V)).astype(np.float32) * 5
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
              SamplingParams(temperature=1.0, presence_penalty=1.0),
              SamplingParams(temperature=2.0, min_p=0.1), SamplingParams(temperature=0.0)]
    arrays = build_sampling_arrays([(p, [1, 2], [4, 5], None, 2) for p in params], S,
                                   history_len=16)
    md = sampler_lib.SamplingMetadata.from_dict(arrays)
    mask = jnp.asarray(_bitmask_of(allowed))
    for trial in range(3):
        arrays["seeds"][:] = rng.integers(0, 2**32, size=(S, 2), dtype=np.uint32)
        md = sampler_lib.SamplingMetadata.from_dict(arrays)
        out = _jit_sample(jnp.asarray(logits), md, token_bitmask=mask)
        toks = np.asarray(out.token_ids)
        assert allowed[np.arange(S), toks].all(), toks
    greedy = np.where(allowed, logits, -np.inf).argmax(-1)
    assert toks[0] == greedy[0] and toks[7] == greedy[7]
    # the logprob is that of the masked distribution
    lp = np.asarray(out.logprobs)
    masked = np.where(allowed[0], logits[0], -np.inf)
    want = masked[toks[0]] - np.log(np.exp(masked - masked.max()).sum()) - masked.max()
    assert lp[0] == pytest.approx(want, abs=1e-4)


# ---- the spec --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    ({}, "structured_outputs"),
    ({"json": {"type": "object"}, "regex": "a+"}, "structured_outputs"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json": 3}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_spec_errors_name_the_field(kw, param):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(**kw)
    assert isinstance(e.value, InvalidRequestError) and e.value.param == param


def test_sampling_params_takes_a_dict():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert p.structured_outputs.choice == ["a", "b"]
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(structured_outputs={"bogus": 1})
    assert e.value.param == "structured_outputs"


# ---- the scheduler ---------------------------------------------------------------------------
class _Gate:
    """A grammar as the scheduler sees it: only ``ready``."""

    def __init__(self, ready):
        self.ready = ready


def _scheduler():
    from jaxserve.config import CacheConfig, SchedulerConfig
    from jaxserve.core.block_manager import BlockManager
    from jaxserve.core.scheduler import Scheduler
    bm = BlockManager(64, 16, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                     CacheConfig(block_size=16), bm, 256)


def test_scheduler_waits_for_the_grammar_and_for_the_pending_token():
    from jaxserve.core.request import Request, RequestStatus
    sch = _scheduler()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    a.grammar = _Gate(False)
    b = Request("b", [4, 5], SamplingParams(max_tokens=8))
    sch.add_request(a)
    sch.add_request(b)
    out = sch.schedule()
    assert [s.request_id for s in out.scheduled] == ["b"]  # a compiles; b overtakes it
    assert a.status == RequestStatus.WAITING and not a.block_ids  # no slot, no pages
    sch.update_after_dispatch(out)  # b: a placeholder
    a.grammar.ready = True
    out = sch.schedule()
    assert sorted(s.request_id for s in out.scheduled) == ["a", "b"]
    sch.update_after_dispatch(out)  # both have a token in flight
    out = sch.schedule()
    # b decodes on its placeholder; a's mask needs its pending token, so a sits this step out
    assert [s.request_id for s in out.scheduled] == ["b"]
    a.resolve_pending(7)
    out = sch.schedule()
    assert "a" in [s.request_id for s in out.scheduled]


# ---- end to end with LLM ---------------------------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["x", "yy"]},
                                  "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"]}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
LARK = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[a-z]{1,5}/'
CHOICES = ["red", "green", "blue"]


def _llm(model_dir, async_scheduling):
    return LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=32, min_token_bucket=16, async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return _llm(tiny_model_factory("llama"), True)


def _generate(llm, prompts, params, async_scheduling):
    """The same engine either way: async scheduling is read per step, and nothing is in
    flight between two ``generate`` calls."""
    llm.llm_engine.async_scheduling = async_scheduling
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.async_scheduling = True


def _requests():
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=LARK)]
    params = []
    for i, s in enumerate(specs):
        params.append(SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=s))
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=100,
                                     structured_outputs=s))
    params.append(SamplingParams(temperature=0.0, max_tokens=12))  # unconstrained neighbour
    return params


def _check(text, spec):
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    else:
        assert re.fullmatch(r"(hi|hello) [a-z]{1,5}", text), text


@pytest.mark.slow
def test_llm_answers_follow_their_grammar_async_on_and_off(llm):
    params = _requests()
    prompts = [f"prompt number {i}" for i in range(len(params))]
    results = []
    for async_scheduling in (False, True):
        before = llm.llm_engine.runner.num_compiles
        outs = _generate(llm, prompts, params, async_scheduling)
        assert llm.llm_engine.runner.num_compiles == before  # the mask never recompiles
        results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in outs])
        for o, p in zip(outs, params):
            c = o.outputs[0]
            if p.structured_outputs is not None:
                assert c.finish_reason == "stop", (c.text, p)
                _check(c.text, p.structured_outputs)
    assert results[0] == results[1]  # async scheduling is exact with grammars too
    # the unconstrained neighbour is what it is alone
    alone = _generate(llm, [prompts[-1]], params[-1], False)[0].outputs[0]
    assert alone.token_ids == results[0][-1][1]


@pytest.mark.slow
def test_llm_bad_specs_are_errors_naming_the_field(llm):
    for spec, param in [(StructuredOutputsParams(json={"type": "nope"}), "structured_outputs.json"),
                        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex"),
                        (StructuredOutputsParams(grammar="start: undefined_rule"),
                         "structured_outputs.grammar"),
                        (StructuredOutputsParams(json="{not json"), "structured_outputs.json")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec),
                         use_tqdm=False)
        assert e.value.param == param
    # the engine is fine afterwards
    out = llm.generate(["x"], SamplingParams(max_tokens=8, temperature=0.0,
                                             structured_outputs={"choice": ["ok"]}),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == "ok"


@pytest.mark.slow
def test_structural_tag(llm):
    """Free text, but once the trigger appears the tagged part follows its schema."""
    tag = {"type": "structural_tag", "triggers": ["<fn="],
           "structures": [{"begin": "<fn=add>", "end": "</fn>", "schema": {
               "type": "object", "additionalProperties": False, "required": ["a"],
               "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}}]}
    spec = StructuredOutputsParams(structural_tag=json.dumps(tag))
    matcher = llm.llm_engine.structured.grammar_for(spec).matcher
    tok = llm.get_tokenizer()
    ok = tok.encode('hi there <fn=add>{"a":3}</fn> and more', add_special_tokens=False)
    bad = tok.encode('hi there <fn=add>{"b":3}</fn>', add_special_tokens=False)
    free = tok.encode("no call at all, just text", add_special_tokens=False)
    assert matcher.validate_tokens(ok) == len(ok)
    assert matcher.validate_tokens(bad) < len(bad)
    assert matcher.validate_tokens(free) == len(free)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs={
            "structural_tag": {"structures": "nope"}}), use_tqdm=False)
    assert e.value.param == "structured_outputs.structural_tag"

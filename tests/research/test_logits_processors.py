"""Custom logits processors with vLLM V1's batch-level interface: a jax one inside the jitted
sampler and a host one, each banning a token for the rows whose extra_args ask, equal to the
same ban written as logit_bias; a processor that raises fails its step's requests, not the
engine; the batch updates follow vLLM's removed / added / moved protocol."""
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.core.logits_processor import (BatchTracker, BatchUpdate,
                                            LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                            MinTokensLogitsProcessor, load_logits_processors)
from jaxserve.errors import InvalidRequestError


PROMPTS = [[1, 5, 9, 13, 200, 7], [42, 43, 44], [7, 7, 7, 7, 100], [300, 2, 11]]


@pytest.fixture(scope="module")
def llm(processors_llm):
    return processors_llm


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=6, **kw)


def test_ban_equals_logit_bias(llm):
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(), use_tqdm=False)]
    compiles = llm.llm_engine.stats()["num_compiles"]
    ban = [p[0] for p in plain]  # each prompt's first greedy token
    params = [_greedy(extra_args={"ban_jax": ban[0]}), _greedy(),
              _greedy(extra_args={"ban_host": ban[2]}),
              _greedy(extra_args={"ban_jax": ban[3], "ban_host": ban[3]})]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, [_greedy(logit_bias={ban[0]: -1e9}), _greedy(),
                  _greedy(logit_bias={ban[2]: -1e9}), _greedy(logit_bias={ban[3]: -1e9})],
        use_tqdm=False)]
    assert got == want
    assert got[1] == plain[1]
    for i in (0, 2, 3):
        assert ban[i] not in got[i] and got[i] != plain[i]
    assert llm.llm_engine.stats()["num_compiles"] == compiles


def test_raising_processor_fails_its_step_not_the_engine(llm):
    out = llm.generate([PROMPTS[0]], _greedy(extra_args={"explode": True}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "abort"
    assert "logits processor Exploding failed in apply: RuntimeError: boom" in \
        out.outputs[0].stop_reason
    with pytest.raises(InvalidRequestError, match="Exploding refused"):
        llm.generate([PROMPTS[0]], _greedy(extra_args={"explode": "at admission"}),
                     use_tqdm=False)
    again = llm.generate(PROMPTS[:2], _greedy(), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in again)


def test_batch_tracker_protocol():
    t = BatchTracker()
    info = lambda rid: (rid, [], [])  # noqa: E731
    u = t.update(["a", "b", "c"], info)
    assert u.batch_size == 3 and [a[0] for a in u.added] == [0, 1, 2] and not u.moved
    u = t.update(["c", "d", "a"], info)  # b leaves, d joins, a and c move
    rows = {0: "a", 1: "b", 2: "c"}
    for i in u.removed:
        rows.pop(i)
    for i, rid, *_ in u.added:
        rows[i] = rid
    for a, b, how in u.moved:
        rows[a], rows[b] = rows.get(b), rows.get(a)
    assert [rows[i] for i in range(3)] == ["c", "d", "a"]


def test_builtins_on_the_interface():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 2, np.float32))
    added = [(0, _greedy(logit_bias={1: 5.0}), [], []), (1, _greedy(), [], [])]
    bias = LogitBiasLogitsProcessor()
    bias.update_state(BatchUpdate(2, added=added))
    out = bias.apply(logits.copy())
    assert out[0, 1] == pytest.approx(logits[0, 1] + 5) and (out[1] == logits[1]).all()
    minp = MinPLogitsProcessor()
    assert minp.is_argmax_invariant() and not bias.is_argmax_invariant()
    minp.update_state(BatchUpdate(1, added=[(0, SamplingParams(min_p=0.5), [], [])]))
    assert np.isinf(minp.apply(logits.copy())[0, 2:]).all()
    mt = MinTokensLogitsProcessor(eos_token_ids=[3])
    mt.update_state(BatchUpdate(1, added=[(0, SamplingParams(min_tokens=2), [], [])]))
    assert np.isinf(mt.apply(logits.copy())[0, 3])
    with pytest.raises(ValueError, match="cannot load"):
        load_logits_processors(["nowhere.module:Nothing"])


def test_vllm_xargs_reach_extra_args():
    from jaxserve.entrypoints.openai import protocol as P
    req = P.parse_request(P.CompletionRequest, {"prompt": "hi", "vllm_xargs": {"ban_jax": 5}})
    assert req.to_sampling_params(128, 2).extra_args == {"ban_jax": 5}
    with pytest.raises(InvalidRequestError, match="return_hidden_states") as e:
        P.parse_request(P.CompletionRequest, {"prompt": "hi",
                                              "vllm_xargs": {"return_hidden_states": [1]}})
    assert e.value.param == "vllm_xargs"

"""The research features under pipeline parallelism, on 2 fake CPU devices: one engine at pp 2
with hidden-state capture, prompt embeddings (read on stage 0), custom logits processors (jax
and host) and batch-invariant reductions all on equals the same engine at pp 1: greedy tokens,
logprobs and the captured residual streams (each stage captures its own layers), with no
compile after warm-up; prompt embeddings of a prompt's tokens give the token path's output.

The engines run in a child process started with ``--xla_force_host_platform_device_count=2``;
it prints one JSON document, the assertions are made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_KW = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                 min_token_bucket=32, dtype="float32", max_hidden_state_layers=3,
                 enable_prompt_embeds=True, batch_invariant=True)
PROMPTS = [[1, 5, 9, 13, 200, 7], list(range(3, 60)), [42, 43, 44], [9, 9, 9, 8]]
ASKS = [[0, 2, 4], [-1], [1, 3], None]  # layers 0 (embeddings) .. 4 (the final norm) of 4


def _child(path: str) -> dict:
    import jax
    from safetensors.numpy import load_file

    sys.path.insert(0, str(ROOT / "tests" / "research"))
    from processors import BanJax  # noqa: E402

    from jaxserve import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    [weights] = Path(path).glob("*.safetensors")
    table = load_file(weights)["model.embed_tokens.weight"].astype(np.float32)
    out = {"num_devices": len(jax.devices()), "runs": {}}
    for name, pp in [("single", 1), ("pp2", 2)]:
        llm = LLM(path, pipeline_parallel_size=pp, logits_processors=[BanJax, "processors:BanHost"],
                  **ENGINE_KW)
        compiles = llm.llm_engine.stats()["num_compiles"]

        def params(i, ban=None):
            extra = {}
            if ASKS[i] is not None:
                extra["return_hidden_states"] = ASKS[i]
            if ban is not None:
                extra["ban_jax" if i % 2 else "ban_host"] = ban
            return SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                  extra_args=extra or None)

        plain = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))], use_tqdm=False)
        first = [o.outputs[0].token_ids[0] for o in plain]
        banned = llm.generate(PROMPTS, [params(i, first[i]) for i in range(len(PROMPTS))],
                              use_tqdm=False)
        embeds = llm.generate([{"prompt_embeds": table[p]} for p in PROMPTS[:2]],
                              [params(3), params(3)], use_tqdm=False)

        def rows(outs):
            return [dict(tokens=list(o.outputs[0].token_ids),
                         logprobs=[max(lp.values(), key=lambda x: x.logprob).logprob
                                   for lp in o.outputs[0].logprobs],
                         hidden=None if o.hidden_states is None else
                         np.asarray(o.hidden_states).tolist()) for o in outs]

        out["runs"][name] = dict(plain=rows(plain), banned=rows(banned), embeds=rows(embeds),
                                 compiles_after_warmup=llm.llm_engine.stats()["num_compiles"]
                                 - compiles)
        del llm
    return out


@pytest.fixture(scope="module")
def report(tiny_model_factory):
    path = str(tiny_model_factory("llama", layers=4))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, path], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("part", ["plain", "banned", "embeds"])
def test_pp2_equals_pp1(report, part):
    assert report["num_devices"] == 2
    single, pp2 = report["runs"]["single"][part], report["runs"]["pp2"][part]
    for i, (a, b) in enumerate(zip(single, pp2)):
        assert b["tokens"] == a["tokens"], (part, i)
        np.testing.assert_allclose(b["logprobs"], a["logprobs"], rtol=1e-4, atol=1e-4)
        assert (a["hidden"] is None) == (b["hidden"] is None), (part, i)
        if a["hidden"] is not None:
            got, want = np.asarray(b["hidden"]), np.asarray(a["hidden"])
            assert got.shape == want.shape and got.shape[1] == len(ASKS[i])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert report["runs"]["pp2"]["compiles_after_warmup"] == 0


@pytest.mark.slow
def test_features_act_under_pp2(report):
    """The ban moves each prompt off its first greedy token; embeddings of a prompt's tokens
    give its token path's tokens; the captured layers differ from each other."""
    runs = report["runs"]["pp2"]
    for plain, banned in zip(runs["plain"], runs["banned"]):
        assert banned["tokens"][0] != plain["tokens"][0]
    for i in range(2):
        assert runs["embeds"][i]["tokens"] == runs["plain"][i]["tokens"]
    h = np.asarray(runs["plain"][0]["hidden"])
    assert not np.allclose(h[:, 0], h[:, 1]) and not np.allclose(h[:, 1], h[:, 2])


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))

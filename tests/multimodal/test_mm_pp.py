"""Images under pipeline parallelism (2 stages on 2 fake CPU devices): the vision tower runs on
stage 0's devices, stage 0 merges the image embeddings, and every stage reads the step's
per-token image inputs (Qwen's M-RoPE positions, Gemma 4's bidirectional ``kv_limit``).

* the tiny Qwen 3.5 VLM at pp 2, its MTP head proposing: greedy tokens for prompts with 0, 1
  and 2 images equal HF ``generate`` (the 32-token budget splits an image's run), nothing
  compiles after warm-up (a stage that read text positions instead of M-RoPE fails here);
  the head on the last stage (image rows handed on from stage 0) keys and drafts as at pp 1;
* the tiny Gemma 4 VLM whose image tokens see each other both ways, at pp 2 (layers "1,5":
  the KV-sharing layers in their producers' stage) equals HF ``generate``, token for token
  and in the first token's log-probabilities.

The engines run in a child process started with ``--xla_force_host_platform_device_count=2``;
it prints one JSON document, asserted here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.testing.multimodal import IMAGE, PROMPT_HEAD, PROMPT_TAIL, make_image

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
N = 8
G4_HEAD, G4_TAIL, G4_IMAGE = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", \
    "<|image|>"


def _qwen_cases():
    """0, 1, 2 images of different sizes; the 1-image prompt's image run (16 placeholders)
    starts past token 20, so the 32-token budget splits it (as ``test_mm_engine``)."""
    return [
        (PROMPT_HEAD + "Hello there, no picture today." + PROMPT_TAIL, []),
        (PROMPT_HEAD + "Please describe this: " + IMAGE + " thanks" + PROMPT_TAIL,
         [make_image(128, 128, 0)]),
        (PROMPT_HEAD + "Compare " + IMAGE + " with " + IMAGE + PROMPT_TAIL,
         [make_image(96, 40, 1), make_image(64, 96, 2)]),
    ]


def _gemma4_cases():
    """1 and 2 images (64, then 60 + 56 soft tokens), each run whole in a 64-token step."""
    return [
        (G4_HEAD + "Please describe this: " + G4_IMAGE + " thanks" + G4_TAIL,
         [make_image(128, 128, 0)]),
        (G4_HEAD + "Compare " + G4_IMAGE + " with " + G4_IMAGE + G4_TAIL,
         [make_image(96, 40, 1), make_image(40, 120, 2)]),
    ]


def _generate(llm, cases, logprobs=None):
    from jaxserve.core.sampling_params import SamplingParams

    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p
               for p, ims in cases]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                                               logprobs=logprobs), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in out]
    if logprobs is None:
        return tokens, None
    first = [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in out]
    return tokens, first


def _qwen(path: str, pp: int) -> dict:
    """The tiny Qwen 3.5 VLM with its MTP head proposing 2 tokens: greedy tokens, the head's
    drafts of every step and its keys of every prompt position (pp 2: the head on the last
    stage reads the image rows stage 0 hands on); pp 2 warmed up (nothing compiles after)."""
    import numpy as np

    from jaxserve.entrypoints.llm import LLM

    llm = LLM(path, pipeline_parallel_size=pp, dtype="float32", max_num_batched_tokens=32,
              min_token_bucket=32, max_num_seqs=4, max_model_len=256, block_size=8,
              enforce_eager=pp == 1, speculative_config={"method": "mtp",
                                                         "num_speculative_tokens": 2})
    runner = llm.llm_engine.runner
    seen, keys = [], []

    def record(req, drafts):
        if len(req.all_token_ids) == len(req.prompt_token_ids) + 1:  # right after the prompt
            # the head's keys of every prompt position (image ones from stage 0's rows)
            k_pages = np.asarray(runner.kv_pages[runner.kv_config.mtp_layer][0])
            pos = np.arange(len(req.prompt_token_ids))
            keys.append((list(req.all_token_ids), k_pages[
                :, np.asarray(req.block_ids)[pos // 8], pos % 8].tolist()))
        seen.append((list(req.all_token_ids), list(drafts)))
        return drafts

    llm.llm_engine.proposer.override = record
    warm = runner.num_compiles
    out = dict(tokens=_generate(llm, _qwen_cases())[0], drafts=sorted(seen),
               keys=sorted(keys), compiles_after_warmup=runner.num_compiles - warm,
               encoded=runner.mm.num_encoded)
    if pp > 1:
        out["stages"] = runner.stages.num_stages
        out["encoder_devices"] = sorted(str(d) for d in runner.mm.buf.sharding.device_set)
        out["stage0_devices"] = sorted(str(d)
                                       for d in runner.stages.stage_meshes[0].devices.flat)
    return out


def _child(paths: dict) -> dict:
    import jax

    from jaxserve.entrypoints.llm import LLM

    out = {"num_devices": len(jax.devices())}
    out["qwen"] = {str(pp): _qwen(paths["qwen"], pp) for pp in (1, 2)}

    os.environ["JAXSERVE_PP_LAYER_PARTITION"] = "1,5"
    llm = LLM(paths["gemma4"], pipeline_parallel_size=2, dtype="float32",
              max_num_batched_tokens=64, min_token_bucket=64, max_num_seqs=2,
              max_model_len=256, block_size=8, enforce_eager=True)
    assert llm.llm_engine.scheduler.whole_image_runs
    out["gemma4"], out["gemma4_first_logprobs"] = _generate(llm, _gemma4_cases(), logprobs=5)
    return out


@pytest.fixture(scope="module")
def tiny_g4_bidir(tmp_path_factory):
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    return make_tiny_gemma4(tmp_path_factory.mktemp("g4pp") / "g4", conditional=True,
                            use_bidirectional_attention="vision")


@pytest.fixture(scope="module")
def qwen_mtp(tmp_path_factory):
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("vlm-mtp-pp") / "q", vl=True, mtp=True)


@pytest.fixture(scope="module")
def hf_mtp(qwen_mtp):
    from jaxserve.testing.multimodal import HFReference

    return HFReference(qwen_mtp)


@pytest.fixture(scope="module")
def report(qwen_mtp, tiny_g4_bidir):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("JAXSERVE_PP_LAYER_PARTITION", None)
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    paths = {"qwen": str(qwen_mtp), "gemma4": str(tiny_g4_bidir)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(paths)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a child process with 2 CPU devices
def test_qwen_images_under_pp2_equal_hf_generate(report, hf_mtp):
    cases = _qwen_cases()
    ids = hf_mtp.ids(*cases[1])
    first = ids.index(hf_mtp.image_id)
    assert first < 32 < first + 16  # the budget splits the image's run
    two = report["qwen"]["2"]
    assert report["num_devices"] == 2 and two["stages"] == 2
    assert two["tokens"] == [hf_mtp.greedy(p, ims, N) for p, ims in cases]
    assert two["encoded"] == 3
    assert two["compiles_after_warmup"] == 0
    assert two["encoder_devices"] == two["stage0_devices"]


@pytest.mark.slow
def test_qwen_mtp_head_reads_images_under_pp2_as_at_pp1(report):
    """The MTP head on the last stage gets each image token's embedding from stage 0 and the
    M-RoPE positions: its keys of every prompt position (image ones too) and its drafts at
    pp 2 are pp 1's, step for step."""
    import numpy as np

    one, two = report["qwen"]["1"], report["qwen"]["2"]
    assert two["tokens"] == one["tokens"]
    assert len(two["drafts"]) >= 12 and two["drafts"] == one["drafts"]
    assert len(two["keys"]) == 3
    for (ids1, k1), (ids2, k2) in zip(one["keys"], two["keys"]):
        assert ids1 == ids2
        np.testing.assert_allclose(np.asarray(k2), np.asarray(k1), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_gemma4_bidirectional_images_under_pp2_equal_hf_generate(report, tiny_g4_bidir):
    """Greedy tokens and the first token's log-probabilities equal HF's, whose image tokens
    see each other both ways; HF's causal mask gives other log-probabilities (a stage that
    dropped ``kv_limit`` fails here: layers "1,5" put sliding layer 1, whose image tokens'
    outputs feed layer 2's keys, on stage 1)."""
    import numpy as np

    from tests.multimodal.test_mm_gemma4 import HFGemma4

    hf = HFGemma4(tiny_g4_bidir)
    cases = _gemma4_cases()
    assert report["gemma4"] == [hf.greedy(p, ims, N) for p, ims in cases]
    for (prompt, images), top in zip(cases, report["gemma4_first_logprobs"]):
        ids = [int(t) for t in top]
        want, causal = hf.last_logits(prompt, images), hf.last_logits(prompt, images, True)
        np.testing.assert_allclose([top[t] for t in top], want[ids], atol=2e-4)
        assert np.max(np.abs(want[ids] - causal[ids])) > 1e-2


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))

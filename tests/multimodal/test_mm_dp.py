"""Images under data parallelism: two replicas of the tiny Qwen 3.5 VLM on two (fake CPU)
devices, each with its own encoder step, serve concurrent image requests; every answer equals
HF ``generate`` whichever replica served it.

The replicas run in a child process with ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
(set before jax is imported); the child prints JSON and the assertions are made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.testing.multimodal import IMAGE, PROMPT_HEAD, PROMPT_TAIL, make_image

ROOT = Path(__file__).resolve().parents[2]
N = 6


def _cases():
    """(prompt, images) twice over: 1 and 2 images of different sizes, and a text prompt."""
    one = (PROMPT_HEAD + "Describe " + IMAGE + " please." + PROMPT_TAIL, [make_image(96, 64, 0)])
    two = (PROMPT_HEAD + "Compare " + IMAGE + " with " + IMAGE + PROMPT_TAIL,
           [make_image(64, 96, 1), make_image(40, 96, 2)])
    text = (PROMPT_HEAD + "No picture today." + PROMPT_TAIL, [])
    return [one, two, text, two, one, text]


def _child(model: str) -> dict:
    import asyncio

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.data_parallel import DataParallelAsyncLLM
    from jaxserve.entrypoints.llm import engine_config_from_kwargs

    cfg = engine_config_from_kwargs(model, data_parallel_size=2, dtype="float32",
                                    max_num_batched_tokens=32, min_token_bucket=32,
                                    max_num_seqs=4, max_model_len=256, block_size=8,
                                    enforce_eager=True)
    llm = DataParallelAsyncLLM(cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)

    async def one(i, prompt, images):
        req = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
        last = None
        async for out in llm.generate(req, sp, f"req-{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    async def main():
        tokens = await asyncio.gather(*(one(i, p, ims) for i, (p, ims) in enumerate(_cases())))
        await llm.shutdown()
        return tokens

    tokens = asyncio.run(main())
    return dict(tokens=tokens, takes_images=llm.takes_images,
                requests_per_replica=llm.requests_per_replica,
                encoded_per_replica=[r.engine.runner.mm.num_encoded for r in llm.replicas])


@pytest.mark.slow
def test_two_replicas_serve_images_equal_to_hf(tiny_vlm, hf_ref):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, str(tiny_vlm)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["takes_images"]
    assert sorted(r["requests_per_replica"]) == [3, 3]
    # each replica encoded the images it was sent (no replica serves images without its tower)
    assert all(n > 0 for n in r["encoded_per_replica"])
    want = [hf_ref.greedy(p, ims, N) for p, ims in _cases()]
    assert r["tokens"] == want


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))

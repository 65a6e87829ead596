"""Images through the engine (``LLM.generate`` with vLLM's ``multi_modal_data``) on the tiny
random Qwen 3.5 VLM: greedy tokens equal to HF ``generate`` for prompts with 0, 1 and 2 images
of different sizes, with chunked prefill splitting an image's placeholder run, under a page
pool small enough to preempt (the encoder cache keeps preempted requests from re-encoding),
and what a bad image request gets (a ``ValueError`` naming the field; the engine serves on)."""
from __future__ import annotations

import pytest

from jaxserve.testing.multimodal import IMAGE, PROMPT_HEAD, PROMPT_TAIL, make_image

pytest.importorskip("torch")

N = 8


def _llm(path, **kw):
    from jaxserve.entrypoints.llm import LLM

    args = dict(dtype="float32", max_num_batched_tokens=32, min_token_bucket=32,
                max_num_seqs=4, max_model_len=256, block_size=8, enforce_eager=True)
    args.update(kw)
    return LLM(str(path), **args)


def _cases():
    """(prompt, images): 0, 1, 2 images of different sizes; the 1-image prompt's image run
    starts past token 20, so the 32-token budget splits it (16 placeholders)."""
    long_text = "Please describe this: "
    return [
        (PROMPT_HEAD + "Hello there, no picture today." + PROMPT_TAIL, []),
        (PROMPT_HEAD + long_text + IMAGE + " thanks" + PROMPT_TAIL, [make_image(128, 128, 0)]),
        (PROMPT_HEAD + "Compare " + IMAGE + " with " + IMAGE + PROMPT_TAIL,
         [make_image(96, 40, 1), make_image(64, 96, 2)]),
    ]


def _generate(llm, cases, n=N):
    from jaxserve.core.sampling_params import SamplingParams

    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p
               for p, ims in cases]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


@pytest.fixture(scope="module")
def reference(hf_ref):
    return [hf_ref.greedy(p, ims, N) for p, ims in _cases()]


def test_greedy_with_images_equals_hf_generate_with_chunked_prefill(tiny_vlm, hf_ref,
                                                                     reference):
    cases = _cases()
    ids = hf_ref.ids(*cases[1])
    first = ids.index(hf_ref.image_id)
    assert first < 32 < first + 16  # the budget splits the image's run
    assert len({im.size for _, ims in cases for im in ims}) == 3
    llm = _llm(tiny_vlm)
    assert _generate(llm, cases) == reference
    encoder = llm.llm_engine.runner.mm
    assert encoder.num_encoded == 3
    # the same pictures again: encoder outputs come from the cache
    assert _generate(llm, cases[1:]) == reference[1:]
    assert encoder.num_encoded == 3


@pytest.mark.slow  # HF's MoE reference runs the slow torch fallbacks
def test_moe_vlm_with_images_equals_hf_generate(tiny_moe_vlm):
    """``Qwen3_5MoeForConditionalGeneration`` through the engine: the 0, 1 and 2-image prompts
    equal HF ``generate`` on the same checkpoint."""
    from jaxserve.testing.multimodal import HFReference

    hf = HFReference(tiny_moe_vlm)
    assert type(hf.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    want = [hf.greedy(p, ims, N) for p, ims in _cases()]
    llm = _llm(tiny_moe_vlm)
    assert _generate(llm, _cases()) == want
    assert llm.llm_engine.runner.mm.num_encoded == 3


def test_preemption_with_images_equals_hf_generate(tiny_vlm, hf_ref, reference):
    """20 pages of 8 tokens for 3 image prompts and a text one: they preempt each other and
    recompute; the encoder outputs they left behind serve them again."""
    cases = _cases() + [_cases()[1]]
    llm = _llm(tiny_vlm, num_gpu_blocks_override=12, max_num_seqs=4)
    assert _generate(llm, cases, N) == reference + [reference[1]]
    engine = llm.llm_engine
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.runner.mm.num_encoded == 3  # 3 distinct pictures, each encoded once


@pytest.mark.slow  # warm-up compiles the token bucket and the encoder's patch bucket
def test_nothing_compiles_after_warmup_with_images(tiny_vlm, reference):
    llm = _llm(tiny_vlm, enforce_eager=False, max_num_seqs=2)
    runner = llm.llm_engine.runner
    warm, encoder = runner.num_compiles, runner.mm.num_compiles
    assert encoder == len(runner.mm.ladder) == 1
    assert _generate(llm, _cases()) == reference
    assert runner.num_compiles == warm and runner.mm.num_compiles == encoder


def test_bad_image_requests_are_errors_naming_the_field(tiny_vlm, hf_ref, reference):
    from jaxserve.errors import InvalidRequestError

    llm = _llm(tiny_vlm, limit_mm_per_prompt={"image": 1})
    prompt, images = _cases()[2]
    bad = [
        ({"prompt": prompt, "multi_modal_data": {"image": images}}, "multi_modal_data.image"),
        ({"prompt": prompt, "multi_modal_data": {"video": [images[0]]}},
         "multi_modal_data.video"),
        ({"prompt": prompt, "multi_modal_data": {"image": "cat.png"}},
         "multi_modal_data.image[0]"),
        ({"prompt": PROMPT_HEAD + "no placeholder" + PROMPT_TAIL,
          "multi_modal_data": {"image": images[0]}}, "multi_modal_data.image"),
        ({"prompt": prompt, "images": images}, "prompt.images"),
    ]
    for p, param in bad:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(p, use_tqdm=False)
        assert e.value.param == param, (param, e.value)
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate(llm, _cases()[:2]) == reference[:2]  # and it serves on
    # LLM.chat takes image parts (image_pil, image_url) as vLLM's does
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.testing.multimodal import data_url

    im = make_image(64, 64, 9)
    for part in ({"type": "image_pil", "image_pil": im},
                 {"type": "image_url", "image_url": {"url": data_url(im)}}):
        messages = [{"role": "user", "content": [{"type": "text", "text": "Look"}, part]}]
        (out,) = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=N,
                                                   ignore_eos=True), use_tqdm=False)
        assert list(out.outputs[0].token_ids) == hf_ref.greedy_ids(hf_ref.chat_ids(messages),
                                                                   [im], N)


@pytest.mark.slow  # a second checkpoint built and loaded
def test_images_for_a_text_only_model_are_an_error(qwen_text_only):
    from jaxserve.errors import InvalidRequestError

    llm = _llm(qwen_text_only)
    with pytest.raises(InvalidRequestError, match="takes no images") as e:
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": make_image(32, 32, 0)}},
                     use_tqdm=False)
    assert e.value.param == "multi_modal_data"


@pytest.fixture(scope="module")
def qwen_text_only(tmp_path_factory):
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("text") / "q", mtp=False)


def _tp2_child(path: str) -> list:
    llm = _llm(path, tensor_parallel_size=2)
    visual = llm.llm_engine.model.visual.blocks[0].attn.qkv.weight.get_value()
    assert len(visual.sharding.device_set) == 2  # on both devices, replicated
    assert visual.addressable_shards[0].data.shape == visual.shape
    return _generate(llm, _cases())


@pytest.mark.slow  # a child process with 2 CPU devices
def test_tp2_with_images_equals_hf_generate(tiny_vlm, reference):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__, str(tiny_vlm)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == reference


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(_tp2_child(sys.argv[1])))

"""Gemma 4 images through the engine on a tiny random ``Gemma4ForConditionalGeneration``:
greedy tokens equal to HF ``generate`` (HF's own image processor and placeholder rule:
begin-of-image, one image token per soft token, end-of-image) for prompts with 0, 1 and 2
images of different sizes, with chunked prefill splitting an image's soft tokens; prefix
caching keyed by the image (same picture: hit; another picture, same text: no hit); through
the server with the openai client; a checkpoint whose image tokens see each other both ways
(``use_bidirectional_attention="vision"``) equals HF too, each image's run kept in one step."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.testing.multimodal import data_url, make_image

torch = pytest.importorskip("torch")

N = 8
HEAD, TAIL, IMAGE = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n", "<|image|>"


class HFGemma4:
    """HF ``generate`` with ``Gemma4ImageProcessorPil`` built from the checkpoint's settings and
    HF's ``Gemma4Processor`` expansion of each image token."""

    def __init__(self, path):
        import transformers as tf

        self.model = tf.Gemma4ForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32).eval()
        self.tok = tf.AutoTokenizer.from_pretrained(path)
        pre = json.loads((path / "preprocessor_config.json").read_text())
        self.proc = tf.Gemma4ImageProcessorPil(**{k: v for k, v in pre.items() if k not in (
            "image_processor_type", "processor_class")})
        c = self.model.config
        self.image, self.boi, self.eoi = c.image_token_id, c.boi_token_id, c.eoi_token_id

    def ids(self, prompt: str, images) -> tuple[list[int], dict]:
        return self.expand(self.tok.encode(prompt), images)

    def expand(self, ids: list[int], images) -> tuple[list[int], dict]:
        if not images:
            return ids, {}
        out = self.proc(images=images, return_tensors="pt")
        counts = iter(out["num_soft_tokens_per_image"].tolist())
        expanded = []
        for t in ids:
            expanded += ([self.boi] + [self.image] * next(counts) + [self.eoi]
                         if t == self.image else [t])
        # as Gemma4Processor: 1 marks an image token (the bidirectional mask reads it)
        types = torch.tensor([[int(t == self.image) for t in expanded]])
        return expanded, dict(pixel_values=out["pixel_values"],
                              image_position_ids=out["image_position_ids"],
                              mm_token_type_ids=types)

    def last_logits(self, prompt: str, images, causal: bool = False):
        """Log-probabilities after the prompt (``causal``: without the image tokens' mask)."""
        ids, kw = self.ids(prompt, images)
        if causal:
            kw.pop("mm_token_type_ids", None)
        with torch.no_grad():
            out = self.model(torch.tensor([ids]), **kw).logits[0, -1]
        return torch.log_softmax(out.float(), -1).numpy()

    def greedy(self, prompt: str, images, n: int = N) -> list[int]:
        return self.greedy_ids(self.tok.encode(prompt), images, n)

    def greedy_ids(self, ids: list[int], images, n: int = N) -> list[int]:
        ids, kw = self.expand(ids, images)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, **kw)
        return out[0, len(ids):].tolist()


def _cases():
    """0, 1 and 2 images of different sizes (64, 60 and 56 soft tokens)."""
    return [
        (HEAD + "Hello there, no picture today." + TAIL, []),
        (HEAD + "Please describe this: " + IMAGE + " thanks" + TAIL, [make_image(128, 128, 0)]),
        (HEAD + "Compare " + IMAGE + " with " + IMAGE + TAIL,
         [make_image(96, 40, 1), make_image(40, 120, 2)]),
    ]


@pytest.fixture(scope="module")
def tiny_gemma4_vlm(tmp_path_factory):
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    return make_tiny_gemma4(tmp_path_factory.mktemp("g4vl") / "gemma4-vl", conditional=True)


@pytest.fixture(scope="module")
def hf(tiny_gemma4_vlm):
    return HFGemma4(tiny_gemma4_vlm)


@pytest.fixture(scope="module")
def reference(hf):
    return [hf.greedy(p, ims) for p, ims in _cases()]


def _llm(path, **kw):
    from jaxserve.entrypoints.llm import LLM

    args = dict(dtype="float32", max_num_batched_tokens=64, min_token_bucket=32,
                max_num_seqs=4, max_model_len=256, block_size=8, enforce_eager=True,
                enable_prefix_caching=True)
    args.update(kw)
    return LLM(str(path), **args)


@pytest.fixture(scope="module")
def llm(tiny_gemma4_vlm):
    return _llm(tiny_gemma4_vlm)


def _generate(llm, cases, n=N):
    from jaxserve.core.sampling_params import SamplingParams

    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p
               for p, ims in cases]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out], out


def test_processor_and_placeholders_are_hfs(tiny_gemma4_vlm, hf, tmp_path):
    """The torchvision class named by the checkpoint loads as its PIL backend (from
    ``preprocessor_config.json`` or transformers 5's ``processor_config.json``); the prompt ids
    the engine builds are HF's (begin, soft tokens, end per image)."""
    from jaxserve.config import MultiModalConfig
    from jaxserve.multimodal.inputs import MultiModalInputProcessor
    from jaxserve.multimodal.processor import image_processor_class_name

    assert image_processor_class_name(tiny_gemma4_vlm) == "Gemma4ImageProcessorPil"
    pre = json.loads((tiny_gemma4_vlm / "preprocessor_config.json").read_text())
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": pre}))
    assert image_processor_class_name(tmp_path) == "Gemma4ImageProcessorPil"
    cfg = json.loads((tiny_gemma4_vlm / "config.json").read_text())
    proc = MultiModalInputProcessor(tiny_gemma4_vlm, {**cfg, **cfg["text_config"]},
                                    MultiModalConfig())
    for prompt, images in _cases():
        ids, mm = proc.process(hf.tok.encode(prompt), {"image": images} if images else None)
        assert ids == hf.ids(prompt, images)[0]
        assert sum(im.num_tokens for im in (mm.images if mm else [])) == ids.count(hf.image)
    counts = [im.num_tokens for im in proc.process(hf.tok.encode(_cases()[2][0]),
                                                   {"image": _cases()[2][1]})[1].images]
    assert len(set(counts)) == 2 and all(c > 0 for c in counts)


def test_greedy_with_images_equals_hf_generate_with_chunked_prefill(llm, hf, reference):
    cases = _cases()
    ids, _ = hf.ids(*cases[1])
    first = ids.index(hf.image)
    assert first < 64 < first + ids.count(hf.image)  # the 64-token budget splits the run
    assert len({im.size for _, ims in cases for im in ims}) == 3
    got, _ = _generate(llm, cases)
    assert got == reference
    assert llm.llm_engine.runner.mm.num_encoded == 3


def test_prefix_cache_hits_the_same_image_only(llm, hf, reference):
    """The 1-image prompt again: its pages (image included) hit; right after, the same text
    with another picture hits none of the image's pages, and its tokens are HF's for that
    picture."""
    prompt, images = _cases()[1]
    ids, _ = hf.ids(prompt, images)
    before_image = ids.index(hf.boi) + 1  # the begin-of-image token is text
    got, out = _generate(llm, [(prompt, images)])
    assert got == [reference[1]]
    assert out[0].num_cached_tokens >= before_image + ids.count(hf.image) - 8
    other = [make_image(128, 128, 5)]
    got, out = _generate(llm, [(prompt, other)])
    # at most the text pages before it (whether those hit depends on the sliding-window
    # layers' pages still being held)
    assert out[0].num_cached_tokens <= before_image
    assert got == [hf.greedy(prompt, other)]


@pytest.mark.slow  # a second engine
def test_preemption_with_images_equals_hf_generate(tiny_gemma4_vlm, hf, reference):
    """A page pool too small for the four prompts at once: they preempt each other and
    recompute, reading the encoder outputs they left behind (two pictures, 128 rows: the
    encoder cache's 140 hold both)."""
    text, one = _cases()[:2]
    other = (one[0], [make_image(128, 128, 5)])
    llm = _llm(tiny_gemma4_vlm, num_gpu_blocks_override=30, enable_prefix_caching=False)
    got, _ = _generate(llm, [text, one, one, other])
    assert got == reference[:2] + [reference[1], hf.greedy(*other)]
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert llm.llm_engine.runner.mm.capacity == 140
    assert llm.llm_engine.runner.mm.num_encoded == 2


@pytest.mark.slow  # warm-up compiles the token buckets and the encoder's patch buckets
def test_nothing_compiles_after_warmup_with_images(tiny_gemma4_vlm, reference):
    llm = _llm(tiny_gemma4_vlm, enforce_eager=False, max_num_seqs=2)
    runner = llm.llm_engine.runner
    warm, encoder = runner.num_compiles, runner.mm.num_compiles
    assert encoder == len(runner.mm.ladder) >= 2
    assert _generate(llm, _cases())[0] == reference
    assert runner.num_compiles == warm and runner.mm.num_compiles == encoder


@pytest.fixture(scope="module")
def bidir(tmp_path_factory):
    """A checkpoint whose image tokens attend to each other both ways on its sliding layers
    (HF's ``create_masks_for_vision_model``), and HF on it."""
    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    path = make_tiny_gemma4(tmp_path_factory.mktemp("bidir") / "g4",
                            conditional=True, use_bidirectional_attention="vision")
    return path, HFGemma4(path)


@pytest.mark.slow  # a second checkpoint built and loaded
def test_bidirectional_image_tokens_equal_hf_generate(bidir):
    """Greedy tokens and the first token's log-probabilities equal HF's for 1 and 2 images
    under a 64-token budget (each run of 56-64 image tokens waits for a step it fits whole);
    then the 1-image prompt again from the prefix cache. HF's causal mask gives other
    log-probabilities: a causal engine fails here."""
    from jaxserve.core.sampling_params import SamplingParams

    path, hf = bidir
    cases = _cases()[1:]
    llm = _llm(path)
    assert llm.llm_engine.scheduler.whole_image_runs
    out = llm.generate(
        [{"prompt": p, "multi_modal_data": {"image": ims}} for p, ims in cases],
        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=5),
        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == [hf.greedy(*c) for c in cases]
    for (prompt, images), o in zip(cases, out):
        want, causal = hf.last_logits(prompt, images), hf.last_logits(prompt, images, True)
        top = o.outputs[0].logprobs[0]
        ours = np.array([top[t].logprob for t in top])
        np.testing.assert_allclose(ours, want[list(top)], atol=2e-4)
        assert np.max(np.abs(want[list(top)] - causal[list(top)])) > 1e-2
    ids, _ = hf.ids(*cases[0])
    got, again = _generate(llm, cases[:1])
    assert got == [list(out[0].outputs[0].token_ids)]
    assert again[0].num_cached_tokens > ids.index(hf.image)  # the image's pages hit


def test_bidirectional_image_larger_than_the_budget_is_refused(bidir):
    from jaxserve.config import MultiModalConfig
    from jaxserve.errors import InvalidRequestError
    from jaxserve.multimodal.inputs import MultiModalInputProcessor

    path, hf = bidir
    cfg = json.loads((path / "config.json").read_text())
    proc = MultiModalInputProcessor(path, {**cfg, **cfg["text_config"]}, MultiModalConfig(),
                                    max_num_batched_tokens=60)
    prompt, images = _cases()[2]  # 60 and 56 soft tokens: fit
    proc.process(hf.tok.encode(prompt), {"image": images})
    prompt, images = _cases()[1]  # 64 soft tokens
    with pytest.raises(InvalidRequestError, match="max-num-batched-tokens") as e:
        proc.process(hf.tok.encode(prompt), {"image": images})
    assert e.value.param == "multi_modal_data.image[0]"


@pytest.mark.slow  # a server (uvicorn thread) over its own engine
def test_server_chat_with_an_image_equals_hf_generate(tiny_gemma4_vlm, hf):
    import asyncio

    openai = pytest.importorskip("openai")
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.tokenizer import apply_chat_template
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.openai.app import build_app
    from tests.server_process import ServerThread

    flags = ["serve", str(tiny_gemma4_vlm), "--served-model-name", "g4", "--max-model-len",
             "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
             "--min-token-bucket", "32", "--block-size", "8", "--dtype", "float32",
             "--enforce-eager"]
    engine = AsyncLLM(engine_config_from_args(build_parser().parse_args(flags)))
    im = make_image(96, 64, 4)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": data_url(im)}},
        {"type": "text", "text": "?"}]}]
    try:
        with ServerThread(build_app(engine, served_model_names=["g4"])) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                   timeout=120)
            r = client.chat.completions.create(model="g4", messages=messages, max_tokens=N,
                                               temperature=0, extra_body={"ignore_eos": True})
    finally:
        asyncio.run(engine.shutdown())
    rendered = [{"role": "user", "content": [messages[0]["content"][0], {"type": "image"},
                                             messages[0]["content"][2]]}]
    ids = list(apply_chat_template(hf.tok, rendered, add_generation_prompt=True))
    want = hf.tok.decode(hf.greedy_ids(ids, [im]), skip_special_tokens=True)
    assert r.choices[0].message.content == want.rstrip("\ufffd")
    assert r.usage.completion_tokens == N
    assert r.usage.prompt_tokens == len(hf.expand(ids, [im])[0])


def _tp2_child(path: str) -> list:
    llm = _llm(path, tensor_parallel_size=2)
    w = llm.llm_engine.model.visual.vision_tower.encoder.layers[0].self_attn.q_proj.linear
    w = w.weight.get_value()
    assert len(w.sharding.device_set) == 2  # on both devices, replicated
    assert w.addressable_shards[0].data.shape == w.shape
    return _generate(llm, _cases())[0]


@pytest.mark.slow  # a child process with 2 CPU devices
def test_tp2_with_images_equals_hf_generate(tiny_gemma4_vlm, reference):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, __file__, str(tiny_gemma4_vlm)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == reference


if __name__ == "__main__":
    import sys

    print(json.dumps(_tp2_child(sys.argv[1])))

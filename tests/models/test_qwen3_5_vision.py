"""The Qwen 3.5 / 3.6 vision tower and image prompts against HF transformers, on the tiny
random ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` (vision
weights and norms random): the tower's merged output within 1e-4 of HF's ``model.visual`` for
a batch of images of different sizes, and the logits of a prompt with 0, 1 and 2 images
(placeholders expanded by the checkpoint's image processor, M-RoPE positions) within float32
tolerance of HF's forward on ``pixel_values``."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

ATOL = 2e-4


def _image(w, h, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _load(path):
    import transformers as tf

    from jaxserve.loaders.model_loader import load_model

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    hf = getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()
    model, cfg, _ = load_model(str(path), dtype="float32")
    return path, hf, model, cfg


@pytest.fixture(scope="module")
def vlm(qwen35):
    return _load(qwen35("dense-vl"))


def test_vision_tower_matches_hf(vlm):
    import jax

    from jaxserve.models.qwen3_5_vision import vision_config, vision_inputs

    path, hf, model, cfg = vlm
    grids = [(1, 4, 6), (1, 8, 4), (1, 2, 2)]
    total = sum(t * h * w for t, h, w in grids)
    px = np.random.default_rng(0).standard_normal((total, 3 * 2 * 16 * 16)).astype(np.float32)
    with torch.no_grad():
        ref = hf.model.visual(torch.from_numpy(px),
                              grid_thw=torch.tensor(grids)).pooler_output.numpy()
    inp = vision_inputs(px, grids, cfg=vision_config(cfg.hf), num_patches=total + 12)
    out = np.asarray(jax.jit(lambda m, x: m.encode_images(x))(model, inp))
    assert out.shape[0] == (total + 12) // 4
    np.testing.assert_allclose(out[:total // 4], ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1e-2  # not a vacuous comparison


def _prompt(path, n_images):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    content = [{"type": "text", "text": "Look at"}]
    for _ in range(n_images):
        content += [{"type": "image"}, {"type": "text", "text": " and this"}]
    text = tok.apply_chat_template([{"role": "user", "content": content}],
                                   add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("sizes", [pytest.param([], marks=pytest.mark.slow),
                                   pytest.param([(64, 96)], marks=pytest.mark.slow),
                                   [(96, 40), (128, 128)]],
                         ids=["0-images", "1-image", "2-images"])
def test_image_prompt_logits_match_hf(vlm, sizes):
    _check_logits(*vlm, sizes)


@pytest.mark.slow  # another checkpoint (the MoE layout) built and loaded
def test_moe_image_prompt_logits_match_hf(qwen35):
    _check_logits(*_load(qwen35("moe-vl")), [(64, 96), (40, 72)])


def _check_logits(path, hf, model, cfg, sizes):
    import jax.numpy as jnp

    from jaxserve.core.kv_cache_spec import group_layers
    from jaxserve.models.layers import AttentionMetadata
    from jaxserve.models.qwen3_5_vision import vision_config, vision_inputs
    from jaxserve.multimodal.mrope import mrope_positions
    from jaxserve.multimodal.processor import ImageProcessor, expand_placeholders
    from jaxserve.worker.kv_cache import allocate_hybrid_caches

    image_id = json.loads((path / "config.json").read_text())["image_token_id"]
    images = ImageProcessor(path).process([_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    assert len({im.grid_thw for im in images}) == len(images)  # different sizes
    ids = expand_placeholders(_prompt(path, len(sizes)), image_id, images)
    assert ids.count(image_id) == sum(im.num_tokens for im in images)
    grids = [im.grid_thw for im in images]
    pos, _ = mrope_positions(ids, image_id, grids)

    mm = None
    if images:
        total = sum(im.pixel_values.shape[0] for im in images)
        inp = vision_inputs(np.concatenate([im.pixel_values for im in images]), grids,
                            cfg=vision_config(cfg.hf), num_patches=total)
        emb = model.encode_images(inp)
        rows = np.full(len(ids), -1, np.int32)
        rows[np.asarray(ids) == image_id] = np.arange(total // 4)
        mm = (emb, jnp.asarray(rows))
    block = 8
    n_pages = len(ids) // block + 2
    caches = allocate_hybrid_caches(cfg, group_layers(model.cache_specs("float32")), n_pages,
                                    2, block, jnp.float32)
    table = jnp.arange(1, n_pages, dtype=jnp.int32)[None, :]
    p = np.arange(len(ids), dtype=np.int32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(table[0, p // block] * block + p % block),
                           query_start=jnp.asarray([0, len(ids)], jnp.int32),
                           seq_lens=jnp.asarray([len(ids)], jnp.int32), block_tables=table,
                           num_seqs=jnp.int32(1), state_slots=jnp.asarray([1], jnp.int32))
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(pos), caches, md, mm=mm)
    ours = np.asarray(model.compute_logits(hidden))

    kw = {}
    if images:
        kw = dict(pixel_values=torch.from_numpy(np.concatenate([im.pixel_values
                                                                for im in images])),
                  image_grid_thw=torch.tensor(grids),
                  mm_token_type_ids=torch.tensor([[int(t == image_id) for t in ids]]))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), **kw).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)

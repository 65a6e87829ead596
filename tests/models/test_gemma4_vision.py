"""Gemma 4's vision encoder and projector (``models/gemma4_vision.py``) against HF's
``get_image_features`` on a tiny random ``Gemma4ForConditionalGeneration`` (every vision weight
random): two images of different sizes through ``Gemma4ImageProcessorPil`` (padded patches,
3x3 soft-token pooling), soft tokens within 1e-4; once as the checkpoint is written (weights
read from its safetensors), once with ``use_clipped_linears`` (bounds that bite) and
``standardize``."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")


def _randomize(hf, rng, clip: bool):
    with torch.no_grad():
        for name, p in [*hf.model.vision_tower.named_parameters(),
                        *hf.model.embed_vision.named_parameters()]:
            base = 1.0 if "norm" in name else 0.0
            p.copy_(torch.from_numpy((base + rng.standard_normal(p.shape) * 0.3)
                                     .astype(np.float32)))
        for name, b in hf.model.vision_tower.named_buffers():
            if name.endswith(("input_min", "output_min")) and clip:
                b.fill_(-0.5)
            elif name.endswith(("input_max", "output_max")) and clip:
                b.fill_(0.5)
            elif name.endswith("std_bias"):
                b.copy_(torch.from_numpy(rng.standard_normal(b.shape).astype(np.float32)))
            elif name.endswith("std_scale"):
                b.copy_(torch.from_numpy(rng.uniform(0.5, 2, b.shape).astype(np.float32)))


def _check(hf, cfg: dict, tensors: dict):
    import jax.numpy as jnp
    import transformers as tf
    from flax import nnx
    from PIL import Image

    from jaxserve.models.gemma4_vision import Gemma4Vision

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in ((96, 64), (200, 120))]
    proc = tf.Gemma4ImageProcessorPil(max_soft_tokens=70, pooling_kernel_size=3, patch_size=16)
    out = proc(images=images, return_tensors="pt")
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(
            out["pixel_values"], out["image_position_ids"]).pooler_output).numpy()
    model = Gemma4Vision(cfg, hf.config.text_config.hidden_size, dtype=jnp.float32,
                         rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        var.set_value(jnp.asarray(tensors[Gemma4Vision.checkpoint_name(
            ".".join(str(x) for x in path))]))
    x, valid = model(jnp.asarray(out["pixel_values"].numpy()),
                     jnp.asarray(out["image_position_ids"].numpy()))
    ours = np.asarray(x)[np.asarray(valid)]
    assert np.asarray(valid).sum(axis=1).tolist() == out["num_soft_tokens_per_image"].tolist()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 0.1


def test_vision_tower_and_projector_match_hf(tmp_path):
    import transformers as tf
    from safetensors.numpy import load_file

    from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

    path = make_tiny_gemma4(tmp_path / "g4", conditional=True)
    hf = tf.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    _randomize(hf, np.random.default_rng(0), clip=False)
    hf.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    _check(hf, cfg, load_file(str(path / "model.safetensors")))


@pytest.mark.slow
def test_clipped_linears_and_standardize_match_hf():
    import transformers as tf

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  use_clipped_linears=True, standardize=True)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    hf = tf.Gemma4ForConditionalGeneration(cfg).float().eval()
    _randomize(hf, np.random.default_rng(2), clip=True)
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    _check(hf, cfg.to_dict(), tensors)

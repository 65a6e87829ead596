"""Tiny random Gemma 4 checkpoints (transformers' own classes and initialisation), with every
feature the engine must get right switched on: a global head_dim and KV-head count different
from the sliding ones, ``attention_k_eq_v``, KV shared across the last layers, per-layer input
embeddings, final-logit soft-capping and (``moe=True``) the expert block beside the MLP.
``conditional=True`` writes a ``Gemma4ForConditionalGeneration`` (a tiny random vision tower,
the text stack under ``model.language_model``), with Gemma 4's image tokens added to the
tokenizer, a chat template that writes one image token per image part, and the torchvision
``Gemma4ImageProcessor`` named in ``preprocessor_config.json`` (16-pixel patches pooled 3x3, at
most 70 soft tokens an image)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.loaders.demo_model import BOS, EOS_TEXT, IM_END, PAD, RANDOM_NOTE, train_tokenizer

TEXT_DEFAULTS = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
    sliding_window=16, vocab_size_per_layer_input=512, hidden_size_per_layer_input=8,
    final_logit_softcapping=3.0, max_position_embeddings=4096, tie_word_embeddings=True,
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"],
    rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=IM_END, pad_token_id=PAD,
    hidden_activation="gelu_pytorch_tanh",
)
# Gemma 4's image token, begin-of-image and end-of-image, after the trained vocabulary
IMAGE_TOKENS = ["<|image|>", "<|image>", "<image|>"]
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|image|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor",
                "processor_class": "Gemma4Processor", "patch_size": 16, "max_soft_tokens": 70,
                "pooling_kernel_size": 3,
                "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
                "do_normalize": False, "do_convert_rgb": True}
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def _perturb(name: str, p):
    """HF initialises norms, scalars and router scales to 1: randomise them so a model that
    ignores one of them fails the parity tests."""
    import torch

    if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")) or \
            "norm_" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        g = torch.Generator().manual_seed(hash(name) % (2 ** 31))
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))


def make_tiny_gemma4(out_dir, *, moe: bool = False, conditional: bool = False, seed: int = 0,
                     **overrides) -> Path:
    import torch
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
                              Gemma4TextConfig, GenerationConfig)

    kw = {**TEXT_DEFAULTS, **(MOE if moe else {}), **overrides}
    tokenizer = train_tokenizer(kw["vocab_size"])
    ids = {}
    if conditional:
        tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
        tokenizer.chat_template = VL_CHAT_TEMPLATE
        kw["vocab_size"] = kw["vocab_size_per_layer_input"] = len(tokenizer)
        ids = dict(zip(("image_token_id", "boi_token_id", "eoi_token_id"),
                       tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)))
    text = Gemma4TextConfig(**kw)
    torch.manual_seed(seed)
    if conditional:
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=8)
        cfg = Gemma4Config(text_config=text.to_dict(), vision_config=vision, audio_config=None,
                           **ids)
        model = Gemma4ForConditionalGeneration(cfg)
    else:
        model = Gemma4ForCausalLM(text)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "language_model" in name or not conditional:
                _perturb(name, p)
            elif name.startswith(("model.vision_tower.", "model.embed_vision.")) and \
                    name.endswith("weight"):  # off HF's init, so the tests see every weight
                g = torch.Generator().manual_seed(hash(name) % (2 ** 31))
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[IM_END, EOS_TEXT],
                                               pad_token_id=PAD)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if conditional:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    cfg_path = out / "config.json"
    d = json.loads(cfg_path.read_text())
    d["_jaxserve_note"] = RANDOM_NOTE
    cfg_path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return out


def prompt(n: int, vocab: int = 512, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(5, vocab, n).astype(np.int32)

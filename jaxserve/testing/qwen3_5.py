"""Tiny random Qwen 3.5 / 3.6 checkpoints (dense or MoE; text-only ``*ForCausalLM`` or the
vision-language ``*ForConditionalGeneration`` layout), built with transformers' own classes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.loaders.demo_model import BOS, EOS_TEXT, IM_END, PAD, train_tokenizer

TEXT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, max_position_embeddings=40960, tie_word_embeddings=False,
            rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=IM_END, pad_token_id=PAD)
DENSE = dict(intermediate_size=128)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
           num_experts_per_tok=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def make_tiny_qwen3_5(out_dir, *, moe: bool = False, vl: bool = False, seed: int = 0,
                      **text_overrides) -> Path:
    """Write the checkpoint, a trained tokenizer and the generation config to ``out_dir``.
    Zero-centred norms, the gated norm, ``A_log`` and ``dt_bias`` get random values so the
    tests see every one of them."""
    import torch
    import transformers as tf

    text = {**TEXT, **(MOE if moe else DENSE), **text_overrides}
    torch.manual_seed(seed)
    if moe:
        cfg = (tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION) if vl
               else tf.Qwen3_5MoeTextConfig(**text))
        cls = tf.Qwen3_5MoeForConditionalGeneration if vl else tf.Qwen3_5MoeForCausalLM
    else:
        cfg = (tf.Qwen3_5Config(text_config=text, vision_config=VISION) if vl
               else tf.Qwen3_5TextConfig(**text))
        cls = tf.Qwen3_5ForConditionalGeneration if vl else tf.Qwen3_5ForCausalLM
    if vl:
        cfg.tie_word_embeddings = False
    model = cls(cfg).float()
    rng = np.random.default_rng(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.from_numpy(1 + 0.1 * rng.standard_normal(p.shape)))
            elif name.endswith("norm.weight"):  # zero-centred: (1 + w)
                p.copy_(torch.from_numpy(0.1 * rng.standard_normal(p.shape)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.from_numpy(rng.uniform(-1, 1, p.shape)))
    model.generation_config = tf.GenerationConfig(bos_token_id=BOS,
                                                  eos_token_id=[IM_END, EOS_TEXT],
                                                  pad_token_id=PAD)
    out = Path(out_dir)
    model.save_pretrained(out)
    train_tokenizer(text["vocab_size"]).save_pretrained(out)
    cfg_path = out / "config.json"
    c = json.loads(cfg_path.read_text())
    c["_jaxserve_note"] = "random weights: tests only"
    cfg_path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return out

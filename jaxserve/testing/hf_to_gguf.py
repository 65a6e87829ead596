"""A Hugging Face checkpoint directory -> a GGUF file, named and laid out the way llama.cpp's
``convert_hf_to_gguf.py`` writes it (for tests: the GGUF loader is checked on files it did not
write itself, against HF running the original checkpoint).

Covered: Mixtral (architecture ``llama``, Q/K rows permuted for llama.cpp's rotary layout, experts
stacked into ``ffn_{gate,up,down}_exps``), Gemma 2 / Gemma 3 (norm weights stored as ``1 + w``, no
``output`` tensor when tied), Phi-3 (fused ``attn_qkv`` and ``ffn_up``, LongRoPE factors as
``rope_factors_long/short`` tensors), Qwen3-MoE and Qwen2-MoE (shared expert as
``ffn_*_shexp``, its gate as ``ffn_gate_inp_shexp``). Metadata keys are gguf-py's. Tokenizer
metadata is not written (the tests feed token ids). Needs the ``gguf`` and ``safetensors``
packages, not torch.
"""
from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

# HF model_type -> GGUF architecture
GGUF_ARCH = {"mixtral": "llama", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3",
             "phi3": "phi3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERTS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps",
            "gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (HF halves -> interleaved pairs per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _rope(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling) of the global layers, in either transformers spelling."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))), rp


def hf_to_gguf(model_dir, out_path, qtype: str = "F32") -> str:
    """Write ``model_dir`` (config.json + safetensors) as GGUF; matrices in ``qtype`` (F32, F16
    or Q8_0; norms, routers and rope factors stay F32 as llama.cpp keeps them)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    mt = cfg["model_type"]
    arch = GGUF_ARCH.get(mt)
    if arch is None:
        raise ValueError(f"no GGUF conversion for model_type {mt!r}")
    hf: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        hf.update(load_file(f))
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, rope = _rope(cfg)

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(theta)
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int):
            getattr(w, f"add_{key}")(cfg[key])
    if arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    n_exp = cfg.get("num_local_experts") or cfg.get("num_experts")
    if n_exp:
        w.add_expert_count(n_exp)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            w.add_sliding_window(cfg["sliding_window"])
    if arch == "phi3":
        orig = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("rope_type") in ("longrope", "su"):
            scale = cfg["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32))
            w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32))

    qt = gguf.GGMLQuantizationType[qtype]

    def add(name: str, t: np.ndarray, keep_f32: bool = False):
        t = np.ascontiguousarray(t.astype(np.float32))
        if t.ndim == 1 or keep_f32 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)

    gemma = arch in ("gemma2", "gemma3")
    layer_names = {**_LAYER, **(_GEMMA_LAYER if gemma else {})}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in hf.items():
        if gemma and name.endswith("norm.weight"):
            t = t.astype(np.float32) + 1.0  # llama.cpp stores Gemma's 1 + w
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t)
            continue
        if name == "model.norm.weight":
            add("output_norm.weight", t)
            continue
        if name == "lm_head.weight":
            if not gemma:  # llama.cpp drops Gemma's (tied) head
                add("output.weight", t)
            continue
        _, _, layer, rest = name.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        if ".experts." in mod:
            _, e, proj = mod.rsplit(".", 2)
            experts.setdefault((int(layer), _EXPERTS[proj]), {})[int(e)] = t
            continue
        g = layer_names[mod]
        if arch == "llama" and g == "attn_q":
            t = _permute(t, heads)
        elif arch == "llama" and g == "attn_k":
            t = _permute(t, kv)
        add(f"blk.{layer}.{g}.{kind}", t, keep_f32=g.startswith("ffn_gate_inp"))
    for (layer, g), per in sorted(experts.items()):
        add(f"blk.{layer}.{g}.weight", np.stack([per[e] for e in range(len(per))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out_path)

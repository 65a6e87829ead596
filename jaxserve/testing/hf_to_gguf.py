"""A Hugging Face checkpoint directory -> a GGUF file, named and laid out the way llama.cpp's
``convert_hf_to_gguf.py`` writes it (for tests: the GGUF loader is checked on files it did not
write itself, against HF running the original checkpoint).

Covered: Mixtral (architecture ``llama``, Q/K rows permuted for llama.cpp's rotary layout, experts
stacked into ``ffn_{gate,up,down}_exps``), Gemma 2 / Gemma 3 (norm weights stored as ``1 + w``, no
``output`` tensor when tied), Phi-3 (fused ``attn_qkv`` and ``ffn_up``, LongRoPE factors as
``rope_factors_long/short`` tensors), Qwen3-MoE and Qwen2-MoE (shared expert as
``ffn_*_shexp``, its gate as ``ffn_gate_inp_shexp``), Gemma 4 (``gemma4``: per-type head dims
and KV heads as ``*_swa`` keys and a per-layer ``head_count_kv`` array, norms stored as they
are, ``attention_k_eq_v`` as a global layer without ``attn_v``, proportional rope as a
``rope_freqs`` tensor of 1s and 1e30s, fused ``ffn_gate_up_exps``) and Qwen 3.5 / 3.6
(``qwen35``/``qwen35moe``: GDN tensors as ``ssm_*``, ``A_log`` stored as ``-exp(A_log)``,
conv1d squeezed, zero-centred norms stored as ``1 + w``, V heads reordered from grouped-by-K
to tiled). Metadata keys are gguf-py's. Tokenizer metadata is not written (the tests feed
token ids). Needs the ``gguf`` and ``safetensors`` packages, not torch.
"""
from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

# HF model_type -> GGUF architecture
GGUF_ARCH = {"mixtral": "llama", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3",
             "phi3": "phi3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
             "gemma4_text": "gemma4", "gemma4": "gemma4", "qwen3_5_text": "qwen35",
             "qwen3_5": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_5_moe": "qwen35moe"}
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
# Gemma 4's names beyond Gemma 3's (the MoE block's norms, router, PLE, layer scalar)
_GEMMA4_LAYER = {
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm", "router.proj": "ffn_gate_inp",
}
# full HF suffix -> full GGUF suffix, where the kind (weight/bias) changes too
_GEMMA4_WHOLE = {"layer_scalar": "layer_output_scale.weight", "router.scale": "ffn_gate_inp.scale",
                 "router.per_expert_scale": "ffn_down_exps.scale",
                 "experts.gate_up_proj": "ffn_gate_up_exps.weight",
                 "experts.down_proj": "ffn_down_exps.weight"}
_GEMMA4_GLOBAL = {"model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                  "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                  "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
_QWEN35_LAYER = {"linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
                 "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm",
                 "linear_attn.out_proj": "ssm_out",
                 "post_attention_layernorm": "post_attention_norm"}
_QWEN35_WHOLE = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}
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


def _gemma4_metadata(w, cfg: dict) -> np.ndarray:
    """Gemma 4's keys as llama.cpp's ``Gemma4Model`` writes them; returns its ``rope_freqs``
    (1 for a rotated pair of the global head, 1e30 for an unrotated one)."""
    types = cfg["layer_types"]
    n = len(types)
    swa = [t == "sliding_attention" for t in types]
    head_dim = cfg["head_dim"]
    per = [v for k, v in (cfg.get("per_layer_config") or {}).items() if str(k).isdigit()]
    glob_dim = cfg.get("global_head_dim") or next((v["head_dim"] for v in per if "head_dim" in v),
                                                  head_dim)
    glob_kv = cfg.get("num_global_key_value_heads") or next(
        (v["num_key_value_heads"] for v in per if "num_key_value_heads" in v), None)
    kv = cfg["num_key_value_heads"]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    rp = cfg["rope_parameters"]
    full, local = rp["full_attention"], rp.get("sliding_attention", {})
    inter = cfg["intermediate_size"]
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("use_double_wide_mlp"):  # the KV-sharing layers' MLP is twice as wide
        w.add_feed_forward_length([inter if i < n - shared else 2 * inter for i in range(n)])
    else:
        w.add_feed_forward_length(inter)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv([kv if s else glob_kv for s in swa] if glob_kv else kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])
    if "rope_theta" in local:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_key_length(glob_dim)
    w.add_value_length(glob_dim)
    w.add_key_length_swa(head_dim)
    w.add_value_length_swa(head_dim)
    w.add_rope_dimension_count(glob_dim)
    w.add_rope_dimension_count_swa(int(head_dim * local.get("partial_rotary_factor", 1.0)))
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(cfg.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["top_k_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int):
            getattr(w, f"add_{key}")(cfg[key])
    rotated = int(glob_dim * full.get("partial_rotary_factor", 1.0) / 2)
    return np.asarray([1.0] * rotated + [1e30] * (glob_dim // 2 - rotated), np.float32)


def _qwen35_metadata(w, cfg: dict) -> None:
    """Qwen 3.5's keys as llama.cpp's ``Qwen3NextModel`` / ``Qwen3_5*TextModel`` write them."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rp = cfg.get("rope_parameters") or {}
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts"):
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rp.get("partial_rotary_factor", 0.25)))
    w.add_rope_dimension_sections((list(rp.get("mrope_section") or [11, 11, 10]) + [0] * 4)[:4])
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int):
            getattr(w, f"add_{key}")(cfg[key])


def _tiled_v(t: np.ndarray, axis: int, n_k: int, per_k: int, dim: int) -> np.ndarray:
    """llama.cpp's V-head order: heads grouped by K head (k0v0, k0v1, k1v0, ...) -> tiled
    (k0v0, k1v0, k0v1, ...) along ``axis``, each head ``dim`` wide."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(n_k, per_k, dim, *rest).swapaxes(0, 1).reshape(n_k * per_k * dim, *rest)
    return np.moveaxis(t, 0, axis)


def _qwen35_tensor(name: str, t: np.ndarray, cfg: dict) -> np.ndarray:
    """One Qwen 3.5 tensor as llama.cpp stores it (V reorder, ``-exp(A_log)``, squeezed conv,
    ``1 + w`` norms)."""
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    t = t.astype(np.float32)
    if n_k != n_v and ".linear_attn." in name:
        per_k, qk = n_v // n_k, 2 * n_k * dk
        if ".in_proj_qkv." in name or ".conv1d." in name:
            t = np.concatenate([t[:qk], _tiled_v(t[qk:], 0, n_k, per_k, dv)])
        elif ".in_proj_z." in name:
            t = _tiled_v(t, 0, n_k, per_k, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name or name.endswith(("A_log", "dt_bias")):
            t = _tiled_v(t, 0, n_k, per_k, 1)
        elif ".out_proj." in name:
            t = _tiled_v(t, 1, n_k, per_k, dv)
    if name.endswith(".A_log"):
        t = -np.exp(t)
    elif ".conv1d." in name:
        t = t.reshape(t.shape[0], t.shape[-1])
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1.0  # zero-centred RMSNorm: llama.cpp keeps 1 + w
    return t


# the towers and heads a text GGUF leaves out (llama.cpp writes them to an mmproj file, or
# as extra nextn blocks we do not serve)
_SKIPPED = ("model.visual.", "model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
            "model.embed_audio.", "model.multi_modal_projector.", "mtp.", "model.mtp.")


def hf_to_gguf(model_dir, out_path, qtype: str = "F32") -> str:
    """Write ``model_dir`` (config.json + safetensors) as GGUF; matrices in ``qtype`` (F32, F16
    or Q8_0; norms, routers, conv kernels and rope factors stay F32 as llama.cpp keeps them;
    rows Q8_0 cannot block fall back to F16)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    mt = cfg["model_type"]
    if "text_config" in cfg and "hidden_size" not in cfg:  # vision-language: its text model
        cfg = {**cfg, **cfg["text_config"]}
    arch = GGUF_ARCH.get(mt)
    if arch is None:
        raise ValueError(f"no GGUF conversion for model_type {mt!r}")
    hf: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        for name, t in load_file(f).items():
            if name.startswith(_SKIPPED):
                continue
            hf[name.replace("model.language_model.", "model.")] = t
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, rope = _rope(cfg)

    w = gguf.GGUFWriter(str(out_path), arch)
    gemma4, qwen35 = arch == "gemma4", arch.startswith("qwen35")
    rope_freqs = None
    if gemma4:
        rope_freqs = _gemma4_metadata(w, cfg)
    elif qwen35:
        _qwen35_metadata(w, cfg)
    else:
        _common_metadata(w, cfg, arch, heads, kv, head_dim, theta, rope)

    qt = gguf.GGMLQuantizationType[qtype]

    def add(name: str, t: np.ndarray, keep_f32: bool = False):
        t = np.ascontiguousarray(t.astype(np.float32))
        blocked = t.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0
        if t.ndim == 1 or keep_f32 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif qt == gguf.GGMLQuantizationType.F16 or not blocked:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)

    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs)
    shifted = arch in ("gemma2", "gemma3")  # Gemma 4's norms scale by w: stored as they are
    layer_names = {**_LAYER, **(_GEMMA_LAYER if shifted or gemma4 else {}),
                   **(_GEMMA4_LAYER if gemma4 else {}), **(_QWEN35_LAYER if qwen35 else {})}
    whole = _GEMMA4_WHOLE if gemma4 else _QWEN35_WHOLE if qwen35 else {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, t in hf.items():
        if shifted and name.endswith("norm.weight"):
            t = t.astype(np.float32) + 1.0  # llama.cpp stores Gemma's 1 + w
        if qwen35:
            t = _qwen35_tensor(name, t, cfg)
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", t)
            continue
        if name == "model.norm.weight":
            add("output_norm.weight", t)
            continue
        if gemma4 and name in _GEMMA4_GLOBAL:
            add(_GEMMA4_GLOBAL[name], t)
            continue
        if name == "lm_head.weight":
            # llama.cpp drops Gemma 2/3's (tied) head; others keep an untied one
            if not shifted and not (gemma4 and cfg.get("tie_word_embeddings", True)):
                add("output.weight", t)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest in whole:
            g = whole[rest]
            add(f"blk.{layer}.{g}", t, keep_f32=g.startswith("ffn_gate_inp"))
            continue
        if rest.startswith("mlp.experts.") and t.ndim == 3:  # fused experts: gate | up halves
            if rest.startswith("mlp.experts.gate_up_proj"):
                half = t.shape[1] // 2
                add(f"blk.{layer}.ffn_gate_exps.weight", t[:, :half])
                add(f"blk.{layer}.ffn_up_exps.weight", t[:, half:])
            else:
                add(f"blk.{layer}.ffn_down_exps.weight", t)
            continue
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
        add(f"blk.{layer}.{g}.{kind}", t,
            keep_f32=g.startswith("ffn_gate_inp") or g == "ssm_conv1d")
    for (layer, g), per in sorted(experts.items()):
        add(f"blk.{layer}.{g}.weight", np.stack([per[e] for e in range(len(per))]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(out_path)


def _common_metadata(w, cfg: dict, arch: str, heads: int, kv: int, head_dim: int, theta: float,
                     rope: dict) -> None:
    """The Llama-family keys, and what Mixtral, Gemma 2/3, Phi-3 and the Qwen MoEs add."""
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

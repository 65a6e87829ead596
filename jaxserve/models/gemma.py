"""Gemma 2 and Gemma 3 (text) in Flax NNX.

Against the Llama family: GeGLU MLP (gelu-tanh), embeddings scaled by sqrt(hidden), RMSNorm with
``(1 + w)`` around both attention and MLP (pre and post), ``query_pre_attn_scalar`` as the
softmax scale, attention-logit and final-logit soft-capping (Gemma 2), alternating sliding /
global layers (``layer_types``) and, in Gemma 3, q/k norms and a separate rope base for the
local layers. State paths equal HF tensor names, as in :mod:`jaxserve.models.llama`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_spec import FullAttention, SlidingWindow, attention_spec
from jaxserve.models.attention import AttentionBackend, resolve_attention_backend
from jaxserve.models.contract import ModelBase
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.layers import (
    AttentionMetadata,
    Embedding,
    MLP,
    apply_rope,
    paged_self_attention,
    rope_cos_sin,
)
from jaxserve.models.linear import Linear, lm_head_logits

LOCAL, GLOBAL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nnx.Module):
    """HF's Gemma RMSNorm: normalise and scale by ``1 + w`` in float32, then cast back."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def _layer_type(cfg: ModelConfig, layer: int) -> str:
    return LOCAL if cfg.layer_sliding_window(layer) is not None else GLOBAL


def _rope_settings(cfg: ModelConfig) -> dict[str, tuple]:
    """Static rope settings per layer type: Gemma 3's local layers have their own base."""
    glob = (cfg.rope_theta, _freeze(cfg.rope_scaling))
    local = glob
    if cfg.model_type == "gemma3_text":
        params = cfg.hf.get("rope_parameters") or {}
        if isinstance(params.get(LOCAL), dict):  # transformers 5
            p = dict(params[LOCAL])
            theta = float(p.pop("rope_theta", 10000.0))
            kind = p.get("rope_type", "default")
            local = (theta, None if kind == "default" else _freeze(p))
        else:  # transformers 4.x: `rope_local_base_freq`, scaling only on global layers
            local = (float(cfg.hf.get("rope_local_base_freq", 10000.0)), None)
    return {GLOBAL: glob, LOCAL: local}


class GemmaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.layer_type = _layer_type(cfg, layer)
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.kv_scale = None  # static ((k_scale, v_scale),) * Hkv of float8 pages: kv_scales
        self.sm_scale = float(cfg.hf.get("query_pre_attn_scalar") or d) ** -0.5
        cap = cfg.hf.get("attn_logit_softcapping")
        self.soft_cap = float(cap) if cap else None
        qkv = dict(bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d, **qkv)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, **qkv)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, **qkv)
        self.o_proj = Linear(cfg.num_heads * d, h, **qkv)
        if cfg.qk_norm:
            self.q_norm = GemmaRMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = GemmaRMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def cache_spec(self, dtype: str) -> FullAttention | SlidingWindow:
        """What this layer caches, in pages of ``dtype`` (the KV cache dtype's name)."""
        return attention_spec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, backend: AttentionBackend,
                 mesh=None):
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv = paged_self_attention(q, k, v, kv, md, backend=backend, mesh=mesh,
                                       num_kv_heads=self.num_kv_heads, sm_scale=self.sm_scale,
                                       sliding_window=self.sliding_window,
                                       soft_cap=self.soft_cap,
                                       kv_scale=self.kv_scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), kv


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.self_attn = GemmaAttention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.mlp = MLP(h, cfg.intermediate_size, act=cfg.hidden_act, dtype=dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps=eps, dtype=dtype)

    def __call__(self, x, cos, sin, kv, md, backend, mesh=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, backend, mesh)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, kv


class GemmaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [GemmaDecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)


# llama.cpp's Gemma 2 / 3 files: the layer norms' names, each norm stored as 1 + w
GGUF_LAYER_NAMES = {"post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# llama.cpp's fixed choices for Gemma (not in the file): the local rope base, and the 27B
# models' query scale of hidden / heads instead of head_dim (recognised by their layer count)
_GGUF_LOCAL_ROPE_BASE = 10000.0
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def gguf_config(a, cfg: dict, n_experts: int) -> None:
    """Gemma 2 / 3's HF config fields from llama.cpp's metadata."""
    cfg["hidden_act"] = cfg["hidden_activation"] = "gelu_pytorch_tanh"
    big = cfg["num_hidden_layers"] == _GGUF_27B_LAYERS[cfg["model_type"]]
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if big
                                    else cfg["head_dim"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = a(key)
        cfg[key] = float(v) if v else None
    if cfg["model_type"] == "gemma3_text":
        cfg["rope_local_base_freq"] = _GGUF_LOCAL_ROPE_BASE
    pattern = a("attention.sliding_window_pattern")  # absent: the family's own pattern
    if isinstance(pattern, list) and cfg.get("sliding_window"):  # per layer: True = local
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        cfg["sliding_window_pattern"] = int(pattern)


def gguf_unshift_norms(name: str, w, cfg: dict):
    """llama.cpp stores a (1 + w) RMSNorm's weight as 1 + w."""
    return w - np.float32(1.0) if name.endswith("norm.weight") else w


class GemmaForCausalLM(ModelBase, nnx.Module):
    """Gemma 2 / Gemma 3 text; ``attention_backend``: a name or an ``AttentionBackend``."""

    gguf = tuple(GGUFArch(name, arch, model_type, layer_names=GGUF_LAYER_NAMES,
                          config=gguf_config, to_hf=gguf_unshift_norms)
                 for name, arch, model_type in (("gemma2", "Gemma2ForCausalLM", "gemma2"),
                                                ("gemma3", "Gemma3ForCausalLM", "gemma3_text")))

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str | AttentionBackend = "reference"):
        self.num_layers = cfg.num_layers
        self.attention = resolve_attention_backend(attention_backend)
        self.mesh = None
        self.head_dim, self.max_pos = cfg.head_dim, cfg.max_position_embeddings
        self.ropes = tuple(sorted(_rope_settings(cfg).items()))  # static, hashable
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        cap = cfg.hf.get("final_logit_softcapping")
        self.final_soft_cap = float(cap) if cap else None
        self.model = GemmaModel(cfg, dtype=dtype, rngs=rngs)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))

    # The forward in pieces, as in jaxserve.models.llama: one code path for the single
    # program and the pipeline stages.
    supports_pipeline = True

    def embed(self, token_ids):
        x = self.model.embed_tokens(token_ids)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        return x * jnp.asarray(self.embed_scale, x.dtype)

    def layer_inputs(self, positions, md: AttentionMetadata, num_tokens: int):
        """The rotary tables of each layer type (local layers have their own base)."""
        cos_sin = {}
        for kind, (theta, scaling) in self.ropes:
            if (scaling and dict(scaling).get("rope_type")) == "dynamic":
                raise ValueError("dynamic rope scaling is not supported for Gemma")
            cos_sin[kind] = rope_cos_sin(positions, head_dim=self.head_dim, theta=theta,
                                         scaling=dict(scaling) if scaling else None,
                                         max_position_embeddings=self.max_pos)
        return cos_sin

    def run_layer(self, i: int, layer, x, inputs, kv, md, lora=None):
        if lora is not None:
            raise ValueError(f"{type(self).__name__} does not support LoRA adapters")
        cos, sin = inputs[layer.self_attn.layer_type]
        return layer(x, cos, sin, kv, md, self.attention, self.mesh)

    def compute_logits(self, hidden):
        """``[N, H]`` -> ``[N, V]`` float32 logits, soft-capped by ``final_logit_softcapping``."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = lm_head_logits(head, hidden)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits


def _freeze(d):
    if d is None:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))

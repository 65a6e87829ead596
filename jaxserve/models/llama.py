"""The Llama family in Flax NNX: Llama 2/3, Mistral, Qwen2/2.5, Qwen3.

One implementation; the differences are config flags (qkv bias, q/k RMSNorm, sliding window,
tied embeddings, GQA/MQA, rope scaling). State paths equal HF tensor names
(``model.layers.0.self_attn.q_proj.weight``), so checkpoints load without renaming.

Forward contract: ``model(token_ids[T], positions[T], kv_pages, md) -> (hidden[T, H], kv_pages)``
with ``kv_pages`` one ``(k_pages, v_pages)`` per layer, each ``[Hkv, num_pages, block_size, D]``.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import (
    AttentionMetadata,
    Embedding,
    MLP,
    RMSNorm,
    apply_rope,
    paged_self_attention,
    rope_cos_sin,
)
from jaxserve.models.linear import Linear, project, project_many
from jaxserve.models.attention import AttentionBackend, resolve_attention_backend
from jaxserve.models.contract import ModelBase
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.lora import LoRABatch, layer_lora
from jaxserve.core.kv_cache_spec import FullAttention, SlidingWindow, attention_spec
from pallas_kernels.reference import token_metadata


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.kv_scale = None  # static ((k_scale, v_scale),) * Hkv of float8 pages: kv_scales
        qkv = dict(bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d, **qkv)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, **qkv)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, **qkv)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False, dtype=dtype, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def cache_spec(self, dtype: str) -> FullAttention | SlidingWindow:
        """What this layer caches, in pages of ``dtype`` (the KV cache dtype's name)."""
        return attention_spec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)

    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, backend: AttentionBackend, mesh=None,
                 lora=None):
        t = x.shape[0]
        q, k, v = project_many([self.q_proj, self.k_proj, self.v_proj], x, lora,
                               ("q_proj", "k_proj", "v_proj"))
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        out, kv = paged_self_attention(q, k, v, kv, md, backend=backend, mesh=mesh,
                                       num_kv_heads=self.num_kv_heads,
                                       sm_scale=self.head_dim ** -0.5,
                                       sliding_window=self.sliding_window,
                                       kv_scale=self.kv_scale)
        return project(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), lora,
                       "o_proj"), kv


class DecoderLayer(nnx.Module):
    supports_lora = True  # takes ``lora`` (jaxserve.models.lora.LayerLoRA)

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, dtype=dtype,
                       rngs=rngs)

    def __call__(self, x, cos, sin, kv, md, backend, mesh=None, lora=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, backend, mesh,
                                  lora=lora)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x), lora=lora)
        return x, kv


class LlamaModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, layer_cls=DecoderLayer):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [layer_cls(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)


class LlamaForCausalLM(ModelBase, nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3; ``attention_backend``: a name or an ``AttentionBackend``."""

    decoder_layer = DecoderLayer  # a family that differs only in its layers swaps this
    gguf = (  # llama.cpp's names: the shared ones; a llama file with experts is Mixtral
        GGUFArch("llama", "LlamaForCausalLM", "llama", llama_converter=True,
                 with_experts="MixtralForCausalLM"),
        GGUFArch("mistral", "MistralForCausalLM", "mistral", llama_converter=True),
        GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", config=lambda a, cfg, n: _qwen2_gguf(cfg)),
        GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3"),
    )

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str | AttentionBackend = "reference"):
        self.num_layers = cfg.num_layers
        # Static (hashable) rope settings: the graphdef is a jit cache key.
        self.rope = (cfg.head_dim, cfg.rope_theta, _freeze(cfg.rope_scaling),
                     cfg.max_position_embeddings)
        self.attention = resolve_attention_backend(attention_backend)
        self.mesh = None  # the loader sets the tensor-parallel mesh (static: part of the graph)
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs, layer_cls=self.decoder_layer)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))

    @property
    def supports_lora(self) -> bool:
        return getattr(self.decoder_layer, "supports_lora", False)

    # The forward in pieces (embed, per-layer inputs, one layer): ModelBase's one layer loop and
    # each pipeline stage (jaxserve.worker.stages) run the same code.
    supports_pipeline = True

    def embed(self, token_ids):
        return self.model.embed_tokens(token_ids)

    def layer_inputs(self, positions, md: AttentionMetadata, num_tokens: int):
        """What every layer reads besides the hidden states: the rotary tables."""
        head_dim, theta, scaling, max_pos = self.rope
        scaling = dict(scaling) if scaling is not None else None
        token_seq_lens = None
        if (scaling or {}).get("rope_type") in ("dynamic", "longrope"):
            seq_of, _, _ = token_metadata(md.query_start, md.seq_lens, num_tokens)
            token_seq_lens = md.seq_lens[seq_of]
        return rope_cos_sin(positions, head_dim=head_dim, theta=theta, scaling=scaling,
                            max_position_embeddings=max_pos, token_seq_lens=token_seq_lens)

    def run_layer(self, i: int, layer, x, inputs, kv, md, lora: LoRABatch | None = None):
        """Layer ``i`` of this module's ``model.layers`` (``lora`` holds the same layers)."""
        cos, sin = inputs
        if lora is None:
            return layer(x, cos, sin, kv, md, self.attention, self.mesh)
        return layer(x, cos, sin, kv, md, self.attention, self.mesh,
                     lora=layer_lora(lora, i, self.mesh))



def _qwen2_gguf(cfg: dict) -> None:
    if cfg.get("sliding_window"):
        cfg["use_sliding_window"] = True


def _freeze(d):
    if d is None:
        return None
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))

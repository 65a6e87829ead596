"""Qwen 3.5 / 3.6 (HF ``qwen3_5``, ``qwen3_5_moe``): the hybrid of Gated DeltaNet and gated
full attention, dense or mixture-of-experts, text stack only.

Per layer (``layer_types``): ``linear_attention`` layers are Gated DeltaNet (causal conv1d over
q/k/v, the gated delta rule, a gated RMSNorm on the output) and cache a fixed-size recurrent
state (``LinearState``: conv history and delta-rule state, float32, one slot per running
request); ``full_attention`` layers are paged attention whose query projection also carries a
per-head output gate, with q/k RMSNorm and rotary embeddings on the first quarter of the head
(``partial_rotary_factor``). Norms outside the GDN layers are zero-centred (``(1 + w)``).

Caches: ``kv_pages[i]`` is ``(k_pages, v_pages)`` for an attention layer and
``(conv_state, recurrent_state)`` pools ``[N, C, K-1]``, ``[N, H_v, D_k, D_v]`` for a GDN layer;
``md.state_slots[S]`` names each row's slot (``pallas_kernels.gated_delta_rule``).

Checkpoints: ``Qwen3_5ForCausalLM`` (``model.*``) and the vision-language layout
(``Qwen3_5ForConditionalGeneration``: ``model.language_model.*``, and ``model.visual.*`` as the
vision tower ``visual``, :mod:`jaxserve.models.qwen3_5_vision`, replicated and unquantized;
image tokens take multimodal rotary positions ``[3, T]`` (M-RoPE, interleaved sections));
the multi-token-prediction head (``mtp.*``) is loaded only for speculative decoding with method
``mtp`` (``ModelConfig.load_mtp``; see :class:`MultiTokenPredictor`). Tensor parallel: attention
heads and the MLPs are split (Megatron rules); a GDN layer is split over its key/value heads: the
checkpoint's fused ``in_proj_qkv`` and ``conv1d`` load as separate q, k and v parts so each
device holds whole heads of each, its state pool slice holds those heads' conv channels and
delta-rule states, and ``out_proj`` sums the devices' partial products.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_spec import FullAttention, LinearState
from jaxserve.models.attention import AttentionBackend, resolve_attention_backend
from jaxserve.models.contract import ModelBase, megatron_partition_spec
from jaxserve.models.gemma import GemmaRMSNorm  # the (1 + w) RMSNorm Qwen 3.5 shares
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.layers import (
    AttentionMetadata,
    Embedding,
    MLP,
    apply_rope,
    paged_self_attention,
    rope_cos_sin,
)
from jaxserve.models.linear import Linear, normal
from jaxserve.models.moe import (GGUF_EXPERTS, GGUF_SHARED_EXPERT_NAMES, MoeForCausalLM,
                                 SparseMoeBlock)
from jaxserve.models.qwen3_5_vision import Qwen3_5VisionModel, merge_image_embeddings
from pallas_kernels import gated_delta_rule as gdn

LINEAR = "linear_attention"
_VISUAL_PREFIXES = ("model.visual.", "visual.")
_MTP_PREFIXES = ("mtp.", "model.mtp.")


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    lt = cfg.layer_types or cfg.hf.get("layer_types")
    if lt is None:
        every = int(cfg.hf.get("full_attention_interval") or 4)
        lt = [("full_attention" if (i + 1) % every == 0 else LINEAR)
              for i in range(cfg.num_layers)]
    return tuple(lt)


def _rope_params(cfg: ModelConfig) -> dict:
    return dict(cfg.hf.get("rope_parameters") or cfg.hf.get("rope_scaling") or {})


class GatedRMSNorm(nnx.Module):
    """``w * norm(x) * silu(gate)``: the GDN output norm (plain weight, around 1)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x, gate):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * xf.astype(x.dtype)
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class Conv1dWeight(nnx.Module):
    """HF's depthwise ``nn.Conv1d`` weight ``[C, 1, K]`` (no bias)."""

    def __init__(self, channels: int, kernel: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (channels, 1, kernel), dtype, std=0.2))


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        hf = cfg.hf
        h = cfg.hidden_size
        self.num_k_heads = int(hf["linear_num_key_heads"])
        self.num_v_heads = int(hf["linear_num_value_heads"])
        self.head_k_dim = int(hf["linear_key_head_dim"])
        self.head_v_dim = int(hf["linear_value_head_dim"])
        self.conv_kernel = int(hf.get("linear_conv_kernel_dim", 4))
        self.kv_scale = None  # no KV pages: float8 KV scales never apply (kept per layer)
        self.num_kv_heads = cfg.num_kv_heads
        self.activation = cfg.hidden_act
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * key_dim + value_dim
        lin = dict(bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_q = Linear(h, key_dim, **lin)
        self.in_proj_k = Linear(h, key_dim, **lin)
        self.in_proj_v = Linear(h, value_dim, **lin)
        self.in_proj_z = Linear(h, value_dim, **lin)
        self.in_proj_b = Linear(h, self.num_v_heads, **lin)
        self.in_proj_a = Linear(h, self.num_v_heads, **lin)
        conv = dict(dtype=dtype, rngs=rngs)
        self.conv1d_q = Conv1dWeight(key_dim, self.conv_kernel, **conv)
        self.conv1d_k = Conv1dWeight(key_dim, self.conv_kernel, **conv)
        self.conv1d_v = Conv1dWeight(value_dim, self.conv_kernel, **conv)
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, self.num_v_heads)).astype(dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(value_dim, h, **lin)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return gdn.state_shapes(num_k_heads=self.num_k_heads, num_v_heads=self.num_v_heads,
                                head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim,
                                conv_kernel=self.conv_kernel)

    def cache_spec(self) -> LinearState:
        s = self.state_shapes()
        return LinearState((s["conv"], s["recurrent"]), np.dtype(gdn.STATE_DTYPE).name)

    def __call__(self, x, state, md: AttentionMetadata, mesh=None):
        t = x.shape[0]
        qkv = (self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x))
        conv_w = tuple(c.weight[...][:, 0, :] for c in (self.conv1d_q, self.conv1d_k,
                                                          self.conv1d_v))
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        a = self.in_proj_a(x).astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a + self.dt_bias[...].astype(jnp.float32))
        core = self._recurrence
        if mesh is not None:  # each device runs the recurrence of its own heads
            cols = PartitionSpec(None, sharding.TP_AXIS)
            rows = PartitionSpec(sharding.TP_AXIS, None)
            heads = PartitionSpec(None, sharding.TP_AXIS, None)
            pool = PartitionSpec(None, sharding.TP_AXIS)
            core = sharding._shard_map(
                core, mesh, in_specs=((cols,) * 3, (rows,) * 3, cols, cols, (pool, pool),
                                      PartitionSpec()),
                out_specs=(heads, pool, pool))
        o, conv_state, rec_state = core(qkv, conv_w, g, beta, state, md)
        z = self.in_proj_z(x).reshape(t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.astype(x.dtype), z)
        return self.out_proj(o.reshape(t, -1)), (conv_state, rec_state)

    def _recurrence(self, qkv, conv_w, g, beta, state, md):
        """Causal conv then the gated delta rule, reading and writing the rows' slots (and the
        per-token snapshots of verify rows, ``md.snapshot_slots``). Head counts come from the
        shapes: under a mesh this runs on one device's heads."""
        t = qkv[0].shape[0]
        conv_state, rec_state = state
        y, conv_state = gdn.causal_conv1d(jnp.concatenate(qkv, axis=-1),
                                          jnp.concatenate(conv_w, axis=0), None, conv_state,
                                          md.query_start, md.seq_lens, md.state_slots,
                                          activation=self.activation,
                                          snapshot_slots=md.snapshot_slots)
        kd, vd = qkv[0].shape[-1], qkv[2].shape[-1]
        q = y[:, :kd].reshape(t, kd // self.head_k_dim, self.head_k_dim)
        k = y[:, kd:2 * kd].reshape(t, kd // self.head_k_dim, self.head_k_dim)
        v = y[:, 2 * kd:].reshape(t, vd // self.head_v_dim, self.head_v_dim)
        o, rec_state = gdn.gated_delta_rule(q, k, v, g, beta, rec_state, md.query_start,
                                            md.seq_lens, md.state_slots, use_qk_l2norm=True,
                                            snapshot_slots=md.snapshot_slots)
        return o, conv_state, rec_state


class GatedAttention(nnx.Module):
    """Full attention with a sigmoid output gate per head (``q_proj`` holds query and gate)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.kv_scale = None  # static float8 page scales (kv_scales), as in llama.Attention
        lin = dict(bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d * 2, **lin)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, **lin)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, **lin)
        self.o_proj = Linear(cfg.num_heads * d, h, **lin)
        self.q_norm = GemmaRMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)

    def cache_spec(self, dtype: str) -> FullAttention:
        return FullAttention(self.num_kv_heads, self.head_dim, dtype)

    def __call__(self, x, cos, sin, kv, md, backend, mesh=None):
        t, d = x.shape[0], self.head_dim
        qg = self.q_proj(x).reshape(t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(t, self.num_kv_heads, d))
        v = self.v_proj(x).reshape(t, self.num_kv_heads, d)
        r = cos.shape[-1]  # rotary dims: the first partial_rotary_factor of the head
        q = jnp.concatenate([apply_rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
        out, kv = paged_self_attention(q, k, v, kv, md, backend=backend, mesh=mesh,
                                       num_kv_heads=self.num_kv_heads, sm_scale=d ** -0.5,
                                       kv_scale=self.kv_scale)
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(out.reshape(t, self.num_heads * d)), kv


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs, moe: bool,
                 kind: str | None = None):
        eps = cfg.rms_norm_eps
        self.kind = kind or layer_types(cfg)[layer]
        if self.kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
            self.self_attn = None
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
            self.linear_attn = None
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps=eps,
                                                            dtype=dtype)
        if moe:
            self.mlp = SparseMoeBlock(cfg, dtype=dtype, rngs=rngs)
            self.mlp.renormalize = True  # Qwen3.5-MoE always renormalises its top-k weights
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act,
                           dtype=dtype, rngs=rngs)

    def cache_spec(self, dtype: str):
        if self.linear_attn is not None:
            return self.linear_attn.cache_spec()
        return self.self_attn.cache_spec(dtype)

    def __call__(self, x, cos, sin, cache, md, backend, mesh=None):
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            mixed, cache = self.linear_attn(h, cache, md, mesh)
        else:
            mixed, cache = self.self_attn(h, cos, sin, cache, md, backend, mesh)
        x = x + mixed
        h = self.post_attention_layernorm(x)
        x = x + (self.mlp(h, mesh) if isinstance(self.mlp, SparseMoeBlock) else self.mlp(h))
        return x, cache


class Qwen3_5TextModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, moe: bool):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, moe=moe)
                                for i in range(cfg.num_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)


class MultiTokenPredictor(nnx.Module):
    """The checkpoint's MTP head (``mtp.*``, vLLM's ``qwen3_5_mtp``): at position ``t`` it reads
    the target's final (normed) hidden state of ``t`` and the embedding of token ``t + 1``, and
    its logits (through the target's ``lm_head``) guess token ``t + 2``::

        x = fc([pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
        h' = norm(full-attention decoder layer(x))       # its own K/V pages, position t

    Drafts after the first feed ``h'`` back in with the draft just made, one position on
    (the one layer reused, as vLLM does). Embedding and LM head are the target's."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, moe: bool):
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        n = int(cfg.hf.get("mtp_num_hidden_layers") or 1)
        if n != 1:
            raise ValueError(f"speculative_config.method 'mtp': the checkpoint's head has {n} "
                             "layers (mtp_num_hidden_layers); one is supported")
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, eps=eps, dtype=dtype)
        self.fc = Linear(2 * h, h, bias=False, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, 0, dtype=dtype, rngs=rngs, moe=moe,
                                             kind="full_attention")])
        self.norm = GemmaRMSNorm(h, eps=eps, dtype=dtype)


# llama.cpp's Qwen 3.5 names: the Gated DeltaNet layers' fused q/k/v, output gate z, decay (a)
# and beta inputs; A_log without a suffix
_GGUF_LAYER_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj", "post_attention_norm": "post_attention_layernorm",
}
_GGUF_WHOLE_NAMES = {("ssm_a", None): "linear_attn.A_log",
                     ("ssm_dt", "bias"): "linear_attn.dt_bias"}


def gguf_config(a, cfg: dict, n_experts: int) -> None:
    """Qwen 3.5's HF config fields from llama.cpp's metadata. The GDN geometry is in llama.cpp's
    ``ssm.*`` keys (group count = K heads, time-step rank = V heads, state size = K head dim,
    inner size = all V channels); a layer is full attention when it has ``attn_q`` (llama.cpp
    derives the same from ``full_attention_interval``)."""
    n, tensor_names = cfg["num_hidden_layers"], a.names
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


def _grouped_v(t: np.ndarray, axis: int, n_k: int, per_k: int, dim: int) -> np.ndarray:
    """HF's V-head order along ``axis`` from llama.cpp's: tiled (k0v0, k1v0, k0v1, ...) ->
    grouped by K head (k0v0, k0v1, k1v0, ...), each head ``dim`` wide."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(per_k, n_k, dim, *rest).swapaxes(0, 1).reshape(n_k * per_k * dim, *rest)
    return np.ascontiguousarray(np.moveaxis(t, 0, axis))


def gguf_to_hf(name: str, w: np.ndarray, cfg: dict) -> np.ndarray:
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


class Qwen3_5ForCausalLM(ModelBase, nnx.Module):
    """Dense Qwen 3.5 / 3.6 (both checkpoint layouts)."""

    moe = False
    gguf = (GGUFArch("qwen35", "Qwen3_5ForCausalLM", "qwen3_5_text",
                     layer_names=_GGUF_LAYER_NAMES, whole_names=_GGUF_WHOLE_NAMES,
                     config=gguf_config, to_hf=gguf_to_hf),)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str | AttentionBackend = "reference"):
        if cfg.enable_expert_parallel and not self.moe:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
        self.num_layers = cfg.num_layers
        rope = _rope_params(cfg)
        rotary = int(cfg.head_dim * float(rope.get("partial_rotary_factor", 0.25)))
        self.rope = (rotary, cfg.rope_theta, cfg.max_position_embeddings)
        self.attention = resolve_attention_backend(attention_backend)
        self.mesh = None
        self.model = Qwen3_5TextModel(cfg, dtype=dtype, rngs=rngs, moe=self.moe)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype,
                               rngs=rngs))
        self.mtp = (MultiTokenPredictor(cfg, dtype=dtype, rngs=rngs, moe=self.moe)
                    if cfg.load_mtp else None)
        self.mrope_section = tuple(rope.get("mrope_section") or (11, 11, 10))
        self.visual = (Qwen3_5VisionModel(cfg.hf, dtype=dtype, rngs=rngs)
                       if cfg.hf.get("vision_config") else None)

    def cache_specs(self, dtype: str) -> list:
        """``FullAttention`` pages of ``dtype`` for attention layers, ``LinearState`` (float32,
        whatever the KV cache dtype) for the GDN layers; with the MTP head, its attention layer
        last (index ``num_layers``: one more layer of the attention group's page pool)."""
        specs = [layer.cache_spec(dtype) for layer in self.model.layers]
        if self.mtp is not None:
            specs.append(self.mtp.layers[0].cache_spec(dtype))
        return specs

    def _rope(self, positions):
        """cos, sin of text positions ``[T]``, or of M-RoPE positions ``[3, T]`` (temporal,
        height, width): frequency ``i`` takes height where ``i % 3 == 1`` and
        ``i < 3 * section[1]``, width where ``i % 3 == 2`` and ``i < 3 * section[2]``, else
        temporal (HF's interleaved layout; equal rows give the text rotary exactly)."""
        rotary, theta, max_pos = self.rope
        if positions.ndim == 1:
            return rope_cos_sin(positions, head_dim=rotary, theta=theta, scaling=None,
                                max_position_embeddings=max_pos)
        half = rotary // 2
        axis = np.zeros(half, np.int32)
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset:3 * self.mrope_section[dim]:3] = dim
        inv = 1.0 / (theta ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))
        pos = jnp.take(positions.astype(jnp.float32), jnp.asarray(axis), axis=0)  # [half, T]
        freqs = pos.T * jnp.asarray(inv.astype(np.float32))[None, :]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(emb), jnp.sin(emb)

    # The forward in pieces (as jaxserve.models.llama): the single program and the pipeline
    # stages run the same code.
    supports_pipeline = True

    def embed(self, token_ids):
        return self.model.embed_tokens(token_ids)

    def layer_inputs(self, positions, md: AttentionMetadata, num_tokens: int):
        """The rotary tables of the attention layers (partial rotary dims)."""
        return self._rope(positions)

    def run_layer(self, i: int, layer, x, inputs, cache, md, lora=None):
        """Layer ``i``: its pages (attention) or its state-pool arrays (Gated DeltaNet)."""
        if lora is not None:
            raise ValueError(f"{type(self).__name__} does not support LoRA adapters")
        cos, sin = inputs
        return layer(x, cos, sin, cache, md, self.attention, self.mesh)

    def encode_images(self, vision_inputs):
        """The vision tower: merged image embeddings ``[P / 4, hidden]``."""
        if self.visual is None:
            raise ValueError("this checkpoint has no vision tower (text-only model)")
        return self.visual(vision_inputs)

    def merge_multimodal(self, x, mm):
        """``mm`` = (image embeddings ``[E, H]``, row of each token ``[T]``, -1 for text): the
        image embeddings at their placeholders (positions are then M-RoPE ``[3, T]``)."""
        return merge_image_embeddings(x, *mm)

    def mtp_forward(self, next_token_ids, positions, hidden, kv, md: AttentionMetadata,
                    mm=None):
        """The MTP head over ``T`` tokens: ``hidden[T, H]`` (the target's normed output, or the
        head's own for a later draft) at ``positions`` (``[T]``, or M-RoPE ``[3, T]``),
        ``next_token_ids`` the token after each (``mm``: image embeddings and the image row
        of each next token, as :meth:`merge_multimodal`); ``kv`` its layer's pages. Returns
        (its normed hidden ``[T, H]``, kv)."""
        m = self.mtp
        e = self.model.embed_tokens(next_token_ids)
        if mm is not None:
            e = self.merge_multimodal(e, mm)
        e = m.pre_fc_norm_embedding(e)
        x = m.fc(jnp.concatenate([e, m.pre_fc_norm_hidden(hidden.astype(e.dtype))], axis=-1))
        cos, sin = self._rope(positions)
        x, kv = m.layers[0](x, cos, sin, kv, md, self.attention, self.mesh)
        return m.norm(x), kv

    @classmethod
    def param_partition_spec(cls, name: str, cfg: ModelConfig) -> PartitionSpec:
        if name.startswith("visual."):
            return PartitionSpec()  # the vision tower is small: every device holds it
        if ".linear_attn." in name:
            return _gdn_partition_spec(name)
        if cls.moe:
            return MoeForCausalLM.param_partition_spec(name, cfg)
        return megatron_partition_spec(name)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors):
        """The VL layout's ``model.language_model.*`` as ``model.*``, ``model.visual.*`` as
        ``visual.*``; the MTP head (``mtp.*``) dropped unless ``cfg.load_mtp``; GDN
        ``in_proj_qkv``/``conv1d`` split into q, k, v parts; MoE experts (fused
        ``gate_up_proj`` or per expert) stacked, the MTP layer's as well."""
        out = {}
        for name, load in tensors.items():
            if name.startswith(_VISUAL_PREFIXES):
                out["visual." + name.split("visual.", 1)[1]] = load
                continue
            if name.startswith(_MTP_PREFIXES):
                if not cfg.load_mtp:
                    continue
                name = name[name.index("mtp."):]
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            if name.endswith((".linear_attn.in_proj_qkv.weight", ".linear_attn.conv1d.weight")):
                out.update(_split_qkv(cfg, name, load))
                continue
            out[name] = load
        if cfg.load_mtp and not any(n.startswith("mtp.") for n in out):
            raise ValueError("speculative_config.method 'mtp' needs the checkpoint's multi-token-"
                             "prediction head, and this checkpoint has no mtp.* tensors")
        if cls.moe:
            # the MTP layer's experts go through the same conversions as a layer past the last
            n = cfg.num_layers
            mtp, virtual = "mtp.layers.0.", f"model.layers.{n}."
            out = {(virtual + k[len(mtp):] if k.startswith(mtp) else k): v
                   for k, v in out.items()}
            wide = dataclasses.replace(cfg, num_layers=n + 1) if cfg.load_mtp else cfg
            out = _fused_experts(wide, out)
            out = MoeForCausalLM.checkpoint_tensors(wide, out)
            out = {(mtp + k[len(virtual):] if k.startswith(virtual) else k): v
                   for k, v in out.items()}
        return out


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen 3.5 / 3.6 MoE (routed experts plus a gated shared expert in every layer)."""

    moe = True
    gguf = (GGUFArch("qwen35moe", "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text",
                     layer_names={**_GGUF_LAYER_NAMES, **GGUF_SHARED_EXPERT_NAMES},
                     whole_names=_GGUF_WHOLE_NAMES, experts=GGUF_EXPERTS, config=gguf_config,
                     to_hf=gguf_to_hf),)


def _gdn_partition_spec(name: str) -> PartitionSpec:
    """A GDN layer split over its heads: projections and conv weights by output rows, the
    per-head decay parameters by head, ``out_proj`` by input columns; the gated norm (one
    weight shared by every head) replicated."""
    tp = sharding.TP_AXIS
    if name.endswith(("out_proj.weight",)):
        return PartitionSpec(None, tp)
    if ".in_proj_" in name:
        return PartitionSpec(tp, None)
    if ".conv1d_" in name:
        return PartitionSpec(tp, None, None)
    if name.endswith(("A_log", "dt_bias")):
        return PartitionSpec(tp)
    return PartitionSpec()


def _split_qkv(cfg: ModelConfig, name: str, load) -> dict:
    """HF's fused ``[q | k | v]`` rows (``in_proj_qkv`` and the conv over them) as three
    tensors, so a row split under tensor parallelism keeps whole heads of each."""
    hf = cfg.hf
    kd = int(hf["linear_num_key_heads"]) * int(hf["linear_key_head_dim"])
    bounds = {"q": (0, kd), "k": (kd, 2 * kd), "v": (2 * kd, None)}
    proj = name.endswith("in_proj_qkv.weight")
    stem = name[:-len("in_proj_qkv.weight" if proj else "conv1d.weight")]
    return {stem + (f"in_proj_{p}.weight" if proj else f"conv1d_{p}.weight"):
            (lambda lo=lo, hi=hi: load()[lo:hi]) for p, (lo, hi) in bounds.items()}


def _fused_experts(cfg: ModelConfig, tensors: dict) -> dict:
    """transformers 5's fused expert tensors -> ours: ``gate_up_proj [E, 2I, H]`` splits into
    ``gate_proj``/``up_proj [E, H, I]``, ``down_proj [E, H, I]`` becomes ``[E, I, H]``."""
    out = dict(tensors)
    for layer in range(cfg.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gu = out.pop(prefix + "gate_up_proj", None)
        if gu is None:
            continue
        inter = int(cfg.hf["moe_intermediate_size"])
        out[prefix + "gate_proj"] = lambda f=gu: np.swapaxes(np.asarray(f())[:, :inter], 1, 2)
        out[prefix + "up_proj"] = lambda f=gu: np.swapaxes(np.asarray(f())[:, inter:], 1, 2)
        down = out.pop(prefix + "down_proj")
        out[prefix + "down_proj"] = lambda f=down: np.swapaxes(np.asarray(f()), 1, 2)
    return out

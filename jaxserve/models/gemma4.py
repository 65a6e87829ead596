"""Gemma 4 (text stack; dense and MoE) in Flax NNX.

Against Gemma 3: global (full-attention) layers have their own head_dim and KV-head count
(``global_head_dim`` / ``num_global_key_value_heads``, or transformers' ``per_layer_config``),
and with ``attention_k_eq_v`` their keys serve as values (``v_norm``, unscaled, on both);
the last ``num_kv_shared_layers`` layers write no KV and read the pages of the last earlier
layer of their type; every layer adds a per-layer input embedding (PLE) and is scaled by
``layer_scalar``; rope is per layer type ("proportional" with ``partial_rotary_factor`` on
global layers); the softmax scale is 1 (q/k are normalised); RMSNorm scales by ``w``, not
``1 + w``. With ``enable_moe_block`` a routed expert block runs beside the dense MLP.
State paths equal HF tensor names of ``Gemma4ForCausalLM``; the vision-language checkpoint's
``model.language_model.*`` is renamed to them and its towers are skipped.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_spec import FullAttention, SharedKV, SlidingWindow, group_layers
from jaxserve.models.attention import AttentionBackend, resolve_attention_backend
from jaxserve.models.contract import ModelBase, megatron_partition_spec
from jaxserve.models.gemma import GGUF_LAYER_NAMES as GEMMA_GGUF_LAYER_NAMES
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.layers import (
    AttentionMetadata,
    Embedding,
    MLP,
    activation,
    apply_rope,
    paged_self_attention,
)
from jaxserve.models.linear import Linear, lm_head_logits
from jaxserve.models.moe import Experts, _expert_specs

LOCAL, GLOBAL = "sliding_attention", "full_attention"
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
           "model.embed_audio.", "model.multi_modal_projector.")


@dataclass(frozen=True)
class LayerShape:
    """One layer's attention geometry and where its KV comes from."""

    kind: str  # LOCAL or GLOBAL
    head_dim: int
    kv_heads: int
    window: int | None
    producer: int | None  # the layer whose pages a KV-sharing layer reads; None: its own


def layer_types(hf: dict) -> tuple[str, ...]:
    """HF's rule: 5 sliding to 1 global unless given; the last layer is always global."""
    n = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or
                 [LOCAL if (i + 1) % 6 else GLOBAL for i in range(n)])
    types[-1] = GLOBAL
    return tuple(types)


def layer_shapes(hf: dict) -> tuple[LayerShape, ...]:
    """Per-layer head_dim / KV heads (``per_layer_config`` or the ``global_*`` fields) and the
    KV-sharing producers (the last non-sharing layer of the same type)."""
    types = layer_types(hf)
    n = len(types)
    head_dim = int(hf.get("head_dim") or 256)
    kv_heads = int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    per_layer = {int(k): v for k, v in (hf.get("per_layer_config") or {}).items()
                 if str(k).isdigit()}
    if not per_layer:
        glob = {"head_dim": int(hf.get("global_head_dim") or 512)}
        if k_eq_v and hf.get("num_global_key_value_heads"):
            glob["num_key_value_heads"] = int(hf["num_global_key_value_heads"])
        per_layer = {i: glob for i, t in enumerate(types) if t == GLOBAL}
    window = int(hf.get("sliding_window") or 512)
    shared = int(hf.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    if shared and first_shared <= 0:
        raise ValueError(f"num_kv_shared_layers={shared} leaves no layer that writes KV")
    out = []
    for i, t in enumerate(types):
        over = per_layer.get(i, {})
        producer = None
        if i >= first_shared:
            earlier = [j for j in range(first_shared) if types[j] == t]
            if not earlier:
                raise ValueError(f"layer {i} ({t}) shares KV but no earlier {t} layer writes it")
            producer = earlier[-1]
        out.append(LayerShape(t, int(over.get("head_dim", head_dim)),
                              int(over.get("num_key_value_heads", kv_heads)),
                              window if t == LOCAL else None, producer))
    return tuple(out)


def cache_specs_of(hf: dict, dtype: str) -> list:
    """Each layer's cache spec from the config alone (what the model declares)."""
    out = []
    for s in layer_shapes(hf):
        if s.producer is not None:
            out.append(SharedKV(s.producer))
        elif s.window is None:
            out.append(FullAttention(s.kv_heads, s.head_dim, dtype))
        else:
            out.append(SlidingWindow(s.window, s.kv_heads, s.head_dim, dtype))
    return out


def _check_supported(hf: dict) -> None:
    # "vision": an image's soft tokens see each other on the sliding layers (md.kv_limit)
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise ValueError("use_bidirectional_attention "
                         f"{hf['use_bidirectional_attention']!r} is not supported for Gemma 4")
    if hf.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Gemma 4")


def _rope_inv_freq(hf: dict, kind: str, head_dim: int) -> np.ndarray:
    """Inverse frequencies ``[head_dim / 2]`` of one layer type (float32, as HF computes them):
    "default", or "proportional" (the first ``partial_rotary_factor`` of the angles rotate, the
    rest are zero, i.e. not rotated)."""
    params = dict((hf.get("rope_parameters") or {}).get(kind) or
                  ({"rope_type": "default", "rope_theta": 10_000.0} if kind == LOCAL else
                   {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                    "rope_theta": 1_000_000.0}))
    base = float(params.get("rope_theta", 10_000.0))
    kind_ = params.get("rope_type", "default")
    if kind_ == "default":
        exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        return (1.0 / (np.float32(base) ** exps)).astype(np.float32)
    if kind_ == "proportional":
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        exps = np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(head_dim)
        inv = 1.0 / (np.float32(base) ** exps)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv / np.float32(params.get("factor", 1.0))).astype(np.float32)
    raise ValueError(f"rope_type {kind_!r} of {kind} layers is not supported for Gemma 4 "
                     "(supported: default, proportional)")


def _cos_sin(positions, inv_freq: tuple[float, ...]):
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Gemma4RMSNorm(nnx.Module):
    """HF's Gemma 4 RMSNorm: normalise in float32, scale by ``w`` (or not), cast back."""

    def __init__(self, dim: int, *, eps: float, dtype, with_scale: bool = True):
        self.weight = nnx.data(nnx.Param(jnp.ones((dim,), dtype)) if with_scale else None)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            xf = xf * self.weight[...].astype(jnp.float32)
        return xf.astype(x.dtype)


class Gemma4Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, shape: LayerShape, *, dtype, rngs: nnx.Rngs):
        h, d, eps = cfg.hidden_size, shape.head_dim, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, shape.kv_heads, d
        self.layer_type, self.sliding_window, self.producer = (shape.kind, shape.window,
                                                               shape.producer)
        self.kv_scale = None  # static ((k_scale, v_scale),) * Hkv of float8 pages: kv_scales
        lin = dict(bias=False, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d, **lin)
        self.q_norm = Gemma4RMSNorm(d, eps=eps, dtype=dtype)
        self.o_proj = Linear(cfg.num_heads * d, h, **lin)
        owns = shape.producer is None  # a KV-sharing layer has no k/v weights
        k_eq_v = bool(cfg.hf.get("attention_k_eq_v")) and shape.kind == GLOBAL
        self.k_proj = nnx.data(Linear(h, shape.kv_heads * d, **lin) if owns else None)
        self.v_proj = nnx.data(Linear(h, shape.kv_heads * d, **lin)
                               if owns and not k_eq_v else None)
        self.k_norm = nnx.data(Gemma4RMSNorm(d, eps=eps, dtype=dtype) if owns else None)
        self.v_norm = nnx.data(Gemma4RMSNorm(d, eps=eps, dtype=dtype, with_scale=False)
                               if owns else None)

    def cache_spec(self, dtype: str):
        if self.producer is not None:
            return SharedKV(self.producer)
        if self.sliding_window is None:
            return FullAttention(self.num_kv_heads, self.head_dim, dtype)
        return SlidingWindow(self.sliding_window, self.num_kv_heads, self.head_dim, dtype)

    def __call__(self, x, cos, sin, kv, md: AttentionMetadata, backend: AttentionBackend,
                 mesh=None):
        """``kv``: this layer's pages, or (KV-sharing layer) its producer's, read only. Image
        tokens see each other both ways (``md.kv_limit``) on sliding layers only, as HF's
        ``create_masks_for_vision_model``: global layers stay causal."""
        t = x.shape[0]
        if self.sliding_window is None and md.kv_limit is not None:
            md = md._replace(kv_limit=None)
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(t, self.num_heads, self.head_dim)),
                       cos, sin)
        if self.producer is not None:
            out = attend_pages(q, kv, md, backend=backend, mesh=mesh,
                               sliding_window=self.sliding_window)
            return self.o_proj(out.reshape(t, -1)), kv
        k_raw = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v_raw = k_raw if self.v_proj is None else self.v_proj(x).reshape(t, self.num_kv_heads,
                                                                          self.head_dim)
        k = apply_rope(self.k_norm(k_raw), cos, sin)
        v = self.v_norm(v_raw)
        out, kv = paged_self_attention(q, k, v, kv, md, backend=backend, mesh=mesh,
                                       num_kv_heads=self.num_kv_heads, sm_scale=1.0,
                                       sliding_window=self.sliding_window,
                                       kv_scale=self.kv_scale)
        return self.o_proj(out.reshape(t, -1)), kv


def attend_pages(q, kv, md: AttentionMetadata, *, backend: AttentionBackend, mesh,
                 sliding_window):
    """Attention of ``q [T, Hq, D]`` over pages another layer wrote (no KV write); under a
    mesh, one kernel call per shard of heads."""
    return _attend_only(backend, sliding_window, mesh)(q, kv[0], kv[1], md)


@functools.lru_cache(maxsize=None)
def _attend_only(backend: AttentionBackend, sliding_window: int | None, mesh):
    def attend(q, k_pages, v_pages, md):
        return backend.attend(q, k_pages, v_pages, md, sm_scale=1.0,
                              sliding_window=sliding_window)

    if mesh is not None:
        heads, pages = PartitionSpec(None, sharding.TP_AXIS, None), PartitionSpec(sharding.TP_AXIS)
        attend = sharding._shard_map(attend, mesh, in_specs=(heads, pages, pages, PartitionSpec()),
                                     out_specs=heads)
    return jax.jit(attend)


class Gemma4Router(nnx.Module):
    """Unscaled RMSNorm, ``scale * H^-1/2``, softmax over experts, top-k renormalised, times
    each chosen expert's ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig, n: int, *, dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.norm = Gemma4RMSNorm(h, eps=cfg.rms_norm_eps, dtype=dtype, with_scale=False)
        self.proj = Linear(h, n, bias=False, dtype=dtype, rngs=rngs)
        self.scale = nnx.Param(jnp.ones((h,), dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((n,), dtype))
        self.root = float(h) ** -0.5
        self.top_k = int(cfg.hf.get("top_k_experts") or 1)

    def __call__(self, x):
        hs = self.norm(x) * self.scale[...] * jnp.asarray(self.root, x.dtype)
        probs = jax.nn.softmax(self.proj(hs).astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights * self.per_expert_scale[...][ids].astype(jnp.float32), ids


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shape: LayerShape, *, dtype,
                 rngs: nnx.Rngs):
        h, eps, hf = cfg.hidden_size, cfg.rms_norm_eps, cfg.hf
        norm = functools.partial(Gemma4RMSNorm, h, eps=eps, dtype=dtype)
        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(cfg, shape, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        wide = 2 if hf.get("use_double_wide_mlp") and shape.producer is not None else 1
        self.mlp = MLP(h, cfg.intermediate_size * wide, act=cfg.hidden_act, dtype=dtype,
                       rngs=rngs)
        self.post_feedforward_layernorm = norm()
        self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))
        ple = int(hf.get("hidden_size_per_layer_input") or 0)
        lin = dict(bias=False, dtype=dtype, rngs=rngs)
        self.per_layer_input_gate = nnx.data(Linear(h, ple, **lin) if ple else None)
        self.per_layer_projection = nnx.data(Linear(ple, h, **lin) if ple else None)
        self.post_per_layer_input_norm = nnx.data(norm() if ple else None)
        moe = bool(hf.get("enable_moe_block"))
        self.num_experts = int(hf["num_experts"]) if moe else 0
        self.expert_parallel = cfg.enable_expert_parallel
        self.router = nnx.data(Gemma4Router(cfg, self.num_experts, dtype=dtype, rngs=rngs)
                               if moe else None)
        self.experts = nnx.data(Experts(self.num_experts, h,
                                              int(hf.get("moe_intermediate_size") or 0),
                                              dtype=dtype, rngs=rngs) if moe else None)
        if moe:
            self.post_feedforward_layernorm_1 = norm()
            self.post_feedforward_layernorm_2 = norm()
            self.pre_feedforward_layernorm_2 = norm()

    def _experts(self, residual, mesh):
        weights, ids = self.router(residual)
        x = self.pre_feedforward_layernorm_2(residual)
        out = self.experts(x, weights, ids, act=self.mlp.act,
                           expert_parallel=self.expert_parallel, mesh=mesh)
        return out.astype(residual.dtype)

    def __call__(self, x, per_layer_input, cos, sin, kv, md, backend, mesh=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, backend, mesh)
        x = x + self.post_attention_layernorm(attn)
        residual = x
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:
            h = (self.post_feedforward_layernorm_1(h)
                 + self.post_feedforward_layernorm_2(self._experts(residual, mesh)))
        x = residual + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            g = activation(self.mlp.act)(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar[...], kv


class Gemma4Model(nnx.Module):
    def __init__(self, cfg: ModelConfig, shapes, *, dtype, rngs: nnx.Rngs):
        hf = cfg.hf
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Gemma4DecoderLayer(cfg, i, s, dtype=dtype, rngs=rngs)
                                for i, s in enumerate(shapes)])
        self.norm = Gemma4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        ple = int(hf.get("hidden_size_per_layer_input") or 0)
        n = cfg.num_layers * ple
        vocab = int(hf.get("vocab_size_per_layer_input") or cfg.vocab_size)
        self.embed_tokens_per_layer = nnx.data(
            Embedding(vocab, n, dtype=dtype, rngs=rngs) if ple else None)
        self.per_layer_model_projection = nnx.data(
            Linear(cfg.hidden_size, n, bias=False, dtype=dtype, rngs=rngs) if ple else None)
        self.per_layer_projection_norm = nnx.data(
            Gemma4RMSNorm(ple, eps=cfg.rms_norm_eps, dtype=dtype) if ple else None)


# llama.cpp's Gemma 4 names beyond Gemma 2's: the MoE block's own norms beside the dense MLP's,
# per-layer input embeddings (PLE); scalars and router scales without ``.weight``, and the
# experts kept stacked (HF's layout is fused ``[E, 2I, H]`` and ``[E, H, I]``)
_GGUF_LAYER_NAMES = {
    **GEMMA_GGUF_LAYER_NAMES,
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
_GGUF_WHOLE_NAMES = {("layer_output_scale", "weight"): "layer_scalar",
                     ("ffn_gate_inp", "weight"): "router.proj.weight",
                     ("ffn_gate_inp", "scale"): "router.scale",
                     ("ffn_down_exps", "scale"): "router.per_expert_scale",
                     ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
                     ("ffn_down_exps", "weight"): "experts.down_proj"}
_GGUF_GLOBAL_NAMES = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def gguf_config(a, cfg: dict, n_experts: int) -> None:
    """Gemma 4's HF config fields from llama.cpp's metadata. llama.cpp writes the global layers'
    head dim as ``key_length`` and the sliding ones' as ``key_length_swa``, KV heads per layer,
    the local layers as a bool per layer, and ``attention_k_eq_v`` only as global layers without
    ``attn_v``; proportional rope becomes ``rope_freqs`` (1 for each rotated pair, 1e30 for the
    rest)."""
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
    tensor_names, rows = a.names, a.rows  # rows: a matrix's output rows

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
    if "rope_freqs.weight" in tensor_names:
        f = np.asarray(a.array("rope_freqs.weight"), np.float64).ravel()
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



class Gemma4ForCausalLM(ModelBase, nnx.Module):
    """Gemma 4 text (``Gemma4ForCausalLM`` and the language model of
    ``Gemma4ForConditionalGeneration``); ``kv_pages``: one ``(k, v)`` per layer of the layer's
    own shape, ``()`` for a KV-sharing layer."""

    # reads md with one block table / slot mapping per cache group ([G, ...]) and picks each
    # layer's group's (the runner then gives every group a pool of its own)
    cache_groups_supported = True
    gguf = (GGUFArch("gemma4", "Gemma4ForCausalLM", "gemma4_text", per_layer_kv_heads=True,
                     own_rope_freqs=True, layer_names=_GGUF_LAYER_NAMES,
                     whole_names=_GGUF_WHOLE_NAMES, global_names=_GGUF_GLOBAL_NAMES,
                     config=gguf_config),)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str | AttentionBackend = "reference"):
        _check_supported(cfg.hf)
        shapes = layer_shapes(cfg.hf)
        groups = group_layers(cache_specs_of(cfg.hf, "any"))
        of_layer = {i: g for g, grp in enumerate(groups) for i in grp.layers + grp.readers}
        self.layer_group = tuple(of_layer[i] for i in range(len(shapes)))  # static
        self.num_layers = cfg.num_layers
        self.attention = resolve_attention_backend(attention_backend)
        self.mesh = None
        self.hidden_size = cfg.hidden_size
        self.ple = int(cfg.hf.get("hidden_size_per_layer_input") or 0)
        # static per-type inverse frequencies (hashable: the graph is a jit cache key)
        self.ropes = tuple(sorted(
            (s.kind, tuple(float(f) for f in _rope_inv_freq(cfg.hf, s.kind, s.head_dim)))
            for s in {(sh.kind, sh.head_dim): sh for sh in shapes}.values()))
        cap = cfg.hf.get("final_logit_softcapping")
        self.final_soft_cap = float(cap) if cap else None
        self.model = Gemma4Model(cfg, shapes, dtype=dtype, rngs=rngs)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs))

    def _per_layer_inputs(self, token_ids, x):
        """PLE: (context projection + token embedding) / sqrt 2, ``[T, L, P]``."""
        m, t, L = self.model, token_ids.shape[0], self.num_layers
        tok = m.embed_tokens_per_layer(token_ids)
        tok = (tok * jnp.asarray(float(self.ple) ** 0.5, tok.dtype)).reshape(t, L, self.ple)
        proj = m.per_layer_model_projection(x) * jnp.asarray(self.hidden_size ** -0.5, x.dtype)
        proj = m.per_layer_projection_norm(proj.reshape(t, L, self.ple))
        return (proj + tok) * jnp.asarray(2.0 ** -0.5, x.dtype)

    # The forward in pieces (as jaxserve.models.llama): the single program and the pipeline
    # stages run the same code. With PLE the hidden state carried from layer to layer (and
    # from stage to stage) is ``(x, per-layer inputs [T, L, P])``.
    supports_pipeline = True

    def embed(self, token_ids):
        x = self.model.embed_tokens(token_ids)
        x = x * jnp.asarray(float(self.hidden_size) ** 0.5, x.dtype)
        return (x, self._per_layer_inputs(token_ids, x)) if self.ple else x

    def layer_inputs(self, positions, md: AttentionMetadata, num_tokens: int):
        """The rotary tables of each layer type."""
        return {kind: _cos_sin(positions, inv) for kind, inv in self.ropes}

    def run_layer(self, i: int, layer, x, inputs, kv, md, lora=None):
        """Layer ``i`` of ``model.layers``; a KV-sharing layer gets its producer's pages."""
        if lora is not None:
            raise ValueError(f"{type(self).__name__} does not support LoRA adapters")
        x, pli = x if self.ple else (x, None)
        cos, sin = inputs[layer.self_attn.layer_type]
        if md.block_tables.ndim == 3:  # pools per group: this layer's group's tables
            g = self.layer_group[i]
            md = md._replace(slot_mapping=md.slot_mapping[g], block_tables=md.block_tables[g])
        x, kv = layer(x, None if pli is None else pli[:, i], cos, sin, kv, md,
                      self.attention, self.mesh)
        return ((x, pli) if self.ple else x), kv

    def final_hidden(self, x):
        return self.model.norm(x[0] if self.ple else x)

    def compute_logits(self, hidden):
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = lm_head_logits(head, hidden)
        if self.final_soft_cap is not None:
            logits = self.final_soft_cap * jnp.tanh(logits / self.final_soft_cap)
        return logits

    @classmethod
    def param_partition_spec(cls, name: str, cfg: ModelConfig) -> PartitionSpec:
        last = name.rsplit(".", 1)[-1]
        if ".experts." in name and last in ("gate_proj", "up_proj", "down_proj"):
            return dict(zip(("gate_proj", "up_proj", "down_proj"),
                            _expert_specs(cfg.enable_expert_parallel)))[last]
        if ".router." in name or "per_layer" in name:
            return PartitionSpec()
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # a layer's KV heads may be fewer than the devices (global layers): replicated,
            # and the attention repeats them per device like the pool does
            layer = int(name.split(".")[2])
            if layer_shapes(cfg.hf)[layer].kv_heads != cfg.num_kv_heads:
                return PartitionSpec()
        return megatron_partition_spec(name)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors):
        """``model.language_model.*`` -> ``model.*`` (towers skipped), KV-sharing layers' unused
        k/v weights dropped, fused ``experts.gate_up_proj [E, 2I, H]`` -> ``gate_proj`` /
        ``up_proj [E, H, I]``, ``down_proj [E, H, I]`` -> ``[E, I, H]`` (lazy)."""
        out = {}
        for name, load in tensors.items():
            if name.startswith(_TOWERS):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            out[name] = load
        shapes = layer_shapes(cfg.hf)
        inter = int(cfg.hf.get("moe_intermediate_size") or 0)
        for i, s in enumerate(shapes):
            p = f"model.layers.{i}."
            if s.producer is not None:
                for part in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    for nm in [n for n in out if n.startswith(f"{p}self_attn.{part}.")]:
                        del out[nm]
            gate_up = out.pop(p + "experts.gate_up_proj", None)
            if gate_up is not None:
                out[p + "experts.gate_proj"] = functools.partial(_expert_half, gate_up, 0, inter)
                out[p + "experts.up_proj"] = functools.partial(_expert_half, gate_up, 1, inter)
            down = out.get(p + "experts.down_proj")
            if down is not None:
                out[p + "experts.down_proj"] = functools.partial(_transposed, down)
        return out


def _expert_half(load, half: int, inter: int):
    arr = np.asarray(load())
    return np.ascontiguousarray(arr[:, half * inter:(half + 1) * inter].transpose(0, 2, 1))


def _transposed(load):
    return np.ascontiguousarray(np.asarray(load()).transpose(0, 2, 1))

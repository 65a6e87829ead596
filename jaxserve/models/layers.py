"""Building blocks of the decoder families: embeddings, norms, rotary embeddings, the gated MLP,
paged attention (projections: ``jaxserve.models.linear``).

Parameters keep Hugging Face's names and layouts (a linear weight is ``[out, in]``), so a
checkpoint's tensor names are exactly the model's state paths and loading needs no renaming.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.models import batch_invariant
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.linear import Linear, normal, project, project_many
from pallas_kernels import reference


class Embedding(nnx.Module):
    def __init__(self, num_embeddings: int, features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal(rngs, (num_embeddings, features), dtype))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class LayerNorm(nnx.Module):
    """LayerNorm with ``weight`` and ``bias`` (BERT, vision towers), in float32, the result in
    the input's dtype."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32)
                + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """HF's RMSNorm: normalise in float32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        ms = (batch_invariant.row_mean(xf * xf, keepdims=True) if batch_invariant.enabled()
              else jnp.mean(xf * xf, axis=-1, keepdims=True))
        xf = xf * jax.lax.rsqrt(ms + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


# HF ``hidden_act`` names -> the gate activation of a gated MLP.
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


def activation(name: str):
    """The activation named by an HF config; unknown names list the supported ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported "
                         f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with gelu-tanh)."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, dtype, rngs: nnx.Rngs):
        activation(act)
        self.act = act
        self.gate_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, intermediate, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, lora=None):
        gate, up = project_many([self.gate_proj, self.up_proj], x, lora, ("gate_proj", "up_proj"))
        return project(self.down_proj, ACTIVATIONS[self.act](gate) * up, lora, "down_proj")


# ----------------------------------------------------------------------------- rotary embeddings

def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    return 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Static inverse frequencies ``[head_dim/2]`` and the cos/sin scale, as HF computes them.

    "dynamic" scaling depends on the sequence length; it is handled per token in
    :func:`rope_cos_sin` and returns the unscaled frequencies here; "longrope" returns its
    short-context frequencies (the long ones are :func:`longrope_long_inv_freq`).
    """
    inv = _base_inv_freq(theta, head_dim)
    kind = (scaling or {}).get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return inv.astype(np.float32), 1.0
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, max_position_embeddings, long=False)
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).astype(np.float32), 1.0
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if kind == "yarn":
        orig = float(scaling.get("original_max_position_embeddings") or max_position_embeddings)

        def mscale_of(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = (mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all
                    else mscale_of(factor))
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rot):
            return head_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrap = 1 - ramp
        out = (inv / factor) * (1 - extrap) + inv * extrap
        return out.astype(np.float32), float(attn)
    raise ValueError(f"rope_scaling type {kind!r} is not supported "
                     "(supported: default, linear, dynamic, llama3, yarn, longrope)")


def _longrope(head_dim: int, theta: float, scaling: dict, max_position_embeddings: int, *,
              long: bool) -> tuple[np.ndarray, float]:
    """Phi-3's LongRoPE: per-frequency rescale factors, short or long, and an attention factor
    from the context extension ratio (HF's rule)."""
    orig = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position_embeddings / orig
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = np.asarray(scaling["long_factor" if long else "short_factor"], np.float32)
    exps = (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    inv = 1.0 / (ext * np.float32(theta) ** exps)
    return inv.astype(np.float32), float(attn)


def longrope_long_inv_freq(head_dim: int, theta: float, scaling: dict,
                           max_position_embeddings: int) -> np.ndarray:
    return _longrope(head_dim, theta, scaling, max_position_embeddings, long=True)[0]


def rope_cos_sin(positions, *, head_dim: int, theta: float, scaling: dict | None,
                 max_position_embeddings: int, token_seq_lens=None):
    """cos, sin ``[T, head_dim]`` (float32) for absolute ``positions[T]``.

    ``token_seq_lens[T]`` (each token's sequence length after this step) drives "dynamic" NTK
    scaling, which HF applies per forward from the current sequence length.
    """
    inv, attn = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    pos = positions.astype(jnp.float32)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "dynamic":
        if token_seq_lens is None:
            raise ValueError("dynamic rope scaling needs token_seq_lens")
        factor = float(scaling["factor"])
        max_pos = float(max_position_embeddings)
        seq = jnp.maximum(token_seq_lens.astype(jnp.float32), max_pos)
        base = theta * ((factor * seq / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
        exps = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
        inv_t = 1.0 / (base[:, None] ** exps[None, :])
        freqs = pos[:, None] * inv_t
    elif kind == "longrope":  # a sequence past the original context uses the long factors
        if token_seq_lens is None:
            raise ValueError("longrope scaling needs token_seq_lens")
        long_inv = longrope_long_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        is_long = token_seq_lens[:, None] > int(scaling["original_max_position_embeddings"])
        freqs = pos[:, None] * jnp.where(is_long, jnp.asarray(long_inv)[None, :],
                                         jnp.asarray(inv)[None, :])
    else:
        freqs = pos[:, None] * jnp.asarray(inv)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attn, jnp.sin(emb) * attn


def apply_rope(x, cos, sin):
    """HF's rotate-half rotary embedding; ``x`` is ``[T, H, D]``, cos/sin ``[T, D]``."""
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- paged attention

class AttentionMetadata(NamedTuple):
    """Where this step's tokens go and what they attend to (a pytree; all int32)."""

    slot_mapping: jax.Array  # [T] page*block_size+offset of each new token (trash page for pad)
    query_start: jax.Array  # [S+1] prefix sums of new tokens per sequence
    seq_lens: jax.Array  # [S] context length after this step; 0 = padding row
    block_tables: jax.Array  # [S, M] pages of each sequence
    num_seqs: jax.Array  # scalar: real rows
    state_slots: jax.Array | None = None  # [S] state-pool slot of each row (LinearState layers)
    # [S, k+1] where a verify row's state after each of its tokens is kept (-1: not kept), so
    # a step that rejects drafts can resume from the last accepted token (speculative decoding)
    snapshot_slots: jax.Array | None = None
    # [T] the last key position each token sees where later than its own (a run of tokens
    # that see each other: Gemma 4's image tokens on its sliding layers); None: causal
    kv_limit: jax.Array | None = None


def paged_self_attention(q, k, v, kv, md: AttentionMetadata, *, backend: AttentionBackend,
                         mesh, num_kv_heads: int, sm_scale: float,
                         sliding_window: int | None = None, soft_cap: float | None = None,
                         kv_scale=None):
    """Write this step's ``k, v [T, Hkv, D]`` into one layer's pages ``kv`` and attend with
    ``q [T, Hq, D]`` through ``backend``; under a mesh, one kernel call per shard of heads.
    -> (out, (k, v pages)).

    ``kv_scale``: the layer's static ``((k_scale, v_scale),) * Hkv`` (see ``kv_scales``), used
    only when the pages are float8: serving-dtype pages never see a scale."""
    scales = None
    if kv_scale is not None and reference.is_fp8(kv[0].dtype):
        scales = tuple((float(a), float(b)) for a, b in
                       np.asarray(kv_scale, np.float64).reshape(num_kv_heads, 2))
    rep = kv[0].shape[0] // num_kv_heads  # the pool repeats KV heads when tp > Hkv
    if mesh is not None and rep > 1:
        k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    attend = _write_and_attend(backend, sm_scale, sliding_window, soft_cap, mesh, scales, rep)
    out, k_pages, v_pages = attend(q, k, v, kv[0], kv[1], md)
    return out, (k_pages, v_pages)


@functools.lru_cache(maxsize=None)
def _write_and_attend(backend: AttentionBackend, sm_scale: float, sliding_window: int | None,
                      soft_cap: float | None, mesh, scales: tuple | None, rep: int):
    """The KV write and the attention of one layer as a jit of its own: every layer of a step
    calls the same function (layers with equal settings and scales), so it is traced and
    lowered once per step graph, not once per layer (XLA inlines the calls: the compiled step
    is the same)."""

    def attend(q, k, v, k_pages, v_pages, md):
        sc = None if scales is None else jnp.asarray(scales, jnp.float32)
        if sc is not None and mesh is not None:  # this shard's heads of the full table
            n = k_pages.shape[0]
            sc = jax.lax.dynamic_slice_in_dim(jnp.repeat(sc, rep, axis=0),
                                              jax.lax.axis_index(sharding.TP_AXIS) * n, n)
        return backend.write_and_attend(q, k, v, k_pages, v_pages, md, sm_scale=sm_scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap,
                                        kv_scale=sc, sharded=mesh is not None)

    if mesh is not None:
        attend = sharding.sharded_attention(attend, mesh)
    return jax.jit(attend)

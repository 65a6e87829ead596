"""The Qwen 3.5 / 3.6 vision tower (HF ``Qwen3_5VisionModel``): a ViT over (temporal, height,
width) patches whose output, merged 2x2, becomes language-model embeddings at an image's
placeholder tokens.

    patches [P, C*Tp*ps*ps] --patch_embed (Conv3d, stride = kernel: a linear)--> [P, E]
    + learned position table [n*n, E] resampled bilinearly to each image's grid (align corners)
    -> blocks: LayerNorm, full attention within one frame with 2-D rotary (h, w), MLP
    -> merger: LayerNorm, every ``m*m`` consecutive patches (the processor's block order)
       concatenated, fc1, GELU, fc2 -> [P / m^2, out_hidden_size]

The device function sees only fixed-shape arrays: the host builds, per batch of images, the
interpolation taps, the rotary (h, w) ids and a segment id per patch (``-1`` = padding) with
:func:`vision_inputs`, so one compiled program serves any mix of image sizes up to a bucket.
Attention is dense with a segment mask (images are short: a 1 MP image is ~4k patches).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.layers import ACTIVATIONS, Embedding, LayerNorm
from jaxserve.models.linear import Linear, normal


class VisionInputs(NamedTuple):
    """One encoder batch, padded to ``P`` patches (a multiple of the merge unit)."""

    pixels: jax.Array      # [P, C*Tp*ps*ps] float
    interp_idx: jax.Array  # [P, 4] int32: taps into the position table
    interp_w: jax.Array    # [P, 4] float32
    rope_hw: jax.Array     # [P, 2] int32: (h, w) of each patch
    segment: jax.Array     # [P] int32: frame index (attention block), -1 = padding


def vision_config(hf: dict) -> dict:
    """The checkpoint's ``vision_config`` with HF's defaults filled in."""
    v = dict(hf.get("vision_config") or {})
    if not v:
        raise ValueError("the checkpoint has no vision_config: it is a text-only model")
    d = dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
             num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2,
             temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304)
    d.update({k: v[k] for k in v if v[k] is not None})
    rope = d.get("rope_parameters") or {}
    d["rope_theta"] = float(rope.get("rope_theta", 10000.0))
    return d


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int):
    """Bilinear taps (align corners) of target ``index`` on an axis of ``size`` into ``side``."""
    src = index.astype(np.float32) * (side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights.astype(np.float32)


def vision_inputs(pixels: np.ndarray, grids, *, cfg: dict, num_patches: int) -> VisionInputs:
    """Host-side arrays for ``pixels`` (the processor's rows, images concatenated) of images
    with patch grids ``grids`` [(t, h, w)], padded to ``num_patches``. Numpy only."""
    m = int(cfg["spatial_merge_size"])
    side = int(int(cfg["num_position_embeddings"]) ** 0.5)
    total = int(sum(t * h * w for t, h, w in grids))
    if pixels.shape[0] != total:
        raise ValueError(f"pixel_values has {pixels.shape[0]} patches, the grids {total}")
    if num_patches < total or num_patches % (m * m):
        raise ValueError(f"num_patches {num_patches} must cover {total} and divide by {m * m}")
    idx, wts, hw, seg = [], [], [], []
    frame = 0
    for t, h, w in grids:
        within = np.arange(h * w)
        in_col, in_row = within % m, (within // m) % m
        block_col, block_row = (within // (m * m)) % (w // m), within // (m * m * (w // m))
        row, col = block_row * m + in_row, block_col * m + in_col
        ht, hwgt = _axis_taps(row, np.full_like(row, h), side)
        wt, wwgt = _axis_taps(col, np.full_like(col, w), side)
        i = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
        wgt = (hwgt[:, :, None] * wwgt[:, None, :]).reshape(-1, 4)
        for _ in range(t):
            idx.append(i)
            wts.append(wgt)
            hw.append(np.stack([row, col], axis=-1))
            seg.append(np.full(h * w, frame))
            frame += 1
    pad = num_patches - total

    def cat(parts, fill, dtype):
        a = np.concatenate(parts, axis=0).astype(dtype)
        return np.concatenate([a, np.full((pad,) + a.shape[1:], fill, dtype)], axis=0)

    px = np.concatenate([pixels, np.zeros((pad,) + pixels.shape[1:], pixels.dtype)], axis=0)
    return VisionInputs(px.astype(np.float32), cat(idx, 0, np.int32), cat(wts, 0, np.float32),
                        cat(hw, 0, np.int32), cat(seg, -1, np.int32))


def merge_image_embeddings(x, embeds, rows):
    """``x[T, H]`` with token ``t`` replaced by ``embeds[rows[t]]`` where ``rows[t] >= 0``."""
    picked = jnp.take(embeds.astype(x.dtype), jnp.maximum(rows, 0), axis=0)
    return jnp.where((rows >= 0)[:, None], picked, x)


class PatchEmbed(nnx.Module):
    """HF's ``Conv3d`` with stride = kernel: one linear over each flattened patch."""

    def __init__(self, c: dict, *, dtype, rngs: nnx.Rngs):
        k = (int(c["temporal_patch_size"]), int(c["patch_size"]), int(c["patch_size"]))
        e = int(c["hidden_size"])
        self.weight = nnx.Param(normal(rngs, (e, int(c["in_channels"])) + k, dtype))
        self.bias = nnx.Param(jnp.zeros((e,), dtype))

    def __call__(self, pixels):
        w = self.weight[...]
        w = w.reshape(w.shape[0], -1)
        return pixels.astype(w.dtype) @ w.T + self.bias[...]


class _Conv(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        self.proj = PatchEmbed(c, dtype=dtype, rngs=rngs)


class VisionAttention(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs: nnx.Rngs):
        e = int(c["hidden_size"])
        self.num_heads = int(c["num_heads"])
        self.qkv = Linear(e, 3 * e, bias=True, dtype=dtype, rngs=rngs)
        self.proj = Linear(e, e, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        p = x.shape[0]
        qkv = self.qkv(x).reshape(p, 3, self.num_heads, -1)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        d = q.shape[-1]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * d ** -0.5
        s = jnp.where(mask[None], s, -jnp.inf)
        pr = jax.nn.softmax(s, axis=-1)
        pr = jnp.where(mask[None], pr, 0.0)  # padding rows see nothing
        o = jnp.einsum("hqk,khd->qhd", pr, v.astype(jnp.float32)).astype(x.dtype)
        return self.proj(o.reshape(p, -1))


def _rotate(x, cos, sin):
    """Rotate-half over the whole head, in float32 (as HF), cast back."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


class VisionMLP(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs: nnx.Rngs):
        e, i = int(c["hidden_size"]), int(c["intermediate_size"])
        self.act = c["hidden_act"]
        if self.act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.act!r} is not supported")
        self.linear_fc1 = Linear(e, i, bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(i, e, bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.linear_fc2(ACTIVATIONS[self.act](self.linear_fc1(x)))


class VisionBlock(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs: nnx.Rngs):
        e = int(c["hidden_size"])
        self.norm1 = LayerNorm(e, eps=1e-6, dtype=dtype)
        self.norm2 = LayerNorm(e, eps=1e-6, dtype=dtype)
        self.attn = VisionAttention(c, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(c, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs: nnx.Rngs):
        e, m = int(c["hidden_size"]), int(c["spatial_merge_size"])
        self.width = e * m * m
        self.norm = LayerNorm(e, eps=1e-6, dtype=dtype)
        self.linear_fc1 = Linear(self.width, self.width, bias=True, dtype=dtype, rngs=rngs)
        self.linear_fc2 = Linear(self.width, int(c["out_hidden_size"]), bias=True, dtype=dtype,
                                 rngs=rngs)

    def __call__(self, x):
        x = self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class Qwen3_5VisionModel(nnx.Module):
    """Parameters under HF's names (``model.visual.*`` in the checkpoint)."""

    def __init__(self, hf: dict, *, dtype, rngs: nnx.Rngs):
        c = vision_config(hf)
        self.merge = int(c["spatial_merge_size"])
        self.head_dim = int(c["hidden_size"]) // int(c["num_heads"])
        self.theta = c["rope_theta"]
        self.patch_embed = _Conv(c, dtype=dtype, rngs=rngs)
        self.pos_embed = Embedding(int(c["num_position_embeddings"]), int(c["hidden_size"]),
                                   dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([VisionBlock(c, dtype=dtype, rngs=rngs)
                                for _ in range(int(c["depth"]))])
        self.merger = PatchMerger(c, dtype=dtype, rngs=rngs)

    def __call__(self, inp: VisionInputs):
        """Merged embeddings ``[P / m^2, out_hidden_size]`` (rows of padding are garbage)."""
        x = self.patch_embed.proj(inp.pixels)
        table = self.pos_embed.weight[...]
        pos = jnp.sum(jnp.take(table, inp.interp_idx, axis=0)
                      * inp.interp_w[..., None].astype(table.dtype), axis=1)
        x = x + pos.astype(x.dtype)
        spatial = self.head_dim // 2
        inv = 1.0 / (self.theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))
        freqs = inp.rope_hw.astype(jnp.float32)[..., None] * jnp.asarray(inv, jnp.float32)
        freqs = freqs.reshape(freqs.shape[0], -1)  # [P, (h freqs, w freqs)]
        emb = jnp.concatenate([freqs, freqs], axis=-1)
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        seg = inp.segment
        mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.merger(x)

"""The Gemma 4 vision encoder and its projector (HF ``Gemma4VisionModel`` and the
``embed_vision`` ``Gemma4MultimodalEmbedder``): an image's patches to soft tokens in the language
model's width.

    patches [B, P, 3*ps*ps] in [0, 1] -> 2 (x - 0.5) -> input_proj
    + x- and y-position embeddings (two learned tables; zero at padding patches)
    -> layers: RMSNorm, attention over the image's patches (no mask but padding; q/k RMSNorm,
       2-D rotary: the first half of each head by x, the second by y; v RMSNorm without scale;
       scale 1), RMSNorm, residual; RMSNorm, gated MLP, RMSNorm, residual
    -> pooler: padding zeroed, every k x k block of patches (by position) averaged into one soft
       token (k from the patch count over the output length), times sqrt(hidden);
       optional standardize -> projector: RMSNorm (no scale), linear to the text width

Weights load from the conditional checkpoint's ``model.vision_tower.*`` and
``model.embed_vision.*``; ``use_clipped_linears`` clamps each linear's input and output to the
checkpoint's bounds. Inputs are the HF image processor's (``Gemma4ImageProcessorPil``):
``pixel_values [B, P, 3*ps*ps]`` and ``image_position_ids [B, P, 2]`` (-1 = padding); ``P`` is
the processor's padded patch count (``max_soft_tokens * k^2``), one shape for every image.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve.models.gemma4 import Gemma4ForCausalLM
from jaxserve.models.layers import ACTIVATIONS
from jaxserve.models.linear import normal
from jaxserve.models.qwen3_5_vision import merge_image_embeddings


def vision_config(hf: dict) -> dict:
    v = dict(hf.get("vision_config") or {})
    if not v:
        raise ValueError("the checkpoint has no vision_config: it is a text-only model")
    d = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16,
             num_attention_heads=12, num_key_value_heads=12, head_dim=64,
             hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, pooling_kernel_size=3,
             patch_size=16, position_embedding_size=10 * 1024, use_clipped_linears=False,
             standardize=False)
    d.update({k: val for k, val in v.items() if val is not None})
    d["rope_theta"] = float((d.get("rope_parameters") or {}).get("rope_theta", 100.0))
    return d


def _rms(x, eps, weight=None):
    xf = x.astype(jnp.float32)
    y = xf * jnp.power(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Gemma 4's vision RMSNorm: ``w * norm(x)`` (plain weight), in float32."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        return _rms(x, self.eps, self.weight[...])


class _Linear(nnx.Module):
    def __init__(self, i: int, o: int, *, dtype, rngs):
        self.weight = nnx.Param(normal(rngs, (o, i), dtype))


class ClippableLinear(nnx.Module):
    """``linear`` without bias; with ``use_clipped_linears`` its input and output clamped."""

    def __init__(self, i: int, o: int, *, clipped: bool, dtype, rngs):
        self.linear = _Linear(i, o, dtype=dtype, rngs=rngs)
        self.clipped = clipped
        if clipped:
            for name, v in (("input_min", -np.inf), ("input_max", np.inf),
                            ("output_min", -np.inf), ("output_max", np.inf)):
                setattr(self, name, nnx.Param(jnp.asarray(v, jnp.float32)))

    def __call__(self, x):
        w = self.linear.weight[...]
        if self.clipped:
            x = jnp.clip(x, self.input_min[...].astype(x.dtype),
                         self.input_max[...].astype(x.dtype))
        y = x.astype(w.dtype) @ w.T
        if self.clipped:
            y = jnp.clip(y, self.output_min[...].astype(y.dtype),
                         self.output_max[...].astype(y.dtype))
        return y


class PatchEmbedder(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        h, ps = int(c["hidden_size"]), int(c["patch_size"])
        self.input_proj = _Linear(3 * ps * ps, h, dtype=dtype, rngs=rngs)
        self.position_embedding_table = nnx.Param(
            normal(rngs, (2, int(c["position_embedding_size"]), h), dtype))

    def __call__(self, pixels, pos, pad):
        w = self.input_proj.weight[...]
        x = (2 * (pixels - 0.5)).astype(w.dtype) @ w.T
        table = self.position_embedding_table[...]
        p = jnp.maximum(pos, 0)
        emb = jnp.take(table[0], p[..., 0], axis=0) + jnp.take(table[1], p[..., 1], axis=0)
        return x + jnp.where(pad[..., None], 0.0, emb).astype(x.dtype)


def _rope_2d(x, pos, theta):
    """First half of each head rotated by x, second by y (rotate-half within each half)."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    out = []
    for k in range(2):
        part = x[..., k * half:(k + 1) * half].astype(jnp.float32)
        f = pos[..., k].astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [B, P, half/2]
        emb = jnp.concatenate([f, f], axis=-1)[..., None, :]  # [B, P, 1, half]
        q = half // 2
        rot = jnp.concatenate([-part[..., q:], part[..., :q]], axis=-1)
        out.append(part * jnp.cos(emb) + rot * jnp.sin(emb))
    return jnp.concatenate(out, axis=-1).astype(x.dtype)


class VisionAttention(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        h, d = int(c["hidden_size"]), int(c["head_dim"])
        self.heads, self.kv_heads, self.head_dim = (int(c["num_attention_heads"]),
                                                    int(c["num_key_value_heads"]), d)
        self.eps, self.theta = float(c["rms_norm_eps"]), c["rope_theta"]
        kw = dict(clipped=bool(c["use_clipped_linears"]), dtype=dtype, rngs=rngs)
        self.q_proj = ClippableLinear(h, self.heads * d, **kw)
        self.k_proj = ClippableLinear(h, self.kv_heads * d, **kw)
        self.v_proj = ClippableLinear(h, self.kv_heads * d, **kw)
        self.o_proj = ClippableLinear(self.heads * d, h, **kw)
        self.q_norm = RMSNorm(d, eps=self.eps, dtype=dtype)
        self.k_norm = RMSNorm(d, eps=self.eps, dtype=dtype)

    def __call__(self, x, pos, valid):
        """``valid``: the keys each query sees, ``[B, P]`` (all queries alike) or ``[B, P, P]``."""
        b, p, _ = x.shape
        d = self.head_dim
        q = _rope_2d(self.q_norm(self.q_proj(x).reshape(b, p, self.heads, d)), pos, self.theta)
        k = _rope_2d(self.k_norm(self.k_proj(x).reshape(b, p, self.kv_heads, d)), pos,
                     self.theta)
        v = _rms(self.v_proj(x).reshape(b, p, self.kv_heads, d), self.eps)
        rep = self.heads // self.kv_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
        mask = valid[:, None, None, :] if valid.ndim == 2 else valid[:, None]
        s = jnp.where(mask, s, -jnp.inf)
        pr = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", pr, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(o.reshape(b, p, -1))


class VisionMLP(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        h, i = int(c["hidden_size"]), int(c["intermediate_size"])
        kw = dict(clipped=bool(c["use_clipped_linears"]), dtype=dtype, rngs=rngs)
        self.act = c["hidden_activation"]
        if self.act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_activation {self.act!r} is not supported")
        self.gate_proj = ClippableLinear(h, i, **kw)
        self.up_proj = ClippableLinear(h, i, **kw)
        self.down_proj = ClippableLinear(i, h, **kw)

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        h, eps = int(c["hidden_size"]), float(c["rms_norm_eps"])
        self.self_attn = VisionAttention(c, dtype=dtype, rngs=rngs)
        self.mlp = VisionMLP(c, dtype=dtype, rngs=rngs)
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            setattr(self, n, RMSNorm(h, eps=eps, dtype=dtype))

    def __call__(self, x, pos, valid):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), pos, valid))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Encoder(nnx.Module):
    def __init__(self, c: dict, *, dtype, rngs):
        self.layers = nnx.List([EncoderLayer(c, dtype=dtype, rngs=rngs)
                                for _ in range(int(c["num_hidden_layers"]))])


class Gemma4VisionTower(nnx.Module):
    """``model.vision_tower.*``."""

    def __init__(self, c: dict, *, dtype, rngs):
        self.k = int(c["pooling_kernel_size"])
        self.hidden = int(c["hidden_size"])
        self.patch_embedder = PatchEmbedder(c, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(c, dtype=dtype, rngs=rngs)
        self.standardize = bool(c["standardize"])
        if self.standardize:
            self.std_bias = nnx.Param(jnp.zeros((self.hidden,), jnp.float32))
            self.std_scale = nnx.Param(jnp.ones((self.hidden,), jnp.float32))

    def __call__(self, pixels, pos):
        """Soft tokens ``[B, L, H]`` (float32) and which are real ``[B, L]``, ``L = P / k^2``."""
        pad = jnp.all(pos == -1, axis=-1)
        x = self.patch_embedder(pixels, pos, pad)
        for layer in self.encoder.layers:
            x = layer(x, pos, ~pad)
        x = jnp.where(pad[..., None], 0.0, x)
        p = x.shape[1]
        length = p // (self.k * self.k)
        if p != length:
            k = int(np.sqrt(p // length))
            cp = jnp.maximum(pos, 0)
            max_x = jnp.max(cp[..., 0], axis=-1, keepdims=True) + 1
            kid = cp // k
            idx = kid[..., 0] + (max_x // k) * kid[..., 1]
            w = jax.nn.one_hot(idx, length, dtype=jnp.float32) / (k * k)  # [B, P, L]
            x = jnp.einsum("bpl,bph->blh", w, x.astype(jnp.float32)).astype(x.dtype)
            valid = jnp.any(w != 0, axis=1)
        else:
            valid = ~pad
        x = x.astype(jnp.float32) * self.hidden ** 0.5
        if self.standardize:
            x = (x - self.std_bias[...]) * self.std_scale[...]
        return x, valid


class MultimodalEmbedder(nnx.Module):
    """``model.embed_vision.*``: RMSNorm without scale, then a linear to the text width."""

    def __init__(self, c: dict, text_hidden: int, *, dtype, rngs):
        self.eps = float(c["rms_norm_eps"])
        self.embedding_projection = _Linear(int(c.get("output_proj_dims") or c["hidden_size"]),
                                            text_hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        w = self.embedding_projection.weight[...]
        return _rms(x.astype(w.dtype), self.eps) @ w.T


class Gemma4Vision(nnx.Module):
    """Tower and projector: ``(pixel_values, image_position_ids)`` -> soft tokens in the text
    width ``[B, L, H_text]`` and their validity ``[B, L]``."""

    def __init__(self, hf: dict, text_hidden: int, *, dtype, rngs):
        c = vision_config(hf)
        self.vision_tower = Gemma4VisionTower(c, dtype=dtype, rngs=rngs)
        self.embed_vision = MultimodalEmbedder(c, text_hidden, dtype=dtype, rngs=rngs)

    def __call__(self, pixels, pos):
        x, valid = self.vision_tower(pixels, pos)
        dtype = self.embed_vision.embedding_projection.weight.dtype
        return self.embed_vision(x.astype(dtype)), valid

    @staticmethod
    def checkpoint_name(param: str) -> str:
        """Our state path -> the conditional checkpoint's tensor name."""
        return "model." + param

    def encode_packed(self, inp: "PackedInputs"):
        """Soft tokens ``[L, H_text]`` of several images packed into one patch row (the encoder
        step's bucket): attention stays within an image (``segment``), each patch's pooled row
        comes from the host (``pool``, ``L`` for padding), so an image's tokens are its own
        ``get_image_features`` rows, in order, at its offset."""
        tower = self.vision_tower
        seg, pos = inp.segment, inp.positions
        pad = seg < 0
        x = tower.patch_embedder(inp.pixels[None], pos[None], pad[None])
        sees = ((seg[:, None] == seg[None, :]) & ~pad[None, :]) | pad[:, None]
        for layer in tower.encoder.layers:
            x = layer(x, pos[None], sees[None])
        x = jnp.where(pad[None, :, None], 0.0, x)[0]
        length = x.shape[0] // (tower.k * tower.k)
        w = jax.nn.one_hot(inp.pool, length, dtype=jnp.float32) / (tower.k * tower.k)
        x = jnp.einsum("pl,ph->lh", w, x.astype(jnp.float32)) * tower.hidden ** 0.5
        if tower.standardize:
            x = (x - tower.std_bias[...]) * tower.std_scale[...]
        dtype = self.embed_vision.embedding_projection.weight.dtype
        return self.embed_vision(x.astype(dtype))


class PackedInputs(NamedTuple):
    """Images packed into one row of ``P`` patches (a multiple of ``k^2``)."""

    pixels: jax.Array     # [P, 3*ps*ps] float32 in [0, 1]
    positions: jax.Array  # [P, 2] int32 (x, y) within its image; 0 at padding
    segment: jax.Array    # [P] int32 image index, -1 = padding
    pool: jax.Array       # [P] int32 output row of the patch, L = P / k^2 at padding


def packed_inputs(pixels: list[np.ndarray], grids, *, k: int, num_patches: int) -> PackedInputs:
    """Host side of :meth:`Gemma4Vision.encode_packed`: each image's real patches (grid
    ``(1, ph, pw)``, row-major as the processor writes them) one after another, its soft tokens
    ``(x // k) + (pw // k) * (y // k)`` past the earlier images' (HF's pooling order)."""
    length = num_patches // (k * k)
    px = np.zeros((num_patches, pixels[0].shape[1]), np.float32)
    pos = np.zeros((num_patches, 2), np.int32)
    seg = np.full(num_patches, -1, np.int32)
    pool = np.full(num_patches, length, np.int32)
    at, out = 0, 0
    for i, (p, (_, ph, pw)) in enumerate(zip(pixels, grids)):
        n = ph * pw
        y, x = np.divmod(np.arange(n), pw)
        px[at:at + n] = p
        pos[at:at + n, 0], pos[at:at + n, 1] = x, y
        seg[at:at + n] = i
        pool[at:at + n] = out + x // k + (pw // k) * (y // k)
        at += n
        out += n // (k * k)
    if at > num_patches:
        raise ValueError(f"{at} patches do not fit the bucket of {num_patches}")
    return PackedInputs(px, pos, seg, pool)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """``Gemma4ForConditionalGeneration``: the Gemma 4 text model with the vision tower and
    projector beside it (``visual``, replicated under tensor parallelism, unquantized); the
    audio tower stays unloaded."""

    def __init__(self, cfg, *, dtype=jnp.float32, rngs, **kw):
        super().__init__(cfg, dtype=dtype, rngs=rngs, **kw)
        self.pad_token_id = int(cfg.hf.get("pad_token_id") or 0)
        # HF embeds every multimodal placeholder id as the pad token, a generated one too
        self.placeholder_ids = tuple(int(cfg.hf[k]) for k in (
            "image_token_id", "video_token_id", "audio_token_id") if cfg.hf.get(k) is not None)
        self.visual = nnx.data(Gemma4Vision(cfg.hf, cfg.hidden_size, dtype=dtype, rngs=rngs)
                               if cfg.hf.get("vision_config") else None)

    def encode_images(self, inp: PackedInputs):
        if self.visual is None:
            raise ValueError("this checkpoint has no vision tower (text-only model)")
        return self.visual.encode_packed(inp)

    def embed_multimodal(self, token_ids, mm):
        return self.embed_images(token_ids, *mm)

    def embed_images(self, token_ids, embeds, rows):
        """HF's merge: a placeholder token (image, video, audio; generated ones too) embeds as
        the pad token (scaled, and in the per-layer inputs' token part), then its soft token
        (unscaled) replaces the row; the per-layer inputs' context projection reads the merged
        rows."""
        placeholder = rows >= 0
        for t in self.placeholder_ids:
            placeholder = placeholder | (token_ids == t)
        ids = jnp.where(placeholder, self.pad_token_id, token_ids)
        x = self.model.embed_tokens(ids)
        x = x * jnp.asarray(float(self.hidden_size) ** 0.5, x.dtype)
        x = merge_image_embeddings(x, embeds, rows)
        return (x, self._per_layer_inputs(ids, x)) if self.ple else x

    @classmethod
    def param_partition_spec(cls, name, cfg):
        if name.startswith("visual."):
            return PartitionSpec()  # small: every device holds it
        return super().param_partition_spec(name, cfg)

    @classmethod
    def checkpoint_tensors(cls, cfg, tensors):
        """The text model's tensors as :class:`Gemma4ForCausalLM` reads them, and
        ``model.vision_tower.*`` / ``model.embed_vision.*`` as ``visual.*``."""
        out = super().checkpoint_tensors(cfg, tensors)
        if cfg.hf.get("vision_config"):
            for name, load in tensors.items():
                if name.startswith(("model.vision_tower.", "model.embed_vision.")):
                    out["visual." + name[len("model."):]] = load
        return out

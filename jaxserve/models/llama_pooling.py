"""Decoder models that pool: a Llama-family body (Llama, Qwen2, Qwen3) as an embedder
(Qwen3-Embedding: last-token pooling) or with a ``score`` head (``*ForSequenceClassification``,
and Qwen3-Reranker through vLLM's ``hf_overrides`` recipe), on the encoder's packed rows.

The body's weights and layers are ``jaxserve.models.llama``'s; attention here is causal within
each packed prompt (no KV pages: a pooling request reads its prompt once). State paths equal
HF names (``model.layers.0.self_attn.q_proj.weight``, ``score.weight``).

Forward contract (the encoder's): ``model(token_ids[R, W], positions[R, W],
token_type_ids[R, W], segment_ids[R, W]) -> hidden[R, W, H]``; ``head(last_hidden[S, H])``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import apply_rope, rope_cos_sin
from jaxserve.models.linear import Linear
from jaxserve.models.llama import LlamaModel, _freeze


class LlamaEmbeddingModel(nnx.Module):
    """The body alone: its final-norm hidden states, pooled LAST by default."""

    is_encoder = True
    default_pooling_type = "LAST"
    num_labels = 0

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference"):
        if cfg.sliding_window is not None:
            raise ValueError(f"{cfg.architecture}: sliding-window layers are not supported "
                             "by the pooling runner")
        self.model = LlamaModel(cfg, dtype=dtype, rngs=rngs)
        self.rope = (cfg.head_dim, cfg.rope_theta, _freeze(cfg.rope_scaling),
                     cfg.max_position_embeddings)

    def __call__(self, token_ids, positions, token_type_ids, segment_ids):
        r, w = token_ids.shape
        head_dim, theta, scaling, max_pos = self.rope
        cos, sin = rope_cos_sin(positions.reshape(-1), head_dim=head_dim, theta=theta,
                                scaling=dict(scaling) if scaling else None,
                                max_position_embeddings=max_pos)
        col = jnp.arange(w)
        mask = ((segment_ids[:, :, None] == segment_ids[:, None, :])
                & (col[None, :, None] >= col[None, None, :]))  # causal within each prompt
        x = self.model.embed_tokens(token_ids.reshape(-1))
        for layer in self.model.layers:
            x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, mask, r, w)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x).reshape(r, w, -1)


class LlamaForSequenceClassification(LlamaEmbeddingModel):
    """``Qwen3ForSequenceClassification`` and kin: ``score`` (no bias) on the last token."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference"):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.num_labels = classifier_labels(cfg)
        self.score = Linear(cfg.hidden_size, self.num_labels, bias=False, dtype=dtype, rngs=rngs)

    def head(self, last_hidden):
        return self.score(last_hidden).astype(jnp.float32)


def classifier_labels(cfg: ModelConfig) -> int:
    hf = cfg.hf
    if hf.get("classifier_from_token"):
        n = len(hf["classifier_from_token"])
        return 1 if n == 2 and hf.get("is_original_qwen3_reranker") else n
    if hf.get("num_labels"):
        return int(hf["num_labels"])
    return len(hf.get("id2label") or {}) or 2


def _attention(attn, x, cos, sin, mask, r: int, w: int):
    t = x.shape[0]
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = attn.q_proj(x).reshape(t, h, d)
    k = attn.k_proj(x).reshape(t, kv, d)
    v = attn.v_proj(x).reshape(t, kv, d)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = h // kv
    q = q.reshape(r, w, kv, rep, d)
    k, v = k.reshape(r, w, kv, d), v.reshape(r, w, kv, d)
    s = jnp.einsum("rqgpd,rkgd->rgpqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("rgpqk,rkgd->rqgpd", p, v).reshape(t, h * d)
    return attn.o_proj(o)


def reranker_score_weight(lm_head, tokenizer, tokens: list[str], original_qwen3: bool):
    """vLLM's ``classifier_from_token``: the LM head's rows of these tokens are the classifier
    (Qwen3-Reranker: ``["no", "yes"]`` as one logit, yes minus no, so its sigmoid is the
    softmax probability of "yes")."""
    ids = []
    for tok in tokens:
        enc = tokenizer.convert_tokens_to_ids(tok)
        if enc is None or enc == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"classifier_from_token: {tok!r} is not one token of the vocabulary")
        ids.append(int(enc))
    rows = np.asarray(lm_head, np.float32)[ids]
    if original_qwen3 and len(ids) == 2:
        return (rows[1] - rows[0])[None, :]
    return rows

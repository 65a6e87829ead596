"""The BERT encoder family in Flax NNX: ``BertModel`` (all-MiniLM, bge, e5 and the other
sentence-transformers encoders) and ``BertForSequenceClassification`` (cross-encoders).

Encoder-only: every token attends to every token of its own sequence (bidirectional), so
there is no KV cache and no page. A step packs whole sequences into ``rows[R, W]`` (several
short ones may share a row); ``segment_ids`` say which sequence each token belongs to (-1 for
padding) and attention is masked to equal segments. State paths equal HF tensor names without
the ``bert.`` prefix (``encoder.layer.0.attention.self.query.weight``).

Forward contract: ``model(token_ids[R, W], positions[R, W], token_type_ids[R, W],
segment_ids[R, W]) -> hidden[R, W, H]`` (float32 LayerNorm outputs in the model's dtype).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import Embedding, LayerNorm
from jaxserve.models.linear import Linear


def _act(name: str):
    if name in ("gelu", "gelu_python"):
        return lambda x: jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "relu":
        return jax.nn.relu
    if name in ("silu", "swish"):
        return jax.nn.silu
    raise ValueError(f"hidden_act {name!r} is not supported by the BERT family")


class _Dense(nnx.Module):  # HF's ``*.dense`` wrapper modules keep their tensor names
    def __init__(self, i: int, o: int, *, dtype, rngs):
        self.dense = Linear(i, o, bias=True, dtype=dtype, rngs=rngs)


class SelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        h = cfg.hidden_size
        self.query = Linear(h, h, bias=True, dtype=dtype, rngs=rngs)
        self.key = Linear(h, h, bias=True, dtype=dtype, rngs=rngs)
        self.value = Linear(h, h, bias=True, dtype=dtype, rngs=rngs)


class AttentionOutput(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=True, dtype=dtype, rngs=rngs)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=_eps(cfg), dtype=dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.self = SelfAttention(cfg, dtype=dtype, rngs=rngs)
        self.output = AttentionOutput(cfg, dtype=dtype, rngs=rngs)
        self.num_heads = cfg.num_heads

    def __call__(self, x, mask):
        r, w, h = x.shape
        d = h // self.num_heads
        split = lambda y: y.reshape(r, w, self.num_heads, d)  # noqa: E731
        q, k, v = split(self.self.query(x)), split(self.self.key(x)), split(self.self.value(x))
        s = jnp.einsum("rqhd,rkhd->rhqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
        s = jnp.where(mask[:, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("rhqk,rkhd->rqhd", p, v).reshape(r, w, h)
        return self.output.LayerNorm(self.output.dense(o) + x)


class Output(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.dense = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype,
                            rngs=rngs)
        self.LayerNorm = LayerNorm(cfg.hidden_size, eps=_eps(cfg), dtype=dtype)


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.attention = Attention(cfg, dtype=dtype, rngs=rngs)
        self.intermediate = _Dense(cfg.hidden_size, cfg.intermediate_size, dtype=dtype,
                                   rngs=rngs)
        self.output = Output(cfg, dtype=dtype, rngs=rngs)
        self.act = _act(cfg.hidden_act)

    def __call__(self, x, mask):
        x = self.attention(x, mask)
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(y + x)


class Embeddings(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        h = cfg.hidden_size
        self.word_embeddings = Embedding(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
        self.position_embeddings = Embedding(cfg.max_position_embeddings, h, dtype=dtype,
                                             rngs=rngs)
        self.token_type_embeddings = Embedding(max(1, int(cfg.hf.get("type_vocab_size", 2))),
                                               h, dtype=dtype, rngs=rngs)
        self.LayerNorm = LayerNorm(h, eps=_eps(cfg), dtype=dtype)

    def __call__(self, token_ids, positions, token_type_ids):
        x = (self.word_embeddings(token_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)


class Encoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs):
        self.layer = nnx.List([EncoderLayer(cfg, dtype=dtype, rngs=rngs)
                               for _ in range(cfg.num_layers)])


class BertModel(nnx.Module):
    """The encoder (and, when the checkpoint has it, BERT's CLS ``pooler``: dense + tanh)."""

    is_encoder = True
    default_pooling_type = "CLS"

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference", add_pooler: bool = False):
        self.embeddings = Embeddings(cfg, dtype=dtype, rngs=rngs)
        self.encoder = Encoder(cfg, dtype=dtype, rngs=rngs)
        self.pooler = _Dense(cfg.hidden_size, cfg.hidden_size, dtype=dtype, rngs=rngs) \
            if add_pooler else None
        self.num_labels = 0

    def __call__(self, token_ids, positions, token_type_ids, segment_ids):
        mask = ((segment_ids[:, :, None] == segment_ids[:, None, :])
                & (segment_ids[:, None, :] >= 0))
        x = self.embeddings(token_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


class BertForSequenceClassification(nnx.Module):
    """A cross-encoder: BERT's CLS pooler (dense + tanh) then ``classifier`` -> logits."""

    is_encoder = True
    default_pooling_type = "CLS"

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 attention_backend: str = "reference"):
        self.bert = BertModel(cfg, dtype=dtype, rngs=rngs, add_pooler=True)
        self.num_labels = num_labels(cfg)
        self.classifier = Linear(cfg.hidden_size, self.num_labels, bias=True, dtype=dtype,
                                 rngs=rngs)

    def __call__(self, token_ids, positions, token_type_ids, segment_ids):
        return self.bert(token_ids, positions, token_type_ids, segment_ids)

    def head(self, first_hidden):
        pooled = jnp.tanh(self.bert.pooler.dense(first_hidden))
        return self.classifier(pooled).astype(jnp.float32)


def num_labels(cfg: ModelConfig) -> int:
    hf = cfg.hf
    if hf.get("num_labels"):
        return int(hf["num_labels"])
    return len(hf.get("id2label") or {}) or 2


def _eps(cfg: ModelConfig) -> float:
    return float(cfg.hf.get("layer_norm_eps", 1e-12))


ENCODER_ARCHITECTURES = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}

"""A tiny model that mixes every cache kind: Gated DeltaNet layers (recurrent state slots),
sliding-window attention layers and full attention layers in one stack, built from Qwen 3.5's
layer classes, and a straightforward reference forward for it (dense attention over the whole
sequence, the recurrence from a zero state, recomputed for every token).

The checkpoint is a tiny random Qwen 3.5 (``testing.qwen3_5``) whose ``config.json`` names
:data:`ARCHITECTURE` and marks some attention layers ``sliding_attention`` with
``sliding_window``; a test serves it after
``jaxserve.models.registry.register_model(ARCHITECTURE, TinyHybridForCausalLM)`` (the registry
itself never lists it: production never imports this module).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_cache_spec import SlidingWindow, group_layers
from jaxserve.models.layers import apply_rope, paged_self_attention
from jaxserve.models.qwen3_5 import GatedAttention, Qwen3_5ForCausalLM

ARCHITECTURE = "JaxserveTinyHybridForCausalLM"
LAYER_TYPES = ("linear_attention", "sliding_attention", "full_attention",
               "linear_attention", "sliding_attention", "full_attention")


class SlidingGatedAttention(GatedAttention):
    """Qwen 3.5's gated attention over the last ``window`` positions only."""

    def __init__(self, cfg, window: int, **kw):
        super().__init__(cfg, **kw)
        self.window = window

    def cache_spec(self, dtype: str) -> SlidingWindow:
        return SlidingWindow(self.window, self.num_kv_heads, self.head_dim, dtype)

    def __call__(self, x, cos, sin, kv, md, backend, mesh=None):
        q, gate, k, v = _qkv(self, x, cos, sin)
        out, kv = paged_self_attention(q, k, v, kv, md, backend=backend, mesh=mesh,
                                       num_kv_heads=self.num_kv_heads,
                                       sm_scale=self.head_dim ** -0.5,
                                       sliding_window=self.window, kv_scale=self.kv_scale)
        return _out(self, out, gate), kv


def _qkv(attn, x, cos, sin):
    t, d = x.shape[0], attn.head_dim
    qg = attn.q_proj(x).reshape(t, attn.num_heads, 2 * d)
    q, gate = attn.q_norm(qg[..., :d]), qg[..., d:]
    k = attn.k_norm(attn.k_proj(x).reshape(t, attn.num_kv_heads, d))
    v = attn.v_proj(x).reshape(t, attn.num_kv_heads, d)
    r = cos.shape[-1]
    q = jnp.concatenate([apply_rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
    return q, gate, k, v


def _out(attn, out, gate):
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return attn.o_proj(out.reshape(out.shape[0], attn.num_heads * attn.head_dim))


class TinyHybridForCausalLM(Qwen3_5ForCausalLM):
    """Qwen 3.5 with ``sliding_attention`` layers: three cache kinds, a pool per paged group
    (``md.block_tables [G, S, M]``; each attention layer reads its group's row) beside the
    state slots."""

    cache_groups_supported = True

    def __init__(self, cfg, *, dtype=jnp.float32, rngs, attention_backend: str = "reference"):
        super().__init__(cfg, dtype=dtype, rngs=rngs, attention_backend=attention_backend)
        for i, layer in enumerate(self.model.layers):
            if cfg.layer_sliding_window(i) is not None:
                layer.self_attn = SlidingGatedAttention(cfg, cfg.layer_sliding_window(i),
                                                        dtype=dtype, rngs=rngs)
        # the block-table row of each layer: its group's index among the paged groups
        rows, row = {}, 0
        for g in group_layers(self.cache_specs("float32")):
            if g.paged:
                for i in g.layers + g.readers:
                    rows[i] = row
                row += 1
        self.layer_row = tuple(rows.get(i, -1) for i in range(self.num_layers))

    def run_layer(self, i: int, layer, x, inputs, cache, md, lora=None):
        if md.block_tables.ndim == 3 and self.layer_row[i] >= 0:  # a pool per group
            g = self.layer_row[i]
            md = md._replace(slot_mapping=md.slot_mapping[g], block_tables=md.block_tables[g])
        elif md.block_tables.ndim == 3:  # a GDN layer reads no pages
            md = md._replace(slot_mapping=md.slot_mapping[0], block_tables=md.block_tables[0])
        return super().run_layer(i, layer, x, inputs, cache, md, lora)


def make_tiny_hybrid(out_dir, *, window: int = 16, seed: int = 0) -> Path:
    """A tiny random checkpoint of :class:`TinyHybridForCausalLM` (six layers: GDN, sliding,
    full, twice)."""
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    hf_types = ["linear_attention" if t == "linear_attention" else "full_attention"
                for t in LAYER_TYPES]
    out = make_tiny_qwen3_5(out_dir, seed=seed, mtp=False, num_hidden_layers=len(LAYER_TYPES),
                            layer_types=hf_types)
    path = out / "config.json"
    c = json.loads(path.read_text())
    c["architectures"] = [ARCHITECTURE]
    c["layer_types"] = list(LAYER_TYPES)
    c["sliding_window"] = window
    path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return out


# -- the reference forward --------------------------------------------------------------------

def reference_logits(model, token_ids, host: bool = True):
    """``[T, V]`` logits of one sequence from scratch: every attention layer dense and causal
    (a sliding layer over its window), every GDN layer from a zero state (one state slot, no
    pages). No pool, no block table, no chunking."""
    from jaxserve.models.layers import AttentionMetadata

    ids = jnp.asarray(token_ids, jnp.int32)
    t = ids.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    cos, sin = model._rope(pos)
    md = AttentionMetadata(slot_mapping=None, query_start=jnp.asarray([0, t], jnp.int32),
                           seq_lens=jnp.asarray([t], jnp.int32), block_tables=None,
                           num_seqs=jnp.int32(1), state_slots=jnp.asarray([0], jnp.int32))
    x = model.embed(ids)
    for layer in model.model.layers:
        h = layer.input_layernorm(x)
        if layer.linear_attn is not None:
            state = tuple(jnp.zeros((2,) + tuple(s), jnp.float32)
                          for s in layer.linear_attn.cache_spec().shapes)
            mixed, _ = layer.linear_attn(h, state, md, None)
        else:
            attn = layer.self_attn
            q, gate, k, v = _qkv(attn, h, cos, sin)
            rep = attn.num_heads // attn.num_kv_heads
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
            s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
            s = s * attn.head_dim ** -0.5
            allowed = pos[None, :] <= pos[:, None]
            if isinstance(attn, SlidingGatedAttention):
                allowed &= pos[None, :] > pos[:, None] - attn.window
            s = jnp.where(allowed[None], s, -jnp.inf)
            out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32))
            mixed = _out(attn, out.astype(h.dtype), gate)
        x = x + mixed
        h = layer.post_attention_layernorm(x)
        x = x + layer.mlp(h)
    logits = model.compute_logits(model.model.norm(x))
    return np.asarray(logits) if host else logits


def reference_greedy(model, prompt, max_tokens: int) -> list[int]:
    """Greedy tokens, the whole sequence recomputed for every one (padded at the end to one
    length, so one compile serves every step: attention is causal and the recurrence runs
    forward, so the padding never reaches the last real position)."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    width = len(prompt) + max_tokens

    @jax.jit
    def logits(state, ids):
        return reference_logits(nnx.merge(graphdef, state), ids, host=False)

    seq, out = list(prompt), []
    for _ in range(max_tokens):
        ids = np.zeros(width, np.int32)
        ids[:len(seq)] = seq
        tok = int(np.argmax(np.asarray(logits(state, jnp.asarray(ids)))[len(seq) - 1]))
        out.append(tok)
        seq.append(tok)
    return out

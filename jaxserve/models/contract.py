"""What a model class must provide to the loader and the runner (one ``Protocol``).

A family is one module in ``jaxserve/models/`` with a class that lists :class:`ModelBase`
first and satisfies :class:`CausalLM`, one line per HF architecture name in ``registry.py``,
and, for GGUF, its ``gguf`` table (``jaxserve.models.gguf_table``). Nothing else in the engine
knows a family (docs/models.md, "Adding a family").

The runner's device step is ``hidden, kv = model(token_ids, positions, kv_pages, md)`` then
``model.compute_logits(hidden[logits_indices])``; the graph (``nnx.split``) is a jit cache key,
so everything a model keeps besides parameters must be hashable and static.

KV layout: every layer declares what it caches (``cache_specs``: ``FullAttention``,
``SlidingWindow``, ``SharedKV``, ``LinearState`` from ``jaxserve.core.kv_cache_spec``); the
runner groups layers by spec and allocates the pools. Every layer that owns KV has one
``(k_pages, v_pages)`` of ``[Hkv, pages, block, head_dim]`` at its own spec's shape; a
``SharedKV`` layer gets ``()`` and reads its producer's. By default a page id indexes every
layer's array (one pool, ``md`` with one block table); a model with ``cache_groups_supported``
gets a pool per group instead and ``md.block_tables [G, S, M]`` / ``md.slot_mapping [G, T]``,
and picks each layer's group's row (``jaxserve.models.gemma4``).
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.core.kv_cache_spec import SharedKV
from jaxserve.models.attention import AttentionBackend
from jaxserve.models.linear import lm_head_logits
from jaxserve.sharding import TP_AXIS

TensorLoaders = Mapping[str, Callable[[], np.ndarray]]  # name -> lazy numpy array


class ModelBase:
    """The contract's capabilities with their defaults: a family class lists this first among
    its bases and sets what it supports, so the engine reads each capability as a plain
    attribute (never a probe)."""

    # gives its forward in pieces (``embed``, ``layer_inputs``, ``run_layer``,
    # ``final_hidden``) that pipeline stages run over a layer range
    supports_pipeline = False
    # its layers take a ``lora`` argument (``jaxserve.models.lora``)
    supports_lora = False
    # reads per-group block tables (``md.block_tables [G, S, M]``) when its cache groups differ
    cache_groups_supported = False
    # the multi-token-prediction head (``mtp_forward``), None without one
    mtp = None
    # the vision tower (``encode_images``, ``merge_multimodal``), None for a text-only model
    visual = None
    # how llama.cpp's GGUF files store the family: one ``GGUFArch`` per GGUF architecture
    gguf = ()

    @property
    def attention_backend(self) -> str:
        """The name of the attention backend the model was built with (``self.attention``)."""
        return self.attention.name

    # A family supplies ``model.layers`` (its layer class), ``embed``, ``layer_inputs`` (what
    # every layer reads besides the hidden states: rotary tables) and ``run_layer`` (one layer);
    # the loop over layers below is the only one.

    def __call__(self, token_ids, positions, kv_pages, md, lora=None, mm=None, capture=None):
        """``token_ids[T], positions[T]`` (or M-RoPE ``[3, T]``), one cache per layer (then the
        MTP head's, passed through), ``AttentionMetadata`` -> ``(hidden[T, H], caches)``.
        ``lora``: a ``LoRABatch``; ``mm``: image embeddings to put at placeholders
        (:meth:`merge_multimodal`); ``capture``: as :meth:`run_layers`, then the captured
        hidden states (with the final norm's output at ``num_layers``) come third."""
        want = self.num_layers + (self.mtp is not None)
        if len(kv_pages) != want:
            raise ValueError(f"kv_pages has {len(kv_pages)} layers, the model {want}")
        if lora is not None and not self.supports_lora:
            raise ValueError(f"{type(self).__name__} does not support LoRA adapters")
        inputs = self.layer_inputs(positions, md, token_ids.shape[0])
        x = self.embed(token_ids) if mm is None else self.embed_multimodal(token_ids, mm)
        out = self.run_layers(x, inputs, kv_pages[:self.num_layers], md, lora, capture=capture)
        hidden, caches = self.final_hidden(out[0]), out[1] + list(kv_pages[self.num_layers:])
        if capture is None:
            return hidden, caches
        return hidden, caches, capture_hidden(out[2], capture, self.num_layers, hidden)

    def run_layers(self, x, inputs, kv_pages, md, lora=None, lo: int = 0, hi: int | None = None,
                   capture=None):
        """Model layers ``lo .. hi - 1`` (a pipeline stage's range, or all) on the hidden carry
        ``x``, ``kv_pages`` one cache per layer of the range -> ``(x, caches)``. A KV-sharing
        layer (``SharedKV`` spec) reads the pages its producer (in the range) just wrote and
        hands back ``()``. ``model.layers[i]`` is model layer ``i`` (a pipeline stage holds
        None for the layers of other stages).

        ``capture``: ``[T, K]`` the hidden-state layers each token asks for (Hugging Face's
        ``output_hidden_states`` numbering: ``i`` = the residual stream entering layer ``i``,
        0 the embeddings; -1 none). Then ``(x, caches, captured)``: ``[T, K, H]`` float32 with
        what enters each layer of the range where asked, zeros elsewhere (so the stages'
        captures add up)."""
        hi = self.num_layers if hi is None else hi
        if len(kv_pages) != hi - lo:
            raise ValueError(f"kv_pages has {len(kv_pages)} layers, the range {lo}..{hi - 1} "
                             f"{hi - lo}")
        producers = self.kv_producers()
        outside = [i for i in range(lo, hi) if producers[i] is not None and producers[i] < lo]
        if outside:
            raise ValueError(f"layer {outside[0]} reads the pages of layer "
                             f"{producers[outside[0]]}, outside the range {lo}..{hi - 1}")
        captured = None if capture is None else jnp.zeros(
            capture.shape + (residual(x).shape[-1],), jnp.float32)
        caches = []
        for j, i in enumerate(range(lo, hi)):
            if capture is not None:
                captured = capture_hidden(captured, capture, i, x)
            kv = kv_pages[j] if producers[i] is None else caches[producers[i] - lo]
            x, kv = self.run_layer(i, self.model.layers[i], x, inputs, kv, md, lora)
            caches.append(kv)
        caches = [() if producers[i] is not None else kv for i, kv in zip(range(lo, hi), caches)]
        return (x, caches) if capture is None else (x, caches, captured)

    def kv_producers(self) -> tuple:
        """Per layer: the layer whose pages it reads (its ``SharedKV`` spec), or None."""
        return tuple(s.producer_layer if isinstance(s, SharedKV) else None
                     for s in self.cache_specs("float32")[:self.num_layers])

    def embed_multimodal(self, token_ids, mm):
        """The hidden carry entering layer 0 of a step with images: the tokens' embeddings
        with the image embeddings put in (:meth:`merge_multimodal`); a family whose placeholders
        embed otherwise (Gemma 4) overrides this."""
        return self.merge_multimodal(self.embed(token_ids), mm)

    def merge_multimodal(self, x, mm):
        """The token embeddings ``x`` with image embeddings put in (vision-language models)."""
        raise ValueError(f"{type(self).__name__} takes no image inputs")

    def encode_images(self, vision_inputs):
        """The vision tower's image embeddings (vision-language models)."""
        raise ValueError(f"{type(self).__name__} has no vision tower")

    def mtp_forward(self, next_token_ids, positions, hidden, kv, md):
        """The multi-token-prediction head over ``T`` tokens -> (its hidden states, kv)."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction head")

    def final_hidden(self, x):
        """The last layer's output -> the final hidden states (the final norm)."""
        return self.model.norm(x)

    def cache_specs(self, dtype: str) -> list:
        """One cache spec per layer (``jaxserve.core.kv_cache_spec``), pages of ``dtype``:
        what each layer's attention declares."""
        return [layer.self_attn.cache_spec(dtype) for layer in self.model.layers]

    def compute_logits(self, hidden):
        """``[N, H]`` final hidden states -> ``[N, V]`` float32 logits (the LM head, or the
        embedding tied to it)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return lm_head_logits(head, hidden)

    @classmethod
    def param_partition_spec(cls, name: str, cfg: ModelConfig) -> PartitionSpec:
        return megatron_partition_spec(name)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors: TensorLoaders) -> TensorLoaders:
        return tensors


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only LM over the paged KV pool.

    Construction: ``cls(cfg, dtype=..., rngs=nnx.Rngs(...), attention_backend=...)`` (a name or
    an ``AttentionBackend``, resolved once into ``attention``) builds random parameters whose
    state paths (``model.layers.0.self_attn.q_proj.weight``) are the names the loader fills.
    ``mesh`` is set by the loader after construction (None: single device).
    """

    num_layers: int
    attention: AttentionBackend
    mesh: object
    supports_pipeline: bool
    supports_lora: bool
    cache_groups_supported: bool
    mtp: object  # the MTP head module, or None
    visual: object  # the vision tower, or None

    def __call__(self, token_ids, positions, kv_pages, md, lora=None, mm=None, capture=None):
        """``token_ids[T], positions[T]``, one ``(k, v)`` per layer, ``AttentionMetadata`` ->
        ``(hidden[T, H], kv_pages)`` (the pages written with this step's K/V; with
        ``capture``, the captured hidden states third)."""

    def embed(self, token_ids):
        """``[T]`` ids -> the hidden carry entering layer 0 (Gemma 4: with per-layer inputs)."""

    def layer_inputs(self, positions, md, num_tokens: int):
        """What every layer reads besides the hidden carry (the rotary tables)."""

    def run_layer(self, i: int, layer, x, inputs, kv, md, lora=None):
        """Model layer ``i`` -> ``(x, its cache)``."""

    def run_layers(self, x, inputs, kv_pages, md, lora=None, lo: int = 0, hi: int | None = None,
                   capture=None):
        """Layers ``lo .. hi - 1`` (``ModelBase``'s loop, the only one) -> ``(x, caches)``
        (with ``capture``: and the captured hidden states)."""

    def final_hidden(self, x):
        """The last layer's carry -> the final hidden states."""

    def encode_images(self, vision_inputs):
        """Image embeddings ``[P, H]`` (``merge_multimodal`` puts them at placeholders)."""

    def mtp_forward(self, next_token_ids, positions, hidden, kv, md):
        """The MTP head (``mtp`` not None) -> (its normed hidden ``[T, H]``, kv)."""

    def cache_specs(self, dtype: str) -> list:
        """One cache spec per layer, pages of ``dtype`` (the KV cache dtype's name)."""

    def compute_logits(self, hidden):
        """``[N, H]`` final hidden states -> ``[N, V]`` float32 logits (soft-capped if the
        family caps them)."""

    @classmethod
    def param_partition_spec(cls, name: str, cfg: ModelConfig) -> PartitionSpec:
        """The tensor-parallel ``PartitionSpec`` (axis ``tp``) of one parameter by state path."""

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors: TensorLoaders) -> TensorLoaders:
        """Checkpoint tensors (HF names) -> loaders keyed by this class's state paths: the place
        to stack per-expert weights or split fused projections. Identity for most families."""


def megatron_partition_spec(name: str) -> PartitionSpec:
    """Megatron-style rules for HF ``[out, in]`` linears: q/k/v/gate/up split their output rows,
    o/down their input columns, the embedding and LM head the vocabulary; the rest replicated."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                      "gate_proj.weight", "up_proj.weight")):
        return PartitionSpec(TP_AXIS, None)
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return PartitionSpec(TP_AXIS)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return PartitionSpec(None, TP_AXIS)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return PartitionSpec(TP_AXIS, None)
    return PartitionSpec()


def residual(x):
    """The residual stream of a hidden carry (Gemma 4's per-layer inputs ride along as
    ``(x, pli)``)."""
    return x[0] if isinstance(x, tuple) else x


def capture_hidden(captured, capture, i: int, x):
    """``captured [T, K, H]`` with the residual stream ``x`` put where a token asks for
    hidden-state layer ``i`` (``capture [T, K]``)."""
    h = residual(x).astype(jnp.float32)
    return jnp.where((capture == i)[..., None], h[:, None, :], captured)

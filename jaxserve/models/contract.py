"""What a model class must provide to the loader and the runner (one ``Protocol``).

A family is one module in ``jaxserve/models/`` with a class that satisfies :class:`CausalLM`,
one line per HF architecture name in ``registry.py``, and, for GGUF, its names in the GGUF
loader's map. Nothing else in the engine knows a family.

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

import numpy as np
from jax.sharding import PartitionSpec

from jaxserve.config import ModelConfig
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

    def final_hidden(self, x):
        """The last layer's output -> the final hidden states (the final norm)."""
        return self.model.norm(x)


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only LM over the paged KV pool.

    Construction: ``cls(cfg, dtype=..., rngs=nnx.Rngs(...), attention_backend=...)`` builds random
    parameters whose state paths (``model.layers.0.self_attn.q_proj.weight``) are the names the
    loader fills. ``mesh`` is set by the loader after construction (None: single device).
    """

    num_layers: int
    attention_backend: str
    mesh: object
    supports_pipeline: bool
    supports_lora: bool
    cache_groups_supported: bool
    mtp: object  # the MTP head module, or None

    def __call__(self, token_ids, positions, kv_pages, md):
        """``token_ids[T], positions[T]``, one ``(k, v)`` per layer, ``AttentionMetadata`` ->
        ``(hidden[T, H], kv_pages)`` (the pages written with this step's K/V)."""

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

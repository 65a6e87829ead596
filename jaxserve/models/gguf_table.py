"""How llama.cpp's GGUF files store a family: the table each family file declares (its class's
``gguf``), which the GGUF loader (``jaxserve.loaders.gguf``) finds through the registry.

llama.cpp's ``convert_hf_to_gguf.py`` renames tensors (``blk.N.attn_q.weight``), keeps some
in its own layout and writes the config as ``<arch>.*`` metadata. The names every family shares
(``attn_q`` -> ``self_attn.q_proj``, ``token_embd`` -> ``model.embed_tokens``, ...) are the
loader's; a family's table lists only what differs, and the hooks that rebuild its HF config
fields and undo its storage.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFArch:
    """One llama.cpp architecture (``general.architecture``) as an HF family."""

    gguf_name: str | None  # general.architecture; None: reached only as another's variant
    architecture: str  # the HF ``architectures`` entry
    model_type: str  # the HF ``model_type``
    # GGUF layer tensor kind -> HF name after ``model.layers.N.``, beyond the shared names
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (GGUF kind, suffix) -> HF name after ``model.layers.N.`` where the suffix changes too
    whole_names: Mapping[tuple, str] = dataclasses.field(default_factory=dict)
    # whole GGUF tensor name -> HF name, beyond the shared ones
    global_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (MoE block, per-expert HF names of gate, up, down): expert tensors split per expert
    experts: tuple | None = None
    # written by llama.cpp's LlamaModel converter: Q/K rows permuted, the head dim given as
    # ``rope.dimension_count``
    llama_converter: bool = False
    # the HF architecture of a file of this architecture that has experts (llama -> Mixtral)
    with_experts: str | None = None
    # the family reads per-layer ``head_count_kv`` / ``rope_freqs`` in its own ``config``
    per_layer_kv_heads: bool = False
    own_rope_freqs: bool = False
    # (metadata, cfg, n_experts) -> None: the family's HF config fields (metadata: the
    # loader's ``GGUFMetadata``: ``meta(key, default)``, ``names``, ``rows``, ``array``)
    config: Callable | None = None
    # (HF name, float32 array, cfg) -> array: undo the family's storage (shifted norms, ...)
    to_hf: Callable | None = None

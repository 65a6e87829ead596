"""Phi-3 (mini / small-context and LongRoPE 128k variants): the Llama family with fused
``qkv_proj`` and ``gate_up_proj`` checkpoints.

The fused tensors are split at load into the Llama layout (q/k/v, gate/up), so tensor
parallelism keeps its per-projection shards; LongRoPE ("longrope", formerly "su") is a rope
scaling of :mod:`jaxserve.models.layers`.
"""
from __future__ import annotations

import functools

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.llama import LlamaForCausalLM


def gguf_config(a, cfg: dict, n_experts: int) -> None:
    """Phi-3's HF config fields from llama.cpp's metadata: LongRoPE's factors are tensors."""
    if not cfg.get("sliding_window"):  # 0: none (Phi-4)
        cfg["sliding_window"] = None
    dims = a("rope.dimension_count")
    if dims is not None and int(dims) != cfg["head_dim"]:
        cfg["partial_rotary_factor"] = int(dims) / cfg["head_dim"]
    if "rope_factors_long.weight" in a.names:
        def factors(name):
            return [float(x) for x in a.array(name).ravel()]

        rs = {"rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
              "short_factor": factors("rope_factors_short.weight")}
        attn = a("rope.scaling.attn_factor")
        if attn is not None:
            rs["attention_factor"] = float(attn)
        orig = a("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
            cfg["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf = (GGUFArch("phi3", "Phi3ForCausalLM", "phi3", config=gguf_config,
                     layer_names={"attn_qkv": "self_attn.qkv_proj",  # fused: split at load
                                  "ffn_up": "mlp.gate_up_proj"}),)

    def __init__(self, cfg: ModelConfig, **kw):
        rope = cfg.hf.get("rope_parameters") or cfg.hf.get("rope_scaling") or {}
        partial = float(rope.get("partial_rotary_factor") or
                        cfg.hf.get("partial_rotary_factor") or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported for Phi-3 "
                             "(only 1.0)")
        super().__init__(cfg, **kw)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors):
        """``qkv_proj`` -> q/k/v rows, ``gate_up_proj`` -> gate/up rows (lazy)."""
        d = cfg.head_dim
        qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        out = dict(tensors)
        for name in list(out):
            if name.endswith("self_attn.qkv_proj.weight"):
                base = name[:-len("qkv_proj.weight")]
                fused = out.pop(name)
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{base}{part}.weight"] = functools.partial(_rows, fused, qkv, i)
            elif name.endswith("mlp.gate_up_proj.weight"):
                base = name[:-len("gate_up_proj.weight")]
                fused = out.pop(name)
                sizes = [cfg.intermediate_size] * 2
                for i, part in enumerate(("gate_proj", "up_proj")):
                    out[f"{base}{part}.weight"] = functools.partial(_rows, fused, sizes, i)
        return out


def _rows(load, sizes, i):
    arr = np.asarray(load())
    if arr.shape[0] != sum(sizes):
        raise ValueError(f"fused tensor has {arr.shape[0]} rows, expected {sum(sizes)}")
    start = sum(sizes[:i])
    return arr[start:start + sizes[i]]

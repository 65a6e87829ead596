"""Mixture-of-experts families: Mixtral, Qwen3-MoE and Qwen2-MoE (with its shared expert).

Attention, norms and rope are the Llama family's; the MLP of a sparse layer is a router
(softmax, top-k, renormalised for Mixtral and for Qwen's ``norm_topk_prob``) and stacked expert
weights run as grouped matmuls (``jax.lax.ragged_dot``) over the token-expert assignments sorted
by expert. Every shape is fixed by the token bucket (``T * top_k`` rows), so routing never
recompiles.

Parallelism over the mesh's ``tp`` axis, inside one ``shard_map``:
- tensor parallel (default): every device holds every expert, split along the intermediate
  dimension (gate/up by columns, down by rows); partial outputs are summed with ``psum``;
- expert parallel (``enable_expert_parallel``): experts are split over devices whole; each device
  runs the rows routed to its own experts (a sharded ragged_dot over the same sorted rows) and
  the per-device outputs are summed with ``psum``. Tokens are replicated between layers in this
  engine, so no all-to-all is needed.

Checkpoints keep one tensor per expert (``experts.3.w1.weight``); ``checkpoint_tensors`` stacks
them into ``experts.gate_proj [E, H, I]``, ``experts.up_proj [E, H, I]``,
``experts.down_proj [E, I, H]`` (the ``[groups, in, out]`` layout ragged_dot takes).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.models.contract import megatron_partition_spec
from jaxserve.models.gguf_table import GGUFArch
from jaxserve.models.layers import ACTIVATIONS, MLP, RMSNorm, activation
from jaxserve.models.linear import Linear, normal
from jaxserve.models.llama import Attention, LlamaForCausalLM

TP = sharding.TP_AXIS


def num_experts(cfg: ModelConfig) -> int:
    return int(cfg.hf.get("num_local_experts") or cfg.hf.get("num_experts") or 0)


def _moe_settings(cfg: ModelConfig) -> dict:
    hf = cfg.hf
    mixtral = cfg.model_type == "mixtral"
    return dict(
        experts=num_experts(cfg),
        top_k=int(hf.get("num_experts_per_tok", 2)),
        renormalize=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        intermediate=int(cfg.intermediate_size if mixtral else hf["moe_intermediate_size"]),
        shared=int(hf.get("shared_expert_intermediate_size") or 0),
        block=MIXTRAL_BLOCK if mixtral else "mlp",
    )


MIXTRAL_BLOCK = "block_sparse_moe"
# per-expert checkpoint names of (gate, up, down)
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def is_sparse_layer(cfg: ModelConfig, layer: int) -> bool:
    if num_experts(cfg) == 0:
        return False
    if layer in (cfg.hf.get("mlp_only_layers") or ()):
        return False
    return (layer + 1) % int(cfg.hf.get("decoder_sparse_step") or 1) == 0


def route(router_logits, top_k: int, renormalize: bool):
    """Softmax over experts (float32), the top ``k`` and their weights -> (weights, ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


def grouped_experts(x, weights, ids, w_gate, w_up, w_down, *, act: str, first_expert,
                    num_experts_total: int):
    """The routed FFN of ``x [T, H]`` over the experts held here (``w_* [E_local, ...]``, the
    experts ``first_expert .. first_expert + E_local``): rows are the ``T * k`` assignments
    sorted by expert; rows of experts held elsewhere contribute zero."""
    t, k = ids.shape
    e_local = w_gate.shape[0]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts_total).astype(jnp.int32)
    local = jax.lax.dynamic_slice(counts, (first_expert,), (e_local,))
    start = jnp.sum(jnp.where(jnp.arange(num_experts_total) < first_expert, counts, 0))
    rows = jnp.roll(x[order // k], -start, axis=0)  # this device's experts' rows first
    h = ACTIVATIONS[act](jax.lax.ragged_dot(rows, w_gate, local))
    h = h * jax.lax.ragged_dot(rows, w_up, local)
    y = jax.lax.ragged_dot(h, w_down, local)
    y = jnp.where((jnp.arange(t * k) < jnp.sum(local))[:, None], y, 0)
    y = jnp.zeros_like(y).at[order].set(jnp.roll(y, start, axis=0))  # back to [token, k] order
    y = y.reshape(t, k, -1).astype(jnp.float32) * weights[..., None]
    return jnp.sum(y, axis=1)


class Experts(nnx.Module):
    """Stacked expert weights ``[E, in, out]``."""

    def __init__(self, n: int, hidden: int, inter: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(normal(rngs, (n, hidden, inter), dtype))
        self.up_proj = nnx.Param(normal(rngs, (n, hidden, inter), dtype))
        self.down_proj = nnx.Param(normal(rngs, (n, inter, hidden), dtype))

    def __call__(self, x, weights, ids, *, act: str, expert_parallel: bool, mesh=None):
        """``x [T, H]`` through each token's routed experts (``ids``, ``weights`` ``[T, k]``),
        summed: on one device, or under tp with the experts split (``expert_parallel``) or
        each expert's intermediate dimension split."""
        num_experts = self.gate_proj.shape[0]
        w = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        run = functools.partial(grouped_experts, act=act, num_experts_total=num_experts)
        if mesh is None:
            return run(x, weights, ids, *w, first_expert=0)
        if expert_parallel and num_experts % sharding.tp_size(mesh):
            raise ValueError(f"expert parallelism over {sharding.tp_size(mesh)} devices "
                             f"needs num_experts ({num_experts}) divisible by it")
        return _sharded(run, mesh, expert_parallel)(x, weights, ids, *w)


class SparseMoeBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        s = _moe_settings(cfg)
        activation(cfg.hidden_act)
        self.act, self.top_k, self.renormalize = cfg.hidden_act, s["top_k"], s["renormalize"]
        self.num_experts = s["experts"]
        self.expert_parallel = cfg.enable_expert_parallel
        self.gate = Linear(cfg.hidden_size, s["experts"], bias=False, dtype=dtype, rngs=rngs)
        self.experts = Experts(s["experts"], cfg.hidden_size, s["intermediate"], dtype=dtype,
                               rngs=rngs)
        if s["shared"]:
            self.shared_expert = MLP(cfg.hidden_size, s["shared"], act=cfg.hidden_act,
                                     dtype=dtype, rngs=rngs)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, dtype=dtype,
                                             rngs=rngs)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x, mesh=None):
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids, act=self.act, expert_parallel=self.expert_parallel,
                           mesh=mesh).astype(x.dtype)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _expert_specs(expert_parallel: bool):
    if expert_parallel:
        return (PartitionSpec(TP, None, None),) * 3
    return (PartitionSpec(None, None, TP), PartitionSpec(None, None, TP),
            PartitionSpec(None, TP, None))


def _sharded(run, mesh, expert_parallel: bool):
    """``run`` once per device on its shard of the experts, outputs summed over ``tp``."""

    def body(x, weights, ids, wg, wu, wd):
        first = jax.lax.axis_index(TP) * wg.shape[0] if expert_parallel else 0
        return jax.lax.psum(run(x, weights, ids, wg, wu, wd, first_expert=first), TP)

    rep = PartitionSpec()
    return sharding._shard_map(body, mesh, in_specs=(rep, rep, rep, *_expert_specs(
        expert_parallel)), out_specs=rep)


class MoeDecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.block = _moe_settings(cfg)["block"]
        if is_sparse_layer(cfg, layer):
            setattr(self, self.block, SparseMoeBlock(cfg, dtype=dtype, rngs=rngs))
        else:
            self.block = "mlp"
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act,
                           dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv, md, backend, mesh=None):
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, kv, md, backend, mesh)
        x = x + attn
        ffn = getattr(self, self.block)
        h = self.post_attention_layernorm(x)
        x = x + (ffn(h, mesh) if isinstance(ffn, SparseMoeBlock) else ffn(h))
        return x, kv


def gguf_config(a, cfg: dict, n_experts: int) -> None:
    """The experts' HF config fields from llama.cpp's metadata. Qwen3-MoE: llama.cpp always
    renormalises the top-k weights; Qwen2-MoE: as the file's ``expert_weights_norm`` says
    (absent: no, HF's default). A layer without a router is a dense MLP layer."""
    if not n_experts:
        return
    cfg["num_experts_per_tok"] = int(a("expert_used_count"))
    if cfg["model_type"] == "mixtral":
        cfg["num_local_experts"] = n_experts
        return
    dense = [i for i in range(cfg["num_hidden_layers"])
             if f"blk.{i}.ffn_gate_inp.weight" not in a.names]
    norm = True if cfg["model_type"] == "qwen3_moe" else bool(a("expert_weights_norm", False))
    cfg.update(num_experts=n_experts, norm_topk_prob=norm, decoder_sparse_step=1,
               mlp_only_layers=dense, moe_intermediate_size=int(a("expert_feed_forward_length")))
    if cfg["model_type"] == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = int(
            a("expert_shared_feed_forward_length", 0) or 0)


# Qwen2-MoE's shared expert beside the routed ones, and its sigmoid gate
GGUF_SHARED_EXPERT_NAMES = {"ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                            "ffn_up_shexp": "mlp.shared_expert.up_proj",
                            "ffn_down_shexp": "mlp.shared_expert.down_proj"}
GGUF_EXPERTS = ("mlp", _DEFAULT_EXPERT_NAMES)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE / Qwen2-MoE: the Llama family with sparse MoE layers."""

    decoder_layer = MoeDecoderLayer
    gguf = (  # Mixtral is llama.cpp's llama architecture with experts
        GGUFArch(None, "MixtralForCausalLM", "mixtral", llama_converter=True,
                 experts=("block_sparse_moe", _EXPERT_NAMES["mixtral"]), config=gguf_config),
        GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", experts=GGUF_EXPERTS,
                 config=gguf_config),
        GGUFArch("qwen2moe", "Qwen2MoeForCausalLM", "qwen2_moe", experts=GGUF_EXPERTS,
                 layer_names=GGUF_SHARED_EXPERT_NAMES, config=gguf_config),
    )

    def __init__(self, cfg: ModelConfig, **kw):
        if cfg.enable_expert_parallel and not num_experts(cfg):
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model")
        super().__init__(cfg, **kw)

    @classmethod
    def param_partition_spec(cls, name: str, cfg: ModelConfig) -> PartitionSpec:
        if ".experts." in name and name.rsplit(".", 1)[-1] in _DEFAULT_EXPERT_NAMES:
            specs = dict(zip(_DEFAULT_EXPERT_NAMES, _expert_specs(cfg.enable_expert_parallel)))
            return specs[name.rsplit(".", 1)[-1]]
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight",
                          "shared_expert_gate.weight")):
            return PartitionSpec()  # the router: every device routes every token
        return megatron_partition_spec(name)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig, tensors):
        """Per-expert HF tensors -> stacked ``experts.{gate,up,down}_proj`` (lazy)."""
        n = num_experts(cfg)
        block = _moe_settings(cfg)["block"]
        hf_names = _EXPERT_NAMES.get(cfg.model_type, _DEFAULT_EXPERT_NAMES)
        out = dict(tensors)
        for layer in range(cfg.num_layers):
            if not is_sparse_layer(cfg, layer):
                continue
            prefix = f"model.layers.{layer}.{block}.experts."
            for ours, theirs in zip(_DEFAULT_EXPERT_NAMES, hf_names):
                names = [f"{prefix}{e}.{theirs}.weight" for e in range(n)]
                if not all(nm in out for nm in names):
                    continue  # left to the loader's missing-tensor error
                loaders = [out.pop(nm) for nm in names]
                out[prefix + ours] = functools.partial(_stack_transposed, loaders)
        return out


def _stack_transposed(loaders):
    """HF ``[out, in]`` per expert -> ``[E, in, out]``."""
    return np.stack([np.asarray(f()).T for f in loaders])

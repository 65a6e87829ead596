"""Pipeline stages: what cuts one model into layer ranges, each on its own ``tp`` mesh.

    stage 0:   embed -> layers[0:a]          -> hidden ──device_put──┐
    stage 1:                 layers[a:b]     -> hidden ──device_put──┤ ...
    stage P-1:               layers[..:L] -> norm -> logits          (sampled on the last stage)

A stage (:class:`Stage`) is the model with the other stages' weights left out: its layers, the
embedding on the first stage, the final norm and LM head on the last. Its program
(:func:`stage_forward_fn`) is the single program's forward over its range
(``step_functions.run_stage``: ``ModelBase.run_layers``, the one layer loop), so any family
that gives its pieces is cut the same way, and pp 1 is the one stage over every layer. The runner (``worker.runner``, through ``worker.stage_pipeline``) holds the
stages; this module holds what is about stages alone: the layer partition, the start-up checks,
the meshes, and the cross-host hand-off (:class:`StageLink`).

Across hosts (``jax.distributed``), each process runs only the stages on its own devices (a
stage never spans hosts). Every process takes part in each hand-off, a ``psum`` over the ``pp``
axis of the ``(pp, tp)`` mesh in which only the sending stage contributes non-zeros.

The split is even (``num_layers / P`` each) unless ``JAXSERVE_PP_LAYER_PARTITION`` (or vLLM's
``VLLM_PP_LAYER_PARTITION``) gives each stage's count, e.g. ``"3,5"``.
"""
from __future__ import annotations

import os
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve import sharding
from jaxserve.config import EngineConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.models import batch_invariant
from jaxserve.worker import step_functions as step_fns
from jaxserve.worker.step_inputs import StepInputs


PARTITION_ENVS = ("JAXSERVE_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION")
FLAG = "--pipeline-parallel-size"


def layer_partition(num_layers: int, pp: int, env=None) -> list[tuple[int, int]]:
    """``[lo, hi)`` layers of each stage: an even split, or the partition the environment
    names. A split that does not fit is a start-up error naming the flag."""
    env = os.environ if env is None else env
    for name in PARTITION_ENVS:
        text = env.get(name)
        if not text:
            continue
        try:
            sizes = [int(x) for x in text.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != pp or min(sizes, default=0) < 1 or sum(sizes) != num_layers:
            raise InvalidRequestError(
                f"{name}={text!r} must give {pp} stages ({FLAG} {pp}) at least one layer each, "
                f"summing to the model's {num_layers} layers", param="pipeline_parallel_size")
        break
    else:
        if num_layers % pp:
            raise InvalidRequestError(
                f"{FLAG} {pp} does not divide the model's {num_layers} layers evenly; choose a "
                f"divisor or give each stage's layer count in {PARTITION_ENVS[0]}='a,b,...'",
                param="pipeline_parallel_size")
        sizes = [num_layers // pp] * pp
    bounds = np.cumsum([0] + sizes)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(pp)]


def check_config(config: EngineConfig) -> None:
    """What pipelining supports today; the rest is a start-up error, never a silent fallback."""
    if config.parallel.data_parallel_size > 1 and config.parallel.num_hosts > 1:
        raise InvalidRequestError(
            f"data_parallel_size > 1 with {FLAG} > 1 across hosts is not supported yet (one "
            "host: supported)", param="pipeline_parallel_size")
    if (config.speculative is not None and config.speculative.method == "draft_model"
            and config.parallel.num_hosts > 1):
        raise InvalidRequestError(
            f"speculative_config method 'draft_model' with {FLAG} > 1 runs on one host "
            "('ngram' works across hosts)", param="pipeline_parallel_size")


def check_model(model) -> None:
    """Stages are cut from a family that gives its forward in pieces (``embed``,
    ``layer_inputs``, ``run_layer``; ``supports_pipeline``): the Llama family (Llama, Mistral,
    Qwen2/3, Phi-3), the MoE families, Gemma 2/3/4 and Qwen3.5. Others are a start-up error
    naming the family and the flag."""
    name = type(model).__name__
    if not model.supports_pipeline:
        raise InvalidRequestError(
            f"{FLAG} > 1 does not support {name} yet (it does not give its forward in stage "
            f"pieces); serve it with {FLAG} 1 (tensor parallelism works)",
            param="pipeline_parallel_size")


def check_shared_kv(specs, partition, pp: int) -> None:
    """A KV-sharing layer reads its producer's pages: both must be in one stage (a start-up
    error naming the partition variable otherwise)."""
    stage_of = {i: s for s, (lo, hi) in enumerate(partition) for i in range(lo, hi)}
    for i, spec in enumerate(specs):
        p = getattr(spec, "producer_layer", None)
        if p is not None and stage_of[p] != stage_of[i]:
            sizes = ",".join(str(hi - lo) for lo, hi in partition)
            raise InvalidRequestError(
                f"layer {i} reads the KV pages of layer {p} (KV sharing), but {FLAG} {pp} puts "
                f"them in stages {stage_of[p]} and {stage_of[i]} (layers per stage: {sizes}); "
                f"give each stage's layer count in {PARTITION_ENVS[0]}='a,b,...' so that "
                "every KV-sharing layer is in its producer's stage",
                param="pipeline_parallel_size")


def draft_mesh(pipeline_mesh):
    """Where a draft model runs: the first device of the last stage, unsharded. Its proposals
    are made right after a plan is read from the last stage, while the next plan is still in
    the earlier stages, so the draft's steps fill the last stage's idle time."""
    return sharding.make_mesh(1, [sharding.stage_meshes(pipeline_mesh)[-1].devices.flat[0]])


def load_mesh(pipeline_mesh, tensor_parallel_size: int):
    """Where the checkpoint loads before the stages take their parts: this host's first stage
    (its tp mesh), or None (the plain path) when that stage is the default device alone."""
    first = sharding.stage_meshes(pipeline_mesh)[0]
    if (jax.process_count() == 1 and tensor_parallel_size == 1
            and first.devices.flat[0] == jax.devices()[0]):
        return None
    return next(m for m in sharding.stage_meshes(pipeline_mesh) if stage_is_local(m))


class StageLayers(nnx.Module):
    """A stage's share of the model's ``model`` submodule (same attribute names): its layers,
    at their model indices (``layers[i]`` is model layer ``i``; None for other stages' layers,
    vLLM's missing layers, so state paths and ``ModelBase.run_layers`` read model indices); on
    the first stage the embedding side (``embed_tokens`` and any other submodule but the layers
    and the norm, e.g. Gemma 4's per-layer embeddings); on the last the norm (and the embedding
    again when it is the tied LM head or the MTP head embeds its next tokens)."""

    def __init__(self, inner, lo: int, hi: int, first: bool, last: bool, embeds: bool):
        for name, value in vars(inner).items():
            if name.startswith("_") or name in ("layers", "norm", "embed_tokens"):
                continue
            if isinstance(value, (nnx.Module, nnx.Variable, jax.Array)) or value is None:
                setattr(self, name, nnx.data(value if first else None))
            else:
                setattr(self, name, value)
        self.embed_tokens = inner.embed_tokens if first or (last and embeds) else None
        n = len(inner.layers)
        self.layers = nnx.List([inner.layers[i] if lo <= i < hi else None for i in range(n)])
        self.norm = inner.norm if last else None


class Stage(nnx.Module):
    """One stage's part of a model: its layers, plus the embedding on the first stage and the
    final norm, LM head and MTP head on the last (a tied head is the embedding, copied). Made as
    a subclass of the family (:func:`make_stage`), it runs the family's own forward
    (``embed``, ``ModelBase.run_layers`` over ``[lo, hi)``, ``final_hidden``,
    ``compute_logits``) on its part: a stage is the model with the other stages' weights left
    out, the family's static settings copied."""

    supports_pipeline = True  # cut from a family that gives its forward in pieces

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, mesh):
        for name, value in vars(model).items():  # static settings (rope, backend, caps ...)
            if not name.startswith("_") and not isinstance(
                    value, (nnx.Module, nnx.Variable, jax.Array, nnx.List)):
                setattr(self, name, value)
        self.family = type(model)
        self.mesh = mesh  # this stage's tp mesh (None without tensor parallelism)
        self.first, self.last = first, last
        self.lo, self.hi = lo, hi  # the model layers this stage runs
        self.producers = model.kv_producers()  # the whole model's (its layers are not here)
        self.model = StageLayers(model.model, lo, hi, first, last,
                                 model.lm_head is None or model.mtp is not None)
        self.lm_head = model.lm_head if last else None
        # the vision tower (worker.mm_step) runs where the image embeddings are merged
        self.visual = nnx.data(model.visual if first else None)
        self.mtp = model.mtp if last else None  # drafts from the last stage's hidden states

    def kv_producers(self) -> tuple:
        return self.producers


@lru_cache(maxsize=None)
def stage_class(family: type) -> type:
    """``Stage`` over ``family``: the family's own methods (its forward pieces and the helpers
    they call, e.g. Gemma 4's per-layer inputs) run on a stage as on the whole model."""
    return type(f"{family.__name__}Stage", (Stage, family), {})


def make_stage(model, lo: int, hi: int, first: bool, last: bool, mesh) -> Stage:
    """Layers ``[lo, hi)`` of ``model`` as a stage of its family's stage class."""
    return stage_class(type(model))(model, lo, hi, first, last, mesh)


def state_sharding(mesh, tp: int):
    """A stage's state pool: split over its channel/head axis under tensor parallelism."""
    return sharding.state_pool_sharding(mesh) if tp > 1 else sharding.replicated(mesh)


@lru_cache(maxsize=None)
def stage_forward_fn(graphdef, state_treedef, mesh, last: bool,
                     state_layers: tuple[int, ...] = (), num_layers: int = 0,
                     snapshots: tuple[int, int] | None = None, invariant: bool = False):
    """One stage's program, jitted on its mesh:
    ``(leaves, kv_pages, inputs, lora, x, prev_tokens, embeds, mm) -> (x, kv_pages, captured)``,
    on the last stage ``(logits, kv_pages, hidden, captured)``: the single program's forward
    (``step_functions.run_stage``) over the stage's layers. The first stage takes token ids
    (``x`` unused) and, with ``--enable-prompt-embeds``, the ``[T, H]`` prompt embeddings; the
    others the previous stage's hidden states; ``mm``: a vision-language step's
    ``StepImages``, the stage's share (:func:`stage_images`). ``inputs``: the step's
    ``StepInputs``;
    ``lora``: this stage's layers' adapter slots (None: no LoRA). ``state_layers``: the
    stage's LinearState layers (stage-local indices), whose caches are state-pool arrays;
    ``num_layers``: the stage's; ``snapshots`` (first scratch slot, k): speculative
    snapshots (``step_functions.snapshot_slots``); ``invariant``: batch-invariant reductions
    (``models.batch_invariant``)."""

    def forward(state_leaves, kv_pages, step: StepInputs, lora, x, prev_tokens, embeds=None,
                mm=None):
        step_fns.TRACES.n += 1
        stage = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        with batch_invariant.mode(invariant):
            return step_fns.run_stage(stage, kv_pages, step, lora, x, prev_tokens, lo=stage.lo,
                                      hi=stage.hi, first=stage.first, last=stage.last,
                                      state_layers=state_layers, snapshots=snapshots,
                                      embeds=embeds, mm=mm)

    rep, pool = sharding.replicated(mesh), sharding.kv_pool_sharding(mesh)
    if state_layers:
        state = state_sharding(mesh, sharding.tp_size(mesh))
        pool = [state if j in state_layers else pool for j in range(num_layers)]
    return jax.jit(forward, donate_argnums=(1,),
                   out_shardings=(rep, pool, rep, rep) if last else (rep, pool, rep))


def stage_images(mm, i: int):
    """Stage ``i``'s share of a step's image inputs (``step_inputs.StepImages``): every stage
    the per-token positions (Qwen's M-RoPE) and ``kv_limit`` (bidirectional image runs), which
    its layers read and the hidden carry does not hold; the first stage also the encoder
    buffer and each token's row in it (it merges the image embeddings). The MTP head's
    ``next_rows`` go to no stage. None: a text-only model."""
    if mm is None:
        return None
    return mm._replace(next_rows=None) if i == 0 else mm._replace(rows=None, embeds=None,
                                                                  next_rows=None)


def place(state, mesh):
    """A stage's params on its mesh, each keeping its partition spec."""
    def put(x):
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else None
        target = NamedSharding(mesh, spec) if spec is not None else sharding.replicated(mesh)
        return jax.device_put(x, target)
    return jax.tree_util.tree_map(put, state)


def stage_is_local(mesh) -> bool:
    """Whether this process owns the stage; a stage whose devices span processes is an error."""
    owners = {d.process_index for d in mesh.devices.flat}
    if len(owners) > 1:
        raise InvalidRequestError(
            f"a pipeline stage spans hosts {sorted(owners)}: --tensor-parallel-size must not "
            f"exceed one host's devices with {FLAG} > 1", param="tensor_parallel_size")
    return owners == {jax.process_index()}


@lru_cache(maxsize=None)
def _psum_over_stages(mesh):
    spec = PartitionSpec(sharding.PP_AXIS)
    return jax.jit(sharding._shard_map(lambda g: jax.lax.psum(g, sharding.PP_AXIS), mesh,
                                       in_specs=(spec,), out_specs=spec))


class StageLink:
    """Cross-process hand-off between stages: ``send(value, src, shape, dtype)`` returns the
    value on every local stage's mesh. Every process calls it, in the same order; the
    processes that do not own stage ``src`` contribute zeros of the same shape."""

    def __init__(self, pipeline_mesh, stage_meshes, local: list[bool]):
        self.mesh = pipeline_mesh
        self.stage_meshes = stage_meshes
        self.local = local
        self.stage_of = {d: i for i, m in enumerate(stage_meshes) for d in m.devices.flat}

    def send(self, value, src: int, shape: tuple, dtype) -> dict[int, jax.Array]:
        shape, dtype = tuple(shape), jnp.dtype(dtype)
        if value is not None and (tuple(value.shape) != shape or value.dtype != dtype):
            raise ValueError(f"stage {src} sends {value.shape} {value.dtype}, "
                             f"the others expect {shape} {dtype}")
        on = {sh.device: sh.data for sh in value.addressable_shards} if value is not None else {}
        gs = NamedSharding(self.mesh, PartitionSpec(sharding.PP_AXIS))
        zeros = np.zeros((1,) + shape, dtype)
        parts = [on[d][None] if d in on else jax.device_put(zeros, d)
                 for d in gs.addressable_devices]
        g = jax.make_array_from_single_device_arrays((len(self.stage_meshes),) + shape, gs,
                                                     parts)
        out = _psum_over_stages(self.mesh)(g)
        by_stage: dict[int, list] = {}
        for sh in out.addressable_shards:
            by_stage.setdefault(self.stage_of[sh.device], []).append(sh.data[0])
        return {i: jax.make_array_from_single_device_arrays(
                    shape, sharding.replicated(self.stage_meshes[i]), xs)
                for i, xs in by_stage.items()}


def release_unused(model, kept: list) -> None:
    """Free the loaded arrays no local stage kept (moved to another stage's devices, or another
    host's layers), so a device holds its stages' weights only. ``model`` keeps the names."""
    keep = {id(x) for x in kept}
    for x in jax.tree_util.tree_leaves(nnx.state(model)):
        if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
            x.delete()


def abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


class StageLoRASlots:
    """Multi-LoRA under pipelining: each stage's ``LoRASlots`` holds its own layers' adapter
    weights on its own devices; an adapter is written into the same slot on every stage, and
    the plan's per-token slot indices go to every stage's program."""

    def __init__(self, stages: list):
        self.stages = stages

    def write(self, slot: int, adapter) -> None:
        for s in self.stages:
            s.write(slot, adapter)

    def clear(self, slot: int) -> None:
        for s in self.stages:
            s.clear(slot)

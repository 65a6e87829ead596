"""Pipeline parallelism: the model cut into stages of contiguous layers, one jitted program per
stage on the stage's own devices.

    stage 0:   embed -> layers[0:a]          -> hidden ──device_put──┐
    stage 1:                 layers[a:b]     -> hidden ──device_put──┤ ...
    stage P-1:               layers[..:L] -> norm -> logits -> sample (on the last stage)

Each stage holds its layers' weights and their part of the KV page pool (the same page ids on
every stage: one logical pool, one block manager), placed on its ``tp`` mesh
(``sharding.stage_meshes``); within a stage tensor parallelism (and expert parallelism) work as
without pipelining. The first stage embeds, the last computes the logits and samples. A stage
runs its family's own forward pieces (``embed``, ``layer_inputs``, ``run_layer``) on its part of
the model, so any family that gives them is cut the same way; what a stage holds besides pages
(Qwen3.5's state pools, LoRA slots) is its own layers' share, indexed by the ids the plan
carries to every stage. Speculative verify steps are multi-token steps like any other.

Nothing blocks between stages: each stage's program and the hand-off of the hidden states are
dispatched asynchronously, so while stage 1 runs step N, stage 0 is free to run step N+1. The
engine keeps up to P steps in flight, micro-batches of different requests
(``jaxserve.engine.pipelined``); a step whose rows need the previous step's sampled ids (async
placeholders) reads them from the last stage, which serialises it behind that step, so the
pipelined engine never schedules such rows.

Across hosts (``jax.distributed``), each process runs only the stages on its own devices (a
host is a stage or a group of stages; a stage never spans hosts). Every process replays every
step (``jaxserve.worker.multihost``) and takes part in each hand-off, a ``psum`` over the ``pp``
axis of the ``(pp, tp)`` mesh in which only the sending stage contributes non-zeros
(``StageLink``): the hidden states from stage *i* to *i+1*, then the logits from the last stage
to all, so every process samples the same ids (same seeds) on its own devices and the leader
reads its own copy. Each host loads the checkpoint onto its own devices, keeps its stages and
frees the rest.

The split is even (``num_layers / P`` each) unless ``JAXSERVE_PP_LAYER_PARTITION`` (or vLLM's
``VLLM_PP_LAYER_PARTITION``) gives each stage's count, e.g. ``"3,5"``.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
import threading
import time
import types
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve import sharding
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.kv_cache_spec import (LinearState, SharedKV, group_layers, group_pools,
                                         page_pools, state_groups)
from jaxserve.core.step_plan import StepPlan, seq_bucket
from jaxserve.errors import InvalidRequestError
from jaxserve.models.lora import LoRABatch
from jaxserve.worker import kv_cache_config
from jaxserve.worker import runner as runner_lib
from jaxserve.worker import step_functions as step_fns
from jaxserve.worker.step_inputs import StepInputs
from jaxserve.worker.kv_cache import (allocate_layer_pages, allocate_state_pool, fork_copy,
                                      fork_pairs, kv_cache_dtype, specs_page_bytes)

logger = logging.getLogger(__name__)

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
    if config.speculative is not None and config.speculative.method == "mtp":
        raise InvalidRequestError(
            f"speculative_config method 'mtp' with {FLAG} > 1 is not supported yet ('ngram' "
            "and 'draft_model' are)", param="speculative_config")


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
    """A stage's share of the model's ``model`` submodule (same attribute names): its layers;
    on the first stage the embedding side (``embed_tokens`` and any other submodule but the
    layers and the norm, e.g. Gemma 4's per-layer embeddings); on the last the norm (and the
    embedding again when it is the tied LM head)."""

    def __init__(self, inner, lo: int, hi: int, first: bool, last: bool, tied: bool):
        for name, value in vars(inner).items():
            if name.startswith("_") or name in ("layers", "norm", "embed_tokens"):
                continue
            if isinstance(value, (nnx.Module, nnx.Variable, jax.Array)) or value is None:
                setattr(self, name, nnx.data(value if first else None))
            else:
                setattr(self, name, value)
        self.embed_tokens = inner.embed_tokens if first or (last and tied) else None
        self.layers = nnx.List(list(inner.layers[lo:hi]))
        self.norm = inner.norm if last else None


class Stage(nnx.Module):
    """One stage's part of a model: its layers, plus the embedding on the first stage and the
    final norm and LM head on the last (a tied head is the embedding, copied). It runs the
    family's own forward pieces (``embed``, ``layer_inputs``, ``run_layer``,
    ``compute_logits``) on its part: a stage is the model with the other stages' weights left
    out, the family's static settings copied."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool, mesh,
                 shared_from: tuple = ()):
        for name, value in vars(model).items():  # static settings (rope, backend, caps ...)
            if not name.startswith("_") and not isinstance(
                    value, (nnx.Module, nnx.Variable, jax.Array, nnx.List)):
                setattr(self, name, value)
        self.family = type(model)
        self.mesh = mesh  # this stage's tp mesh (None without tensor parallelism)
        self.first, self.last = first, last
        self.layer_offset = lo  # the model layer of this stage's first layer
        # per stage layer: the stage layer whose pages it reads (KV sharing), or None
        self.shared_from = shared_from or (None,) * (hi - lo)
        self.model = StageLayers(model.model, lo, hi, first, last, model.lm_head is None)
        self.lm_head = model.lm_head if last else None

    def compute_logits(self, hidden):
        """``[N, H]`` final hidden states -> ``[N, V]`` float32 logits (last stage)."""
        return self.family.compute_logits(self, hidden)

    def __getattr__(self, name: str):
        """The family's other methods, run on this stage (a family's pieces call helpers
        of their own, e.g. Gemma 4's per-layer inputs)."""
        family = self.__dict__.get("family")
        fn = inspect.getattr_static(family, name, None) if family is not None else None
        if isinstance(fn, types.FunctionType) and not name.startswith("__"):
            return types.MethodType(fn, self)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def _stage_specs(specs, lo: int, hi: int) -> list:
    """Layers ``[lo, hi)``'s cache specs numbered within the stage (a KV-sharing layer's
    producer is in the same stage: ``check_shared_kv``)."""
    return [SharedKV(sp.producer_layer - lo) if isinstance(sp, SharedKV) else sp
            for sp in specs[lo:hi]]


def _state_sharding(mesh, tp: int):
    """A stage's state pool: split over its channel/head axis under tensor parallelism."""
    return sharding.state_pool_sharding(mesh) if tp > 1 else sharding.replicated(mesh)


@lru_cache(maxsize=None)
def stage_forward_fn(graphdef, state_treedef, mesh, last: bool,
                     state_layers: tuple[int, ...] = (), num_layers: int = 0):
    """One stage's program, jitted on its mesh:
    ``(leaves, kv_pages, inputs, lora, x, prev_tokens) -> (x, kv_pages)``, on the last stage
    ``(logits, kv_pages, hidden)`` as the single-program forward returns them. The first stage
    takes token ids (``x`` unused), the others the previous stage's hidden states. ``inputs``:
    the step's ``StepInputs``; ``lora``: this stage's layers' adapter slots (None: no LoRA). ``state_layers``: the stage's
    LinearState layers (stage-local indices), whose caches are state-pool arrays."""

    def forward(state_leaves, kv_pages, step: StepInputs, lora, x, prev_tokens):
        step_fns.TRACES.n += 1
        stage = nnx.merge(graphdef, jax.tree_util.tree_unflatten(state_treedef, state_leaves))
        family = stage.family
        md = step_fns.attention_metadata(
            step, state_slots=step_fns.trash_state_slots(step.state_slots, kv_pages,
                                                      state_layers))
        if stage.first:
            ref = step.prev_ref
            token_ids = jnp.where(ref >= 0, prev_tokens[jnp.maximum(ref, 0)], step.token_ids)
            x = family.embed(stage, token_ids)
        lora = LoRABatch(step.lora_slots, *lora) if lora is not None else None
        inputs = family.layer_inputs(stage, step.positions, md, step.positions.shape[0])
        new_pages = []
        for j, (layer, kv) in enumerate(zip(stage.model.layers, kv_pages)):
            if stage.shared_from[j] is not None:  # KV sharing: the producer's pages
                kv = new_pages[stage.shared_from[j]]
            x, kv = family.run_layer(stage, j, layer, x, inputs, kv, md, lora)
            new_pages.append(kv)
        new_pages = [() if src is not None else kv
                     for src, kv in zip(stage.shared_from, new_pages)]
        if not stage.last:
            return x, new_pages  # the hidden states (with PLE: and the per-layer inputs)
        hidden = family.final_hidden(stage, x)
        idx = step.logits_indices
        if idx.size > hidden.shape[0]:
            return stage.compute_logits(hidden)[idx], new_pages, hidden
        logits = stage.compute_logits(hidden[idx.reshape(-1)])
        return logits.reshape(idx.shape + logits.shape[-1:]), new_pages, hidden

    rep, pool = sharding.replicated(mesh), sharding.kv_pool_sharding(mesh)
    if state_layers:
        state = _state_sharding(mesh, sharding.tp_size(mesh))
        pool = [state if j in state_layers else pool for j in range(num_layers)]
    return jax.jit(forward, donate_argnums=(1,),
                   out_shardings=(rep, pool, rep) if last else (rep, pool))


def _place(state, mesh):
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


def _release_unused(model, kept: list) -> None:
    """Free the loaded arrays no local stage kept (moved to another stage's devices, or another
    host's layers), so a device holds its stages' weights only. ``model`` keeps the names."""
    keep = {id(x) for x in kept}
    for x in jax.tree_util.tree_leaves(nnx.state(model)):
        if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
            x.delete()


def _model_path(name: str, lo: int) -> str:
    """A stage's state path -> the model's (stage layer ``j`` is model layer ``lo + j``)."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    return f"model.layers.{int(m.group(1)) + lo}.{m.group(2)}" if m else name


def _abstract(tree):
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


class PipelineRunner(runner_lib.ModelRunner):
    """A ``ModelRunner`` whose step runs stage by stage (same plans, same outputs).

    Warm-up compiles the buckets smallest first on a thread (``start_warmup``; across hosts in
    the foreground): serving starts once the smallest is compiled and each step waits for its
    own bucket, never compiling it."""

    def __init__(self, model, model_config: ModelConfig, engine_config: EngineConfig,
                 max_model_len: int, dtype, mesh, param_bytes: int = 0,
                 extra_page_bytes: int = 0):
        check_model(model)
        self.model_config = model_config
        self.config = engine_config
        self.max_model_len = max_model_len
        self.block_size = engine_config.cache.block_size
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        sched = engine_config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        spec = engine_config.speculative
        # a verify step is a multi-token step through the stages; the last samples and verifies
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.ladder = runner_lib.token_ladder(sched.max_num_batched_tokens,
                                              sched.min_token_bucket, sched.token_bucket_growth)
        self.pipeline_mesh = mesh
        self.stage_meshes = sharding.stage_meshes(mesh)
        pp, tp = len(self.stage_meshes), sharding.tp_size(self.stage_meshes[0])
        self.local = [stage_is_local(m) for m in self.stage_meshes]
        # one process owns every stage, or (across hosts) a link carries what crosses them
        self.link = None if all(self.local) else StageLink(mesh, self.stage_meshes, self.local)
        # where sampling, its buffers and masks live: the last stage, or this host's first
        self.sample_stage = pp - 1 if self.link is None else self.local.index(True)
        self.mesh = self.stage_meshes[self.sample_stage]
        self.act_dtype = jnp.dtype(dtype)
        self.partition = layer_partition(model_config.num_layers, pp)
        self.kv_dtype = kv_cache_dtype(engine_config.cache.cache_dtype, dtype)
        specs = kv_cache_config.model_cache_specs(model, model_config, self.kv_dtype)
        check_shared_kv(specs, self.partition, pp)
        self.cache_specs = specs
        self.cache_groups = group_layers(specs)
        # LinearState (Gated DeltaNet) layers: a state pool per stage, one slot per request,
        # the same slot ids on every stage (the plan's state_slots reach every stage)
        self.state_layers = tuple(sorted(i for g in state_groups(self.cache_groups)
                                         for i in g.layers))
        # a pool per cache group (Gemma 4's sliding and global layers) as on one device, or
        # one pool: a page id indexes every layer; either way every stage holds its own
        # layers' part of each pool under the same page ids
        self.grouped = not self.state_layers and kv_cache_config.use_group_pools(
            model, self.cache_groups, engine_config, extra_page_bytes)
        self.pools = (group_pools(self.cache_groups) if self.grouped
                      else page_pools(self.cache_groups))
        self.num_cache_groups = len(self.pools)
        self.num_state_slots = None
        if self.state_layers and self.num_spec_tokens:  # no per-token state snapshots here
            raise InvalidRequestError(
                f"--speculative-config with {FLAG} > 1 on {type(model).__name__} (LinearState "
                "layers) is not supported yet: the stages keep no per-token state snapshots to "
                "roll rejected drafts back", param="speculative_config")
        self.lora = None  # StageLoRASlots when LoRA is on (set before warm-up)
        # every stage holds the same page ids for its own layers: size by the stage with the
        # most paged layers (the state pool: by the whole model's state, an upper bound)
        paged = [sum(not isinstance(sp, LinearState) for sp in specs[lo:hi])
                 for lo, hi in self.partition]
        lo, hi = self.partition[int(np.argmax(paged))]
        stage_pools = page_pools(group_layers(_stage_specs(specs, lo, hi)))
        stage_cfg = dataclasses.replace(model_config, num_layers=hi - lo)
        if self.grouped:  # each group's pages from the whole model's (an upper bound)
            sizes = kv_cache_config.group_pool_sizes(self.pools, stage_cfg, engine_config,
                                                max_model_len, param_bytes // (tp * pp), tp)
        elif self.state_layers:
            slots, sizes = kv_cache_config.state_pool_sizes(
                stage_pools, self.cache_groups, stage_cfg, engine_config, max_model_len,
                param_bytes // (tp * pp), tp)
            self.num_state_slots = sharding.agree_across_hosts(slots)
        else:
            sizes = kv_cache_config.pool_sizes(stage_pools, stage_cfg, engine_config, max_model_len,
                                          param_bytes // (tp * pp), tp, extra_page_bytes)
        self.pool_pages = tuple(sharding.agree_across_hosts(n) for n in sizes)
        self.num_pages = self.pool_pages[0]
        self.page_bytes = sum(p.page_bytes(self.block_size) for p in self.pools)  # all stages
        self.stage_pages, self._stage_leaves, self._stage_fns = [], [], []
        self._stage_defs = []  # (graphdef, state treedef) of each stage
        for i, ((lo, hi), smesh) in enumerate(zip(self.partition, self.stage_meshes)):
            shared = tuple(sp.producer_layer - lo if isinstance(sp, SharedKV) else None
                           for sp in specs[lo:hi])
            stage = Stage(model, lo, hi, first=i == 0, last=i == pp - 1,
                          mesh=smesh if tp > 1 else None, shared_from=shared)
            graphdef, state = nnx.split(stage)
            if not self.local[i]:  # another host's stage: its shapes only
                leaves, treedef = jax.tree_util.tree_flatten(_abstract(state))
                self._stage_defs.append((graphdef, treedef))
                self._stage_leaves.append(leaves)
                self._stage_fns.append(None)
                self.stage_pages.append([])
                continue
            leaves, treedef = jax.tree_util.tree_flatten(_place(state, smesh))
            self._stage_defs.append((graphdef, treedef))
            self._stage_leaves.append(leaves)
            local_state = tuple(j - lo for j in self.state_layers if lo <= j < hi)
            self._stage_fns.append(stage_forward_fn(graphdef, treedef, smesh, i == pp - 1,
                                                    local_state, hi - lo))
            self.stage_pages.append(self._stage_caches(lo, hi, smesh, tp))
        # the last stage's graph (its leaves are shapes only on another host)
        self.graphdef, last_treedef = graphdef, treedef
        # token bucket -> what a stage hands on (the hidden states; with Gemma 4's PLE, and
        # the per-layer inputs), as shapes: the cross-host hand-off sends each part
        self._carry_shapes: dict[int, object] = {}
        _release_unused(model, [x for leaves in self._stage_leaves for x in leaves])
        self._state_leaves = self._stage_leaves[-1]  # prompt logprobs run on the last stage
        self.num_top_logprobs = step_fns.top_logprobs_width(engine_config.max_logprobs,
                                                              model_config.vocab_size)
        self._prompt_logprobs = step_fns.prompt_logprobs_fn(self.graphdef, last_treedef,
                                                               self.num_top_logprobs)
        self._sample = step_fns.sample_fn(self.mesh, self.num_top_logprobs)
        # the research features are refused under pp (builder): their switches stay off
        self.logits_processors = None
        self.max_hidden_state_layers = 0
        self.enable_prompt_embeds = False
        self.batch_invariant = False
        self._captured = None
        self._final_hidden = None
        self.mm = None
        self.num_compiles = 0
        self.enforce_eager = engine_config.enforce_eager
        self._pool_lock = threading.RLock()
        self._warmup = None  # the base runner's BucketWarmup: not used (see start_warmup)
        self._warm = False  # every bucket compiled
        self._warm_thread: threading.Thread | None = None
        self._warm_stop = False
        self._warm_error: BaseException | None = None
        self._warm_seconds = 0.0
        self._ready: list[int] = []  # compiled token buckets, smallest first
        self._ready_cv = threading.Condition()
        self._on_token_limit = None
        self._count_lock = threading.Lock()
        self._ones_bitmasks = {}
        self._last_tokens = self._device_zeros((self.max_num_seqs,), jnp.int32)
        # the first stage's placeholder source when no row has one (no wait on the last stage)
        self._no_tokens = None if not self.local[0] else jax.device_put(
            np.zeros(self.max_num_seqs, np.int32), sharding.replicated(self.stage_meshes[0]))
        self._prompt_logprobs_shapes: dict[int, object] = {}  # token bucket -> outputs (link)
        self._pending = None  # across hosts: (handle, last stage's raw outputs) of one plan
        logger.info("pipeline: %d stages x tp %d, layers %s; KV cache: %d pages of %d tokens "
                    "(%.1f MiB per stage at most)", pp, tp, self.partition, self.num_pages,
                    self.block_size, max(
                        self.num_pages * specs_page_bytes(specs[lo:hi], self.block_size)
                        for lo, hi in self.partition) / 2**20)

    def _stage_caches(self, lo: int, hi: int, smesh, tp: int) -> list:
        """One stage's caches (layers ``[lo, hi)``): pages of its attention layers (the shared
        page ids, of each layer's group's pool when grouped), state-pool arrays of its
        LinearState layers (the shared slot ids); ``()`` for a KV-sharing layer."""
        kv = sharding.kv_pool_sharding(smesh)
        if self.grouped:
            group_of = {i: g for g, grp in enumerate(self.cache_groups) for i in grp.layers}
            return [allocate_layer_pages([self.cache_specs[i]], self.pool_pages[group_of[i]],
                                         self.block_size, self.kv_dtype, sharding=kv, tp=tp)[0]
                    if i in group_of else () for i in range(lo, hi)]
        specs = self.cache_specs[lo:hi]
        pages = iter(allocate_layer_pages(
            [sp for sp in specs if not isinstance(sp, LinearState)], self.num_pages,
            self.block_size, self.kv_dtype, sharding=kv, tp=tp))
        return [allocate_state_pool(sp, self.num_state_slots, _state_sharding(smesh, tp))
                if isinstance(sp, LinearState) else next(pages) for sp in specs]

    def make_lora_slots(self, targets, max_loras: int, max_rank: int, dtype):
        from jaxserve.lora.slots import LoRASlots

        return StageLoRASlots([
            LoRASlots(targets, self.model_config.num_layers, max_loras, max_rank, dtype,
                      mesh=smesh, weight_specs=targets.specs, layers=(lo, hi))
            for (lo, hi), smesh in zip(self.partition, self.stage_meshes)])

    def weight_leaves(self) -> list:
        """Every stage's parameter arrays (on their own devices)."""
        return [x for leaves in self._stage_leaves for x in leaves]

    def _stage_lora(self, i: int):
        """Stage ``i``'s adapter slots' weights (None without LoRA)."""
        return None if self.lora is None else self.lora.stages[i].arrays

    @property
    def kv_pages(self) -> list:
        """Every layer's ``(k_pages, v_pages)``, stage by stage."""
        return [kv for pages in self.stage_pages for kv in pages]

    @property
    def num_stages(self) -> int:
        return len(self.stage_meshes)

    # ---- the step ----------------------------------------------------------------------
    def _forward_stages(self, plan: StepPlan, before_last=None, gather: bool = True):
        """The stages in order; returns the last stage's (logits, pages, hidden). Across hosts:
        (logits on the sampling stage, None, hidden on the last stage or None), or with
        ``gather=False`` the last stage's (logits, hidden) as they are (None on other hosts);
        ``before_last()`` runs after the hand-off into the last stage, before its program."""
        inputs = self._step_inputs(plan)[0]
        prev = self._no_tokens
        if self.local[0] and np.any(plan.prev_ref >= 0):  # placeholders: wait for the ids
            prev = jax.device_put(self._last_tokens, sharding.replicated(self.stage_meshes[0]))
        x, out = None, None
        t = plan.token_bucket
        last = len(self._stage_fns) - 1
        for i, fn in enumerate(self._stage_fns):
            if i and self.link is None:
                x = jax.device_put(x, sharding.replicated(self.stage_meshes[i]))
            elif i:  # every process joins the hand-off from stage i-1
                x = self._send_carry(x if self.local[i - 1] else None, i - 1, t).get(i)
            if i == last and before_last is not None:
                before_last()
            if fn is not None:
                out = fn(self._stage_leaves[i], self.stage_pages[i], inputs,
                         self._stage_lora(i), x, prev if i == 0 else None)
                x, self.stage_pages[i] = out[0], out[1]
            else:
                x = None
        if self.link is None:
            return out
        logits, hidden = (out[0], out[2]) if self.local[last] else (None, None)
        return self._gather_logits(plan, logits, hidden) if gather else (logits, hidden)

    def _send_carry(self, x, src: int, t: int) -> dict:
        """Across hosts: what stage ``src`` hands on, a leaf at a time (every process calls
        it; ``x`` is None where ``src`` is not local)."""
        shapes = self._carry_shapes.get(t)
        if shapes is None:
            graphdef, treedef = self._stage_defs[0]

            def embed(leaves, ids):
                stage = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
                return stage.family.embed(stage, ids)

            shapes = self._carry_shapes[t] = jax.eval_shape(
                embed, _abstract(self._stage_leaves[0]), jax.ShapeDtypeStruct((t,), jnp.int32))
        specs, treedef = jax.tree_util.tree_flatten(shapes)
        values = jax.tree_util.tree_leaves(x) if x is not None else [None] * len(specs)
        sent = [self.link.send(v, src, a.shape, a.dtype) for v, a in zip(values, specs)]
        return {i: jax.tree_util.tree_unflatten(treedef, [s[i] for s in sent])
                for i in sent[0]}

    def _gather_logits(self, plan: StepPlan, logits, hidden):
        """Across hosts: the last stage's logits to every host's sampling stage."""
        last = len(self._stage_fns) - 1
        idx = (plan.spec_logits_indices if plan.spec_logits_indices is not None
               else plan.logits_indices)  # [S], or [S, k+1] when speculating
        shape = idx.shape + (self.model_config.vocab_size,)
        logits = self.link.send(logits, last, shape, jnp.float32)[self.sample_stage]
        return logits, None, hidden

    # ---- across hosts: each plan's logits hand-off deferred to the next dispatch -----------
    # A host's device runs programs and collectives in the order they were issued. Were plan
    # N's logits hand-off (last stage -> all) issued right after plan N's stages, stage 0's
    # host would sit in it until the last stage finished N, then run N+1: no overlap. It is
    # issued during plan N+1's dispatch instead, after the hand-off into the last stage and
    # before the last stage's program; two stages then run as
    #     stage 0 host:    stage0(N+1) | x(N+1) | logits(N) | stage0(N+2) | x(N+2) | ...
    #     last stage host:               x(N+1) | logits(N) | stage1(N+1)        ...
    # so stage0(N+2) runs while stage1(N+1) does. A plan read before the next dispatch is
    # finished by ``dispatch(None)``, which the leader broadcasts like a step (every host
    # finishes it, in the same order).
    def dispatch(self, plan: StepPlan | None):
        if self.link is None:
            return super().dispatch(plan)
        with self._pool_lock:
            if plan is None:
                self._finish_pending()
                return None
            before = step_fns.TRACES.n
            raw = self._forward_stages(plan, before_last=self._finish_pending, gather=False)
            h = runner_lib.StepHandle(plan, None, None,
                                      bool(np.any(plan.sampling["num_logprobs"] >= 0)), None)
            self._pending = (h, raw)
            self._count_step_compiles(before, plan)
        return h

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        h, (logits, hidden) = pending
        plan = h.plan
        before = step_fns.TRACES.n
        logits, _, hidden = self._gather_logits(plan, logits, hidden)
        out, self._last_tokens = self.sample(logits, self._step_inputs(plan)[1],
                                             self._last_tokens, self._bitmask(plan))
        h.sampled, h.verify = out if self.num_spec_tokens else (out, None)
        if plan.prompt_next_ids is not None:
            h.prompt_logprobs = self._prompt_logprobs_everywhere(hidden, plan.prompt_next_ids)
        self._count_step_compiles(before, plan)
        for x in self._handle_arrays(h):
            x.copy_to_host_async()

    def fetch(self, h):
        if h.sampled is None:  # still pending: through the leader's broadcast when wrapped
            self.dispatch(None)
        return super().fetch(h)

    def _count_step_compiles(self, before: int, plan: StepPlan) -> None:
        if step_fns.TRACES.n != before:
            self._add_compiles(step_fns.TRACES.n - before)
            if self._warm:
                logger.warning("compile caused by a step (token bucket %d): this is a bug",
                               plan.token_bucket)

    def _prompt_logprobs_everywhere(self, hidden, next_ids):
        """The prompt logprobs, computed on the last stage (and sent to every host)."""
        if self.link is None:
            return self._prompt_logprobs(self._state_leaves, hidden, next_ids)
        last = len(self._stage_fns) - 1
        t = int(next_ids.shape[0])
        shapes = self._prompt_logprobs_shapes.get(t)
        if shapes is None:
            shapes = self._prompt_logprobs_shapes[t] = jax.eval_shape(
                self._prompt_logprobs, _abstract(self._state_leaves),
                jax.ShapeDtypeStruct((t, self.model_config.hidden_size), self.act_dtype),
                jax.ShapeDtypeStruct((t,), jnp.int32))
        res = (self._prompt_logprobs(self._state_leaves, hidden, next_ids)
               if self.local[last] else None)
        flat, treedef = jax.tree_util.tree_flatten(shapes)
        vals = jax.tree_util.tree_leaves(res) if res is not None else [None] * len(flat)
        sent = [self.link.send(v, last, a.shape, a.dtype)[self.sample_stage]
                for v, a in zip(vals, flat)]
        return jax.tree_util.tree_unflatten(treedef, sent)

    def _run(self, plan: StepPlan, mm=None, host_logits=None):
        if mm is not None or host_logits is not None:
            raise ValueError("pipeline stages take no image arrays or host logits processors")
        self._wait_bucket(plan.token_bucket)
        with self._pool_lock:
            before = step_fns.TRACES.n
            logits, _, hidden = self._forward_stages(plan)
            out, self._last_tokens = self.sample(logits, self._step_inputs(plan)[1],
                                                 self._last_tokens, self._bitmask(plan))
            if plan.prompt_next_ids is not None:
                out = (out, self._prompt_logprobs_everywhere(hidden, plan.prompt_next_ids))
            self._count_step_compiles(before, plan)
        return out

    # ---- weights in place (jaxserve.engine.weight_sync) -------------------------------------
    def stage_param_names(self) -> list[list[str]]:
        """Each stage's params by the model's state path (its layers numbered as the model's)."""
        names = getattr(self, "_stage_names", None)
        if names is None:
            from jaxserve.worker.weight_update import state_names

            names = self._stage_names = [
                [_model_path(n, lo) for n in state_names(jax.tree_util.tree_unflatten(td, lv))]
                for (lo, _), (_, td), lv in zip(self.partition, self._stage_defs,
                                                self._stage_leaves)]
        return names

    def set_stage_params(self, stage_leaves: list[list]) -> None:
        """Swap every stage's leaves between steps (each with its old leaf's placement)."""
        with self._pool_lock:
            self._stage_leaves = [list(x) for x in stage_leaves]
            self._state_leaves = self._stage_leaves[-1]

    # ---- warm-up: every bucket, smallest first, on a thread (or in the foreground) ----------
    # Each bucket's stage programs are lowered and compiled without the pool lock (steps on
    # the compiled buckets keep running meanwhile), then run once under it with the sampler
    # and prompt-logprobs graphs. Steps use the compiled buckets only (``_plan_ladder``; the
    # scheduler hears the largest through ``on_token_limit``) and wait for one still compiling
    # rather than compile it. Across hosts the warm-up steps hold collectives that every host
    # must issue in the same order as its steps, so it runs in the foreground there.
    def warmup(self) -> float:
        if self.enforce_eager:
            self._skip_warmup()
            return 0.0
        self.start_warmup()
        self._warm_thread.join()
        if self._warm_error is not None:
            raise self._warm_error
        return self._warm_seconds

    def start_warmup(self, workers: int | None = None, on_token_limit=None) -> None:
        if self.enforce_eager:
            self._skip_warmup()
            return
        if self._warm_thread is not None:
            return
        self._on_token_limit = on_token_limit
        if on_token_limit is not None:
            on_token_limit(self.step_token_limit())
        self._warm_thread = threading.Thread(target=self._warm_all, name="pipeline-warmup",
                                             daemon=True)
        self._warm_thread.start()
        if self.link is not None:  # across hosts: in lockstep with the other hosts
            self._warm_thread.join()

    def _warm_all(self) -> None:
        t0 = time.perf_counter()
        try:
            for t in self.ladder:
                if self._warm_stop:
                    return
                before = step_fns.TRACES.n
                self._warm_bucket(t)
                self._add_compiles(step_fns.TRACES.n - before)
                with self._ready_cv:
                    self._ready.append(t)
                    self._warm = len(self._ready) == len(self.ladder)
                    self._ready_cv.notify_all()
                    if self._on_token_limit is not None:
                        self._on_token_limit(self.step_token_limit())
                logger.info("compiled token bucket %d (%d/%d) on %d stages", t,
                            len(self._ready), len(self.ladder), self.num_stages)
        except BaseException as e:  # a step waiting for a bucket hears it
            self._warm_error = e
            with self._ready_cv:
                self._ready_cv.notify_all()
            logger.exception("pipeline warm-up failed")
            return
        self._warm_seconds = time.perf_counter() - t0
        logger.info("warm-up: %d compiles for token buckets %s on %d stages in %.1f s",
                    self.num_compiles, list(self.ladder), self.num_stages, self._warm_seconds)

    def _warmup_plans(self, t: int) -> tuple[int, list[StepPlan]]:
        from jaxserve.worker import warmup as w

        s = seq_bucket(t, self.max_num_seqs)
        plans = [w.warmup_plan(self, t, s, full) for full in (False, True)]
        if self.lora is not None:  # the adapters' side of the delta
            plans[1] = dataclasses.replace(plans[1],
                                           lora_slots=np.zeros_like(plans[1].lora_slots))
        return s, plans

    def _compile_stages(self, plan: StepPlan) -> None:
        """Lower and compile bucket ``plan.token_bucket``'s stage programs (no run, no lock:
        the step's later call finds them compiled)."""
        from jaxserve.worker.compile_pool import TRACE_LOCK

        with self._pool_lock:  # the arrays of the moment (their shapes and shardings)
            leaves, pages = list(self._stage_leaves), list(self.stage_pages)
            prev = self._no_tokens
            inputs = self._step_inputs(plan)[0]
            loras = [self._stage_lora(i) for i in range(self.num_stages)]
        x = None
        for i, fn in enumerate(self._stage_fns):
            if fn is None:
                return
            with TRACE_LOCK:
                lowered = fn.lower(leaves[i], pages[i], inputs, loras[i], x,
                                   prev if i == 0 else None)
            out = lowered.compile().out_info[0]
            if i + 1 < len(self._stage_fns):
                rep = sharding.replicated(self.stage_meshes[i + 1])
                x = jax.tree_util.tree_map(
                    lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=rep), out,
                    is_leaf=lambda o: hasattr(o, "dtype") and hasattr(o, "shape"))

    def _warm_bucket(self, t: int) -> None:
        """Bucket ``t``: its stage programs compiled, then run with the sampler (both
        layouts, the other sampling branches, drafts) and the prompt logprobs."""
        from jaxserve.worker import warmup as w

        s, plans = self._warmup_plans(t)
        if self.link is None:
            self._compile_stages(plans[0])
        with self._pool_lock:
            for plan in plans:
                logits, _, hidden = self._forward_stages(plan)
                jax.block_until_ready(self.sample(logits, self._step_inputs(plan)[1],
                                                  self._last_tokens, self._ones_bitmask(s)))
            half = w.warmup_bitmask(self, s)
            for p in w._WARMUP_OTHER_BRANCHES + w._WARMUP_FULL_LAYOUT:
                jax.block_until_ready(self.sample(
                    logits, w.sampler_variant(self, w.warmup_sampling(self, p, s), s),
                    self._last_tokens, half))
            jax.block_until_ready(self._prompt_logprobs_everywhere(
                hidden, np.zeros(t, np.int32)))

    def _wait_bucket(self, t: int) -> None:
        """A step waits for its bucket to be compiled: it never compiles."""
        if self._warm or self._warm_thread is None:
            return
        with self._ready_cv:
            while t not in self._ready and self._warm_error is None and not self._warm_stop:
                self._ready_cv.wait()
        if self._warm_error is not None:
            raise RuntimeError("pipeline warm-up failed") from self._warm_error

    @property
    def warmed_up(self) -> bool:
        return self._warm

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve: the smallest bucket compiled, buckets compiled, buckets)."""
        n = len(self.ladder)
        if self.enforce_eager:
            return True, 0, n
        ready = list(self._ready)
        return self.ladder[0] in ready, len(ready), n

    def step_token_limit(self) -> int | None:
        """While buckets compile, the largest compiled one (the smallest before any)."""
        if self._warm or self.enforce_eager:
            return None
        return max(self._ready, default=self.ladder[0])

    def _plan_ladder(self) -> tuple[int, ...]:
        """The compiled buckets, and those above the largest compiled (a step too big for
        every compiled bucket waits for the smallest that fits)."""
        if self._warm or self._warm_thread is None:
            return self.ladder
        ready = list(self._ready)
        top = max(ready, default=0)
        return tuple(t for t in self.ladder if t in ready or t > top)

    def stop_warmup(self) -> None:
        """Drop the buckets not started and wait for the one compiling."""
        self._warm_stop = True
        with self._ready_cv:
            self._ready_cv.notify_all()
        if self._warm_thread is not None and self._warm_thread is not threading.current_thread():
            self._warm_thread.join()

    # ---- swap ----------------------------------------------------------------------------
    def swap_in(self, page_ids: list[int], saved) -> None:
        """Write a swapped request's pages back, stage by stage (paged layers only)."""
        idx = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        saved = iter(saved)
        with self._pool_lock:
            for i, smesh in enumerate(self.stage_meshes):
                lo, hi = self.partition[i]
                layers = [j for j in range(hi - lo) if lo + j not in self.state_layers]
                if not layers:
                    continue
                written = runner_lib._write_pages([self.stage_pages[i][j] for j in layers], idx,
                                                  [next(saved) for _ in layers])
                written = jax.device_put(written, sharding.kv_pool_sharding(smesh))
                pages = list(self.stage_pages[i])
                for j, kv in zip(layers, written):
                    pages[j] = kv
                self.stage_pages[i] = pages

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """n > 1 siblings start from their first child's computed prompt: on every stage its
        layers' pages and recurrent states copied into theirs, in step order."""
        src, dst = fork_pairs(pages, 0)  # page 0: the trash page
        trash_slot = self.num_state_slots or 0  # the state pool's last slot
        ssrc, sdst = fork_pairs(slots, trash_slot)
        with self._pool_lock:
            for i, smesh in enumerate(self.stage_meshes):
                if not self.local[i]:
                    continue
                lo, hi = self.partition[i]
                state = tuple(j - lo for j in self.state_layers if lo <= j < hi)
                paged = tuple(j for j in range(hi - lo) if j not in state
                              and len(self.stage_pages[i][j]))
                pool = fork_copy(list(self.stage_pages[i]), paged, state, src, dst, ssrc, sdst)
                tp = sharding.tp_size(smesh)
                kv, st = sharding.kv_pool_sharding(smesh), _state_sharding(smesh, tp)
                self.stage_pages[i] = [jax.device_put(c, st if j in state else kv)
                                       for j, c in enumerate(pool)]

    def swap_in_state(self, slot: int, saved) -> None:
        """Write a swapped request's recurrent state into its (new) slot on every stage."""
        saved = iter(saved)
        with self._pool_lock:
            for i, smesh in enumerate(self.stage_meshes):
                lo, hi = self.partition[i]
                layers = [j for j in range(hi - lo) if lo + j in self.state_layers]
                if not layers:
                    continue
                written = runner_lib._write_slot(
                    [self.stage_pages[i][j] for j in layers], jnp.int32(slot),
                    [tuple(jnp.asarray(a) for a in next(saved)) for _ in layers])
                tp = sharding.tp_size(smesh)
                written = jax.device_put(written, _state_sharding(smesh, tp))
                pages = list(self.stage_pages[i])
                for j, arrs in zip(layers, written):
                    pages[j] = arrs
                self.stage_pages[i] = pages

"""The model runner: one jitted step per token bucket, KV pool donated, compile counter.

    step(state, kv_pages, StepInputs, SamplerInputs) -> (sampler output, kv_pages)

Each half takes its inputs as one packed buffer (``worker.step_inputs``).

The model is split into a static graph and a state pytree once (``nnx.split``); the step merges
them inside ``jit``, so params are ordinary jit arguments and the graph is a closure. Every new
trace of the step is a compile: the counter counts traces, and anything after warm-up is a bug.

One entry, two halves: ``dispatch(plan)`` enqueues the step on the device and returns at once
(JAX dispatches asynchronously) with the host copy of its results under way; ``fetch(handle)``
waits for that copy. The sampled ids also stay on the device in a fixed ``[max_num_seqs]``
buffer, which the next step reads for its placeholder tokens (``plan.prev_ref``), so an engine
can build and dispatch step N+1 before it has seen step N's ids.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.models import batch_invariant
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.worker.compile_pool import CompilePool
from jaxserve.worker.warmup import BucketWarmup, freeze_startup_heap
from jaxserve.worker.kv_cache import allocate_kv_cache, kv_cache_dtype
from jaxserve.worker.kv_cache_log import log_kv_config
from jaxserve.worker.kv_moves import PoolMoves
from jaxserve.worker.stage_pipeline import PipelineStages
from jaxserve.worker.kv_cache_config import (agree_across_hosts, kv_cache_config,
                                             model_cache_specs)
from jaxserve.worker.step_functions import (TRACES, forward_fn, mtp_fn, prompt_logprobs_fn,
                                            rollback_fn, sample_fn, top_logprobs_width)
from jaxserve.core.kv_cache_spec import group_layers, state_groups
from jaxserve.core.step_plan import ARRAY_FIELDS, StepPlan, seq_bucket, token_ladder
from jaxserve.worker.step_inputs import SamplerInputs, StepInputs, pack

logger = logging.getLogger(__name__)

# the StepPlan is a pytree: its arrays are leaves, its counts static (core/ imports no jax)
jax.tree_util.register_dataclass(StepPlan, data_fields=list(ARRAY_FIELDS),
                                 meta_fields=["num_seqs", "num_tokens"])



def _captures(plan: StepPlan) -> bool:
    """Whether a row of the step asked for hidden states (only then are they copied back)."""
    return plan.hidden_layers is not None and bool((plan.hidden_layers[:plan.num_seqs] >= 0).any())


@dataclass
class StepHandle:
    """A dispatched step: device arrays whose host copies are under way."""

    plan: StepPlan
    sampled: object  # SamplerOutput on device
    prompt_logprobs: tuple | None = None
    want_topk: bool = False
    verify: object = None  # rejection_sampler.VerifyOutput on device (speculative decoding)
    drafts: object = None  # [S, k] the MTP head's drafts for each row's next step, on device
    hidden_states: object = None  # [T, K, H] captured residual streams (a row asked), on device
    final_hidden: object = None  # [T, H] the final hidden states (a row pools), on device


@dataclass
class StepOutput:
    """Host copies of what the step sampled, one entry per plan row."""

    token_ids: np.ndarray  # [S] int32
    logprobs: np.ndarray  # [S] float32
    topk_ids: np.ndarray | None = None  # [S, K]
    topk_logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    # (logprob [T], top-k ids [T, K], top-k logprobs [T, K], rank [T]) of each next prompt token
    prompt_logprobs: tuple | None = None
    # speculative decoding: [S, k+1] emitted tokens (-1 padded) and [S] how many
    spec_token_ids: np.ndarray | None = None
    num_emitted: np.ndarray | None = None
    draft_ids: np.ndarray | None = None  # [S, k] the MTP head's drafts (method "mtp")
    # [num_tokens, K, H] float32 the residual stream at each token's row's asked layers
    hidden_states: np.ndarray | None = None
    # [S, H] float32 each row's final hidden state at its last token (plan.pool_rows)
    final_hidden: np.ndarray | None = None


def enable_compilation_cache(path: str | None = None) -> None:
    """Persist compiled steps on disk so a restart (or a second engine) skips XLA compiles."""
    import os

    # the sampler's graphs compile in well under JAX's default 1 s floor: keep them too
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    if jax.config.jax_compilation_cache_dir:
        return
    path = path or os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                "jaxserve", "xla-cache")
    jax.config.update("jax_compilation_cache_dir", path)


class ModelRunner(PoolMoves):
    """The one runner: tensor parallel on ``mesh``, or pipeline stages on ``pipeline_mesh``
    (a ``(pp, tp)`` mesh; ``self.stages``), each stage a layer range with its share of the
    weights and of the pools; the sampler, warm-up and handles are the same either way."""

    kv_config = None  # core.kv_cache_config.KVCacheConfig (pipeline stages: over each range)

    def __init__(self, model, model_config: ModelConfig, engine_config: EngineConfig,
                 max_model_len: int, dtype, param_bytes: int = 0, kv_sharding=None, mesh=None,
                 extra_page_bytes: int = 0, pipeline_mesh=None):
        self.model_config = model_config
        self.config = engine_config
        self.max_model_len = max_model_len
        self.block_size = engine_config.cache.block_size
        self.max_pages_per_seq = -(-max_model_len // self.block_size)
        sched = engine_config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        spec = engine_config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # return_hidden_states: layers captured per token (the static width; 0 = none)
        self.max_hidden_state_layers = engine_config.max_hidden_state_layers
        # --enable-prompt-embeds: the forward takes [T, H] embeddings beside the token ids
        self.enable_prompt_embeds = engine_config.enable_prompt_embeds
        self._zero_embeds: dict[int, jax.Array] = {}
        # method "mtp": the model's MTP head drafts inside every step (its pages the last layer)
        self.mtp = spec is not None and spec.method == "mtp"
        if self.mtp and model.mtp is None:
            raise ValueError("speculative_config.method 'mtp' needs a model built with its "
                             "multi-token-prediction head (ModelConfig.load_mtp)")
        min_bucket = sched.min_token_bucket
        if engine_config.batch_invariant:  # below it XLA:CPU emits its dots another way
            min_bucket = max(min_bucket, batch_invariant.MIN_TOKEN_BUCKET)
        self.ladder = token_ladder(sched.max_num_batched_tokens, min_bucket,
                                   sched.token_bucket_growth)
        self.mesh = mesh  # tensor parallel (jaxserve.sharding); None: single device
        self.lora = None  # jaxserve.lora.slots.LoRASlots when LoRA is on (set before warm-up)
        self.mm = None  # worker.mm_step.EncoderRunner of a vision-language model (ditto)
        tp = sharding.tp_size(mesh)
        if mesh is not None:
            kv_sharding = sharding.kv_pool_sharding(mesh)
        self.kv_dtype = kv_cache_dtype(engine_config.cache.cache_dtype, dtype)
        # layers grouped by cache spec (core.kv_cache_spec); one KVCacheConfig (pools named
        # by group, pages, state slots) sized once: over the whole model, or over each pipeline
        # stage's layer range (every stage holds the same page ids and slots of each pool)
        self.cache_specs = model_cache_specs(model, model_config, self.kv_dtype)
        self.cache_groups = group_layers(self.cache_specs)
        self.state_layers = tuple(sorted(i for g in state_groups(self.cache_groups)
                                         for i in g.layers))
        self.stages: PipelineStages | None = None
        pp = 1
        if pipeline_mesh is not None:  # per stage: its layers' share of each pool, same ids
            self.stages = PipelineStages(self, model, pipeline_mesh)
            self.mesh, tp = self.stages.mesh, sharding.tp_size(self.stages.mesh)
            pp = self.stages.num_stages
        self.kv_config = c = agree_across_hosts(kv_cache_config(
            model, model_config, engine_config, max_model_len, self.kv_dtype,
            param_bytes // (tp * pp), tp, extra_page_bytes, specs=self.cache_specs,
            stages=self.stages.ranges if self.stages is not None else ()))
        self.grouped = c.per_group_pools
        self.num_state_slots = c.num_state_slots  # None: no LinearState layers
        self.pools, self.pool_pages = tuple(p.pool for p in c.pools), c.pool_pages
        # speculating with LinearState layers: k scratch slots per row after the requests'
        # slots hold the verify rows' per-token snapshots (rollback: rollback_fn)
        self.snapshots = (self.num_state_slots, self.num_spec_tokens) if c.scratch_slots \
            else None  # (first scratch slot, k)
        if self.stages is not None:
            self.stages.build(model, dtype)
        else:
            self.kv_pages = allocate_kv_cache(
                c, self.kv_dtype, kv_sharding=kv_sharding, tp=tp,
                state_sharding=sharding.state_pool_sharding(mesh) if mesh is not None else None)
        self.num_pages = self.pool_pages[0]
        self.num_cache_groups = len(self.pools)  # block tables per plan row
        self.page_bytes = sum(p.page_bytes(self.block_size) for p in self.pools)
        if self.stages is None:
            self.graphdef, self.state = nnx.split(model)
            self._state_leaves, treedef = jax.tree_util.tree_flatten(self.state)
        else:  # prompt logprobs (and the MTP head) run on the last stage's weights
            self.graphdef, treedef = self.stages.last_graph
            self._state_leaves = self.stages.stage_leaves[-1]
        # --batch-invariant: reductions in a fixed order (models.batch_invariant)
        self.batch_invariant = engine_config.batch_invariant
        self._forward = None if self.stages is not None else forward_fn(
            self.graphdef, treedef, mesh, self.state_layers, len(self.cache_specs),
            self.snapshots, self.batch_invariant)
        self._rollback = (None if self.snapshots is None or self.stages is not None
                          else rollback_fn(*self.snapshots, mesh))
        self._mtp = (mtp_fn(self.graphdef, treedef, self.num_spec_tokens, self.block_size,
                            self.mesh, self._mtp_row()) if self.mtp else None)
        self.num_top_logprobs = top_logprobs_width(engine_config.max_logprobs,
                                                   model_config.vocab_size)
        self._prompt_logprobs = prompt_logprobs_fn(self.graphdef, treedef,
                                                    self.num_top_logprobs, self.batch_invariant)
        # custom logits processors (worker.logits_processors; set before warm-up)
        self.logits_processors = None
        self._sample = sample_fn(self.mesh, self.num_top_logprobs, (), self.batch_invariant)
        self.num_compiles = 0  # traces of the step this runner caused (each is a compile)
        self.compiles_at_warmup: int | None = None  # num_compiles when warm-up ended
        # --enforce-eager: no warm-up; a bucket compiles on the first step that needs it
        self.enforce_eager = engine_config.enforce_eager
        # One step at a time touches the KV pool: the engine's steps and the warm-up runs of
        # buckets compiled in the background.
        self._pool_lock = threading.RLock()
        self._warmup: BucketWarmup | None = None  # the compile jobs, once started
        self._count_lock = threading.Lock()
        self._ones_bitmasks: dict[int, jax.Array] = {}  # all-ones masks per sequence bucket
        # the last step's sampled ids, on device: the next step's placeholder tokens read them
        self._last_tokens = self._device_zeros((self.max_num_seqs,), jnp.int32)
        self._captured = None  # the last step's hidden-state capture, when a row asked
        self._final_hidden = None  # the last step's final hidden states, when a row pools
        # a multi-host leader's hook (worker.multihost.Leader): a context manager entered with
        # each step's arguments around its dispatch; None on one host and on followers
        self.step_broadcast = None
        log_kv_config(self, max_model_len, tp)

    def _mtp_row(self) -> int:
        """The block-table row of the pool the MTP head's layer uses."""
        c = self.kv_config
        return c.row(c.mtp_pool)

    def _device_zeros(self, shape: tuple, dtype):
        """Zeros placed as a step's outputs are (replicated under a mesh, made by a jit), so
        the steps that take them see the same input type as later and do not recompile."""
        mesh = self.mesh or sharding.default_mesh()
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding.replicated(mesh))()

    # ---- host side ---------------------------------------------------------------------
    @property
    def kv_pages(self) -> list:
        """Every layer's caches (with stages: stage by stage, in model layer order)."""
        return self._kv_pages if self.stages is None else self.stages.kv_pages

    @kv_pages.setter
    def kv_pages(self, pool) -> None:
        self._kv_pages = pool

    def forward(self, plan: StepPlan, inputs: StepInputs, prev_tokens, mm=None):
        """The model half of a step on the device: ``(logits, hidden, captured, packed)``
        (through the stages in order under pipeline parallelism). Caller holds the pool lock."""
        if self.stages is not None:  # (the MTP head reads the packed inputs)
            packed = pack(inputs) if self._mtp is not None else None
            logits, hidden, captured = self.stages.forward(plan, inputs, mm=mm)
            return logits, hidden, captured, packed
        packed = pack(inputs)
        logits, self.kv_pages, hidden, captured = self._forward(
            self._state_leaves, self.kv_pages, packed[0], prev_tokens, self._lora_arrays(),
            packed[1], embeds=self.embeds_arg(plan),
            mm=self.mm_arrays(plan) if mm is None else mm)
        return logits, hidden, captured, packed

    def _run(self, plan: StepPlan, mm: dict | None = None, host_logits=None):
        prompt_next_ids = plan.prompt_next_ids
        if self._warmup is not None:  # a bucket still compiling: wait, never compile here
            self._warmup.wait(plan)
        with self._pool_lock:
            before = TRACES.n
            inputs, sampler_inputs = self._step_inputs(plan)
            prev_tokens = self._last_tokens
            if mm is None:
                mm = self.mm_arrays(plan)
            logits, hidden, captured, packed = self.forward(plan, inputs, prev_tokens, mm)
            if host_logits is not None:  # host logits processors: a round trip of [S, V]
                logits = self._host_logits(logits, plan.num_seqs, host_logits)
            out, self._last_tokens = self.sample(logits, sampler_inputs, prev_tokens,
                                                 self._bitmask(plan))
            drafts = self.after_verify(inputs, packed, hidden, out, prev_tokens, mm)
            if drafts is not None:
                out = (*out, drafts)
            if prompt_next_ids is not None:
                out = (out, self.prompt_logprobs(hidden, prompt_next_ids))
            self._captured = captured if _captures(plan) else None
            self._final_hidden = hidden if plan.pool_rows is not None else None
            self._count_step_compiles(before, plan)
        return out

    def prompt_logprobs(self, hidden, next_ids):
        """Each prompt token's logprobs under the step's hidden states (the last stage's)."""
        if self.stages is not None:
            return self.stages.prompt_logprobs(hidden, next_ids)
        return self._prompt_logprobs(self._state_leaves, hidden, next_ids)

    def _count_step_compiles(self, before: int, plan: StepPlan) -> None:
        if TRACES.n != before:
            self._add_compiles(TRACES.n - before)
            if self._warmup is not None:
                logger.warning("compile caused by a step (token bucket %d): this is a bug",
                               plan.token_bucket)

    def set_logits_processors(self, procs) -> None:
        """The engine's custom processors (before warm-up): their jax halves become part of
        the sampler's trace, their state rows part of its inputs."""
        self.logits_processors = procs
        self._sample = sample_fn(self.mesh, self.num_top_logprobs, procs.sampler_spec(),
                                  self.batch_invariant)

    def processor_template(self, s: int) -> tuple:
        return () if self.logits_processors is None else self.logits_processors.template(s)

    def embeds_arg(self, plan: StepPlan):
        """The forward's ``[T, H]`` prompt embeddings (``--enable-prompt-embeds``): the plan's
        when a row reads some, else zeros kept on the device per token bucket (nothing copied);
        None when the engine takes no prompt embeddings."""
        if not self.enable_prompt_embeds:
            return None
        if plan.prompt_embeds is not None:
            return jax.device_put(plan.prompt_embeds,
                                  sharding.replicated(self.mesh or sharding.default_mesh()))
        t = plan.token_bucket
        zeros = self._zero_embeds.get(t)
        if zeros is None:
            zeros = self._zero_embeds[t] = self._device_zeros(
                (t, self.model_config.hidden_size), jnp.float32)
        return zeros

    def _host_logits(self, logits, n: int, fn):
        """``fn`` on the real rows' logits, on the host; the result back where they were."""
        arr = np.array(jax.device_get(logits), dtype=np.float32)
        arr[:n] = fn(arr[:n])
        return jax.device_put(arr, logits.sharding)

    def sample(self, logits, inputs: SamplerInputs, prev_tokens, token_bitmask):
        """The sampler on a step's logits: ``(output, the last-token buffer with this step's
        ids)``, the inputs sent as one buffer."""
        buf, layout = pack(inputs)
        return self._sample(logits, buf, prev_tokens, token_bitmask, layout)

    def weight_leaves(self) -> list:
        """The model's parameter arrays (what the step reads as weights; every stage's)."""
        if self.stages is not None:
            return self.stages.weight_leaves()
        return list(self._state_leaves)

    def _lora_arrays(self):
        """The adapter slots' device weights (None without LoRA): one graph for any mix."""
        return None if self.lora is None else self.lora.arrays

    def after_verify(self, inputs: StepInputs, packed, hidden, out, prev_tokens, mm=None):
        """What a speculating step runs after its verifier (in the step's own dispatch, so
        nothing waits for the host): the recurrent state's rollback to each verify row's last
        accepted token, then the MTP head's drafts for the next step (None without it).
        ``packed``: the forward's ``pack(inputs)``; ``mm``: the step's image arrays (the head
        reads image tokens as the model does, at their M-RoPE positions)."""
        if self.snapshots is None and self._mtp is None:
            return None
        verify = out[1]
        if self.stages is not None:
            return self.stages.after_verify(inputs, packed, hidden, verify, prev_tokens,
                                            self._mtp, mm)
        pool = list(self.kv_pages)
        if self._rollback is not None:
            states = self._rollback([pool[i] for i in self.state_layers],
                                    inputs.state_slots, inputs.num_draft, verify.num_emitted)
            for i, st in zip(self.state_layers, states):
                pool[i] = st
        drafts = None
        if self._mtp is not None:
            m = self.kv_config.mtp_layer  # the MTP head's cache layer
            drafts, pool[m] = self._mtp(self._state_leaves, pool[m], packed[0], hidden,
                                         prev_tokens, verify.token_ids, verify.num_emitted,
                                         packed[1], mm)
        self.kv_pages = pool
        return drafts

    def _step_inputs(self, plan: StepPlan) -> tuple[StepInputs, SamplerInputs]:
        """The step's two device-side views (every step of a speculating engine has the
        verify shapes: logits at ``[S, k+1]`` positions)."""
        return StepInputs.from_plan(plan), SamplerInputs.from_plan(
            plan, self.num_spec_tokens, self.processor_template(plan.seq_bucket))

    def mm_arrays(self, plan: StepPlan):
        """A vision-language model's image inputs with their off values (no image in the
        step: the same trace); None for every other model."""
        return (None if self.mm is None
                else self.mm.off_arrays(plan.positions, plan.seq_bucket))

    def make_lora_slots(self, targets, max_loras: int, max_rank: int, dtype):
        """The device slots of every layer's adapters, placed like the weights they adapt."""
        from jaxserve.lora.slots import LoRASlots

        if self.stages is not None:  # each stage its own layers' adapters
            return self.stages.make_lora_slots(targets, max_loras, max_rank, dtype)
        return LoRASlots(targets, self.model_config.num_layers, max_loras, max_rank, dtype,
                         mesh=self.mesh, weight_specs=targets.specs)

    def write_lora(self, slot: int, adapter) -> None:
        """Lay an adapter into a device slot (between steps: the warm-up's runs read the slots
        too, and the update donates them)."""
        with self._pool_lock:
            self.lora.write(slot, adapter)

    def _add_compiles(self, n: int) -> None:
        with self._count_lock:
            self.num_compiles += n

    def bitmask_width(self) -> int:
        return (self.model_config.vocab_size + 31) // 32

    def _put_bitmask(self, mask: np.ndarray) -> jax.Array:
        """On the device, placed one way for every step (so no step compiles for it)."""
        return jax.device_put(mask, sharding.replicated(self.mesh or sharding.default_mesh()))

    def _bitmask(self, plan: StepPlan) -> jax.Array:
        """The plan's structured-output mask, or the all-ones mask kept on the device (per
        sequence bucket: unconstrained steps copy nothing for it)."""
        if plan.token_bitmask is not None:
            return self._put_bitmask(plan.token_bitmask)
        return self._ones_bitmask(plan.seq_bucket)

    def _ones_bitmask(self, s: int) -> jax.Array:
        ones = self._ones_bitmasks.get(s)
        if ones is None:  # made once per bucket (compile workers may race: same content)
            ones = self._ones_bitmasks[s] = self._put_bitmask(
                np.full((s, self.bitmask_width()), -1, np.int32))
        return ones

    def dispatch(self, plan: StepPlan, mm=None, host_logits=None) -> StepHandle:
        """Enqueue the step and start copying its results to the host; returns at once.
        A plan with ``prompt_next_ids`` also computes the prompt logprobs; ``mm``: the step's
        image arrays (``EncoderRunner.prepare``); ``host_logits``: the host logits processors'
        function on ``[num_seqs, V]`` numpy logits (the step then waits for its logits)."""
        if self.step_broadcast is not None:  # a multi-host leader: followers replay the step
            with self.step_broadcast(plan, mm, host_logits):
                return self._dispatch(plan, mm, host_logits)
        return self._dispatch(plan, mm, host_logits)

    def _dispatch(self, plan: StepPlan, mm=None, host_logits=None) -> StepHandle:
        if self.stages is not None and self.stages.link is not None:
            return self.stages.dispatch_linked(plan, StepHandle)
        out = self._run(plan, mm, host_logits)
        prompt_lp = verify = drafts = None
        if plan.prompt_next_ids is not None:
            out, prompt_lp = out
        if self.num_spec_tokens:
            out, verify, *rest = out
            drafts = rest[0] if rest else None
        h = StepHandle(plan, out, prompt_lp, bool(np.any(plan.sampling["num_logprobs"] >= 0)),
                       verify, drafts, self._captured, self._final_hidden)
        for x in self._handle_arrays(h):
            x.copy_to_host_async()
        return h

    @staticmethod
    def _handle_arrays(h: StepHandle) -> list:
        xs = [h.sampled.token_ids, h.sampled.logprobs]
        if h.want_topk:
            xs += [h.sampled.topk_ids, h.sampled.topk_logprobs, h.sampled.ranks]
        if h.prompt_logprobs is not None:
            xs += list(h.prompt_logprobs)
        if h.verify is not None:
            xs += list(h.verify)
        if h.drafts is not None:
            xs.append(h.drafts)
        if h.hidden_states is not None:
            xs.append(h.hidden_states)
        if h.final_hidden is not None:
            xs.append(h.final_hidden)
        return xs

    def fetch(self, h: StepHandle) -> StepOutput:
        """Wait for a dispatched step's results on the host."""
        if h.sampled is None:  # across hosts, still pending: through the leader's broadcast
            self.dispatch(None)
        out = h.sampled
        token_ids, logprobs = jax.device_get((out.token_ids, out.logprobs))
        res = StepOutput(token_ids=np.asarray(token_ids), logprobs=np.asarray(logprobs))
        if h.want_topk:
            ti, tl, rk = jax.device_get((out.topk_ids, out.topk_logprobs, out.ranks))
            res.topk_ids, res.topk_logprobs, res.ranks = map(np.asarray, (ti, tl, rk))
        if h.prompt_logprobs is not None:
            res.prompt_logprobs = tuple(map(np.asarray, jax.device_get(h.prompt_logprobs)))
        if h.verify is not None:
            res.spec_token_ids, res.num_emitted = map(np.asarray, jax.device_get(tuple(h.verify)))
        if h.drafts is not None:
            res.draft_ids = np.asarray(jax.device_get(h.drafts))
        if h.hidden_states is not None:
            res.hidden_states = np.asarray(jax.device_get(h.hidden_states))[:h.plan.num_tokens]
        if h.final_hidden is not None:
            rows = h.plan.logits_indices[:h.plan.num_seqs]
            res.final_hidden = np.asarray(jax.device_get(h.final_hidden), np.float32)[rows]
        return res

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the step and wait for it (``dispatch`` then ``fetch``)."""
        return self.fetch(self.dispatch(plan))

    @property
    def num_graphs(self) -> int:
        """One model graph and one prompt-logprobs graph per token bucket, two sampler layouts
        (compact, and full for penalties) per sequence bucket."""
        seqs = {seq_bucket(t, self.max_num_seqs) for t in self.ladder}
        return 2 * len(self.ladder) + 2 * len(seqs)

    # ---- warm-up (jaxserve.worker.warmup) ----------------------------------------------
    def warmup(self) -> float:
        """Compile and run every bucket on every core (nothing else runs meanwhile) and wait
        for all of them."""
        if self.enforce_eager:
            self._skip_warmup()
            return 0.0
        self.start_warmup(workers=max(1, min(4, os.cpu_count() or 1)))
        self._warmup.pool.wait_all()
        return self._warmup.seconds

    def start_warmup(self, workers: int | None = None, on_token_limit=None) -> None:
        """Compile the buckets ahead of time on a thread pool and return at once;
        ``on_token_limit(n)`` hears the largest compiled bucket as it grows (None at the end)."""
        if self.enforce_eager:
            self._skip_warmup()
        elif self._warmup is None:
            self._warmup = BucketWarmup(self, workers, on_token_limit).start()
            if self.stages is not None and self.stages.link is not None:
                self._warmup.pool.wait_all()  # across hosts: in lockstep with the others

    @property
    def warmed_up(self) -> bool:
        return self._warmup is not None and self._warmup.done

    @property
    def _compiles(self) -> CompilePool | None:
        return None if self._warmup is None else self._warmup.pool

    def _skip_warmup(self) -> None:
        logger.info("enforce_eager: no ahead-of-time warm-up; each of the token buckets %s "
                    "compiles on the first step that needs it, so the zero-compiles-after-"
                    "warm-up check is off", list(self.ladder))
        freeze_startup_heap()

    def _plan_ladder(self) -> tuple[int, ...]:
        return self.ladder if self._warmup is None else self._warmup.plan_ladder()

    def stop_warmup(self) -> None:
        """An engine that shuts down leaves no thread tracing or compiling behind it."""
        if self._warmup is not None:
            self._warmup.stop()

    def step_token_limit(self) -> int | None:
        """While buckets compile, the largest compiled token bucket (what the scheduler hears
        through ``on_token_limit``). None once every bucket is compiled."""
        return None if self._warmup is None else self._warmup.token_limit()

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve, buckets compiled, buckets)."""
        if self.enforce_eager:  # ready at once: steps compile what they need
            return True, 0, len(self.ladder)
        if self._warmup is None:
            return False, 0, len(self.ladder)
        return self._warmup.progress()

    @staticmethod
    def trace_counter():
        """This thread's count of traces of the step's jitted functions."""
        return TRACES

    # ---- weights in place, sleep (jaxserve.worker.weight_update, jaxserve.worker.sleep) ----
    def param_names(self) -> list[str]:
        """The state path (HF name) of each param leaf, in leaf order."""
        names = getattr(self, "_param_names", None)
        if names is None:  # the state's structure never changes
            from jaxserve.worker.weight_update import state_names

            names = self._param_names = state_names(self.state)
        return names

    def set_params(self, leaves: list) -> None:
        """Swap every param leaf between steps. Each has its old leaf's shape, dtype and
        sharding (``weight_update.prepare_leaves``), so no step recompiles; with stages, a
        list of leaves per stage."""
        if self.stages is not None:
            return self.stages.set_params(leaves)
        treedef = getattr(self, "_state_treedef", None)
        if treedef is None:
            treedef = self._state_treedef = jax.tree_util.tree_structure(self.state)
        with self._pool_lock:
            self._state_leaves = list(leaves)
            self.state = jax.tree_util.tree_unflatten(treedef, self._state_leaves)

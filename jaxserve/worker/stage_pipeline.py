"""The runner's stages under pipeline parallelism: each stage a layer range of the model on its
own ``tp`` mesh, with its share of the weights, of the KV pool (the same page ids on every
stage: one logical pool, one block manager) and its own jitted forward
(``worker.stages.stage_forward_fn``); the carry between stages is the hidden states.

``ModelRunner`` holds one :class:`PipelineStages` when ``pipeline_parallel_size`` > 1 and runs
its step through :meth:`PipelineStages.forward`; sampling, warm-up (``worker.warmup``), the
compile counter and the handles are the runner's, as without stages. Nothing blocks between
stages: each program and hand-off is dispatched asynchronously, so while stage 1 runs step N,
stage 0 runs step N+1 (the engine core's batch queue keeps P steps in flight).

Across hosts each process runs only its own stages; every process takes part in each hand-off
(``worker.stages.StageLink``), and a step's logits hand-off (last stage -> all) is issued
during the next dispatch (:meth:`dispatch_linked`), so stage 0's host is not held by the last
stage's program.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.core.step_plan import StepPlan
from jaxserve.errors import InvalidRequestError
from jaxserve.worker import step_functions as step_fns
from jaxserve.worker.kv_cache import allocate_kv_cache, fork_copy, fork_pairs
from jaxserve.worker.kv_moves import write_pages, write_slot
from jaxserve.worker.stages import (FLAG, StageLink, StageLoRASlots, abstract, check_model,
                                    check_shared_kv, layer_partition, make_stage,
                                    place, release_unused, stage_forward_fn, stage_images,
                                    stage_is_local, state_sharding)

logger = logging.getLogger(__name__)


@jax.jit
def _gather_rows(buf, idx):
    """``buf``'s rows ``idx`` (-1: any row; the reader masks it)."""
    step_fns.TRACES.n += 1
    return buf[jnp.maximum(idx, 0)]


class PipelineStages:
    """The stages of one runner: their meshes, weights, pages and programs."""

    def __init__(self, runner, model, pipeline_mesh):
        """The meshes, the layer partition and the start-up checks; :meth:`build` makes the
        stages once the runner's ``kv_config`` is sized (over :attr:`ranges`)."""
        check_model(model)
        r = self.runner = runner
        self.pipeline_mesh = pipeline_mesh
        self.stage_meshes = sharding.stage_meshes(pipeline_mesh)
        pp = len(self.stage_meshes)
        self.local = [stage_is_local(m) for m in self.stage_meshes]
        # one process owns every stage, or (across hosts) a link carries what crosses them
        self.link = None if all(self.local) else StageLink(pipeline_mesh, self.stage_meshes,
                                                           self.local)
        # where sampling, its buffers and masks live: the last stage, or this host's first
        self.sample_stage = pp - 1 if self.link is None else self.local.index(True)
        self.mesh = self.stage_meshes[self.sample_stage]
        self.partition = layer_partition(r.model_config.num_layers, pp)
        check_shared_kv(r.cache_specs, self.partition, pp)
        if r.state_layers and r.num_spec_tokens and self.link is not None:
            raise InvalidRequestError(
                f"--speculative-config with {FLAG} > 1 across hosts on {type(model).__name__} "
                "(LinearState layers) is not supported yet: each stage's rollback reads the "
                "last stage's verification (one host: supported)", param="speculative_config")
        if self.link is not None and (r.config.max_hidden_state_layers
                                      or r.config.enable_prompt_embeds):
            raise InvalidRequestError(
                f"return_hidden_states / prompt_embeds with {FLAG} > 1 run on one host",
                param="pipeline_parallel_size")

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Each stage's cache layers: its layers, on the last stage and the MTP head's."""
        end = len(self.runner.cache_specs)
        return [(lo, end if i == len(self.partition) - 1 else hi)
                for i, (lo, hi) in enumerate(self.partition)]

    def build(self, model, dtype) -> None:
        """Each stage: its module (the model's layers ``[lo, hi)``) on its mesh, its program,
        and its caches, allocated from ``runner.kv_config`` over its range (the same pools,
        page ids and state slots on every stage)."""
        r = self.runner
        pp, tp = len(self.stage_meshes), sharding.tp_size(self.stage_meshes[0])
        self.act_dtype = jnp.dtype(dtype)
        self.stage_pages, self.stage_leaves, self.stage_fns = [], [], []
        self.stage_defs = []  # (graphdef, state treedef) of each stage
        for i, ((lo, hi), (_, end), smesh) in enumerate(zip(self.partition, self.ranges,
                                                            self.stage_meshes)):
            stage = make_stage(model, lo, hi, first=i == 0, last=i == pp - 1,
                               mesh=smesh if tp > 1 else None)
            graphdef, state = nnx.split(stage)
            if not self.local[i]:  # another host's stage: its shapes only
                leaves, treedef = jax.tree_util.tree_flatten(abstract(state))
                self.stage_defs.append((graphdef, treedef))
                self.stage_leaves.append(leaves)
                self.stage_fns.append(None)
                self.stage_pages.append([])
                continue
            leaves, treedef = jax.tree_util.tree_flatten(place(state, smesh))
            self.stage_defs.append((graphdef, treedef))
            self.stage_leaves.append(leaves)
            local_state = tuple(j - lo for j in r.state_layers if lo <= j < end)
            self.stage_fns.append(stage_forward_fn(graphdef, treedef, smesh, i == pp - 1,
                                                   local_state, end - lo, r.snapshots,
                                                   r.config.batch_invariant))
            self.stage_pages.append(allocate_kv_cache(
                r.kv_config.layer_range(lo, end), r.kv_dtype, tp=tp,
                kv_sharding=sharding.kv_pool_sharding(smesh),
                state_sharding=state_sharding(smesh, tp)))
        # token bucket -> what a stage hands on (the hidden states; with Gemma 4's PLE, and
        # the per-layer inputs), as shapes: the cross-host hand-off sends each part
        self._carry_shapes: dict[int, object] = {}
        release_unused(model, [x for leaves in self.stage_leaves for x in leaves])
        # the first stage's placeholder source when no row has one (no wait on the last stage)
        self.no_tokens = None if not self.local[0] else jax.device_put(
            np.zeros(r.max_num_seqs, np.int32), sharding.replicated(self.stage_meshes[0]))
        self._prompt_logprobs_shapes: dict[int, object] = {}  # token bucket -> outputs (link)
        self._pending = None  # across hosts: (handle, last stage's raw outputs) of one plan
        self._names = None
        self._zero_embeds: dict[int, jax.Array] = {}  # token bucket -> zeros on stage 0
        c = r.kv_config
        logger.info("pipeline: %d stages x tp %d, layers %s; KV cache: %s (pages of %d "
                    "tokens; %.1f MiB per stage at most)", pp, tp, self.partition,
                    ", ".join(f"{p.name} {p.num_pages}" for p in c.pools), r.block_size, max(
                        sum(p.num_pages * p.page_bytes(r.block_size)
                            for p in c.layer_range(lo, end).pools)
                        for lo, end in self.ranges) / 2**20)

    @property
    def last_graph(self):
        """The last stage's (graphdef, state treedef): prompt logprobs run on its weights."""
        return self.stage_defs[-1]

    @property
    def num_stages(self) -> int:
        return len(self.stage_meshes)

    def make_lora_slots(self, targets, max_loras: int, max_rank: int, dtype):
        """Each stage's adapter slots: its own layers' weights on its own devices."""
        from jaxserve.lora.slots import LoRASlots

        return StageLoRASlots([
            LoRASlots(targets, self.runner.model_config.num_layers, max_loras, max_rank, dtype,
                      mesh=smesh, weight_specs=targets.specs, layers=(lo, hi))
            for (lo, hi), smesh in zip(self.partition, self.stage_meshes)])

    def weight_leaves(self) -> list:
        """Every stage's parameter arrays (on their own devices)."""
        return [x for leaves in self.stage_leaves for x in leaves]

    def _lora(self, i: int):
        lora = self.runner.lora
        return None if lora is None else lora.stages[i].arrays

    @property
    def kv_pages(self) -> list:
        """Every layer's caches, stage by stage (model layer order; the last stage's end with
        the MTP head's, as the single program's)."""
        return [kv for pages in self.stage_pages for kv in pages]

    # ---- the step ----------------------------------------------------------------------
    def prev_tokens(self, plan: StepPlan):
        """The first stage's placeholder source: the last step's ids when a row reads one
        (that stage then waits for the sampler), else zeros (no wait)."""
        if self.local[0] and np.any(plan.prev_ref >= 0):
            return jax.device_put(self.runner._last_tokens,
                                  sharding.replicated(self.stage_meshes[0]))
        return self.no_tokens

    def embeds(self, plan: StepPlan):
        """Stage 0's ``[T, H]`` prompt embeddings (``--enable-prompt-embeds``; zeros kept per
        token bucket when no row reads any); None when the engine takes none."""
        if not self.runner.enable_prompt_embeds:
            return None
        rep = sharding.replicated(self.stage_meshes[0])
        if plan.prompt_embeds is not None:
            return jax.device_put(plan.prompt_embeds, rep)
        t = plan.token_bucket
        if t not in self._zero_embeds:
            self._zero_embeds[t] = jax.jit(
                lambda: jnp.zeros((t, self.runner.model_config.hidden_size), jnp.float32),
                out_shardings=rep)()
        return self._zero_embeds[t]

    def forward(self, plan: StepPlan, inputs=None, before_last=None, gather: bool = True,
                mm=None):
        """The stages in order; returns the last stage's (logits, hidden, captured hidden
        states or None). Across hosts: the
        logits on the sampling stage, hidden on the last stage or None; with ``gather=False``
        the last stage's (logits, hidden) as they are (None on other hosts).
        ``before_last()`` runs after the hand-off into the last stage, before its program.
        ``mm``: a vision-language step's ``StepImages`` (its encoder buffer on stage 0's
        devices; the off values when None), each stage given its share."""
        if inputs is None:
            inputs = self.runner._step_inputs(plan)[0]
        if mm is None:
            mm = self.runner.mm_arrays(plan)
        prev = self.prev_tokens(plan)
        x, out, caps = None, None, []
        t = plan.token_bucket
        last = len(self.stage_fns) - 1
        for i, fn in enumerate(self.stage_fns):
            if i and self.link is None:
                x = jax.device_put(x, sharding.replicated(self.stage_meshes[i]))
            elif i:  # every process joins the hand-off from stage i-1
                x = self._send_carry(x if self.local[i - 1] else None, i - 1, t).get(i)
            if i == last and before_last is not None:
                before_last()
            if fn is not None:
                out = fn(self.stage_leaves[i], self.stage_pages[i], inputs, self._lora(i), x,
                         prev if i == 0 else None, self.embeds(plan) if i == 0 else None,
                         stage_images(mm, i))
                x, self.stage_pages[i] = out[0], out[1]
                caps.append(out[-1])
            else:
                x = None
        logits, hidden = (out[0], out[2]) if self.local[last] else (None, None)
        if self.link is None or not gather:
            return logits, hidden, self._sum_captured(caps)
        return self._gather_logits(plan, logits), hidden, None

    def _sum_captured(self, caps: list):
        """Every stage's capture on the sampling stage, added (each token's asked layer is in
        one stage; the others hold zeros there)."""
        if caps[0] is None:
            return None
        rep = sharding.replicated(self.mesh)
        return sum(jax.device_put(c, rep) for c in caps)

    def lower(self, plan: StepPlan):
        """Lower and compile bucket ``plan.token_bucket``'s stage programs (no run; the
        step's later call finds them compiled); the logits' shape, or None across hosts
        (another host's stages are not compiled here)."""
        from jaxserve.worker.compile_pool import TRACE_LOCK

        if self.link is not None:
            return None
        r = self.runner
        with r._pool_lock:  # the arrays of the moment (their shapes and shardings)
            leaves, pages = list(self.stage_leaves), list(self.stage_pages)
            inputs = r._step_inputs(plan)[0]
            loras = [self._lora(i) for i in range(self.num_stages)]
            mm = r.mm_arrays(plan)  # a vision-language model's image inputs (off values)
        x = out = None
        for i, fn in enumerate(self.stage_fns):
            with TRACE_LOCK:
                lowered = fn.lower(leaves[i], pages[i], inputs, loras[i], x,
                                   self.no_tokens if i == 0 else None,
                                   self.embeds(plan) if i == 0 else None, stage_images(mm, i))
            out = lowered.compile().out_info[0]
            if i + 1 < len(self.stage_fns):
                rep = sharding.replicated(self.stage_meshes[i + 1])
                x = jax.tree_util.tree_map(
                    lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=rep), out,
                    is_leaf=lambda o: hasattr(o, "dtype") and hasattr(o, "shape"))
        return out

    def _send_carry(self, x, src: int, t: int) -> dict:
        """Across hosts: what stage ``src`` hands on, a leaf at a time (every process calls
        it; ``x`` is None where ``src`` is not local)."""
        shapes = self._carry_shapes.get(t)
        if shapes is None:
            graphdef, treedef = self.stage_defs[0]

            def embed(leaves, ids):
                stage = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
                return stage.family.embed(stage, ids)

            shapes = self._carry_shapes[t] = jax.eval_shape(
                embed, abstract(self.stage_leaves[0]), jax.ShapeDtypeStruct((t,), jnp.int32))
        specs, treedef = jax.tree_util.tree_flatten(shapes)
        values = jax.tree_util.tree_leaves(x) if x is not None else [None] * len(specs)
        sent = [self.link.send(v, src, a.shape, a.dtype) for v, a in zip(values, specs)]
        return {i: jax.tree_util.tree_unflatten(treedef, [s[i] for s in sent])
                for i in sent[0]}

    def _gather_logits(self, plan: StepPlan, logits):
        """Across hosts: the last stage's logits to every host's sampling stage."""
        last = len(self.stage_fns) - 1
        idx = (plan.spec_logits_indices if plan.spec_logits_indices is not None
               else plan.logits_indices)  # [S], or [S, k+1] when speculating
        shape = idx.shape + (self.runner.model_config.vocab_size,)
        return self.link.send(logits, last, shape, jnp.float32)[self.sample_stage]

    def prompt_logprobs(self, hidden, next_ids):
        """The prompt logprobs, computed on the last stage (and sent to every host)."""
        r = self.runner
        if self.link is None:
            return r._prompt_logprobs(r._state_leaves, hidden, next_ids)
        last = len(self.stage_fns) - 1
        t = int(next_ids.shape[0])
        shapes = self._prompt_logprobs_shapes.get(t)
        if shapes is None:
            shapes = self._prompt_logprobs_shapes[t] = jax.eval_shape(
                r._prompt_logprobs, abstract(r._state_leaves),
                jax.ShapeDtypeStruct((t, r.model_config.hidden_size), self.act_dtype),
                jax.ShapeDtypeStruct((t,), jnp.int32))
        res = (r._prompt_logprobs(r._state_leaves, hidden, next_ids)
               if self.local[last] else None)
        flat, treedef = jax.tree_util.tree_flatten(shapes)
        vals = jax.tree_util.tree_leaves(res) if res is not None else [None] * len(flat)
        sent = [self.link.send(v, last, a.shape, a.dtype)[self.sample_stage]
                for v, a in zip(vals, flat)]
        return jax.tree_util.tree_unflatten(treedef, sent)

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
    def dispatch_linked(self, plan: StepPlan | None, handle_cls):
        r = self.runner
        with r._pool_lock:
            if plan is None:
                self._finish_pending()
                return None
            before = step_fns.TRACES.n
            raw = self.forward(plan, before_last=self._finish_pending, gather=False)[:2]
            h = handle_cls(plan, None, None, bool(np.any(plan.sampling["num_logprobs"] >= 0)))
            self._pending = (h, raw)
            r._count_step_compiles(before, plan)
        return h

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        h, (logits, hidden) = pending
        plan = h.plan
        r = self.runner
        before = step_fns.TRACES.n
        logits = self._gather_logits(plan, logits)
        out, r._last_tokens = r.sample(logits, r._step_inputs(plan)[1], r._last_tokens,
                                       r._bitmask(plan))
        h.sampled, h.verify = out if r.num_spec_tokens else (out, None)
        if plan.prompt_next_ids is not None:
            h.prompt_logprobs = self.prompt_logprobs(hidden, plan.prompt_next_ids)
        r._count_step_compiles(before, plan)
        for x in r._handle_arrays(h):
            x.copy_to_host_async()

    # ---- weights in place (jaxserve.engine.weight_sync) -------------------------------------
    def param_names(self) -> list[list[str]]:
        """Each stage's params by the model's state path (a stage holds its layers at their
        model indices)."""
        if self._names is None:
            from jaxserve.worker.weight_update import state_names

            self._names = [state_names(jax.tree_util.tree_unflatten(td, lv))
                           for (_, td), lv in zip(self.stage_defs, self.stage_leaves)]
        return self._names

    def set_params(self, stage_leaves: list[list]) -> None:
        """Swap every stage's leaves between steps (each with its old leaf's placement)."""
        with self.runner._pool_lock:
            self.stage_leaves = [list(x) for x in stage_leaves]
            self.runner._state_leaves = self.stage_leaves[-1]

    # ---- swap and fork: every stage its own layers' share ------------------------------------
    def _stage_layers(self, i: int, state: bool) -> list[int]:
        lo, end = self.ranges[i]
        return [j for j in range(end - lo) if (lo + j in self.runner.state_layers) == state]

    def swap_in(self, pages: list[list[int]], saved, rows: list[tuple[int, int]]) -> None:
        """Write a swapped request's pages back (ids per pool; ``saved`` one (k, v) per
        ``rows`` entry, (layer, its pool's row)), on every stage one scatter per pool, as
        ``PoolMoves.swap_in`` on one program's pool."""
        saved_of = {layer: kv for (layer, _), kv in zip(rows, saved)}
        for i, ((lo, end), smesh) in enumerate(zip(self.ranges, self.stage_meshes)):
            if not self.local[i]:
                continue
            for g, ids in enumerate(pages):
                mine = [layer for layer, row in rows if row == g and lo <= layer < end]
                if not mine or not ids:
                    continue
                written = write_pages([self.stage_pages[i][j - lo] for j in mine],
                                      jnp.asarray(np.asarray(ids, dtype=np.int32)),
                                      [saved_of[j] for j in mine])
                self._put(i, [j - lo for j in mine],
                          jax.device_put(written, sharding.kv_pool_sharding(smesh)))

    def swap_in_state(self, slot: int, saved) -> None:
        """Write a swapped request's recurrent state into its (new) slot on every stage."""
        saved = iter(saved)
        for i, smesh in enumerate(self.stage_meshes):
            layers = self._stage_layers(i, state=True)
            if layers:
                written = write_slot([self.stage_pages[i][j] for j in layers], jnp.int32(slot),
                                     [tuple(jnp.asarray(a) for a in next(saved))
                                      for _ in layers])
                tp = sharding.tp_size(smesh)
                self._put(i, layers, jax.device_put(written, state_sharding(smesh, tp)))

    def _put(self, i: int, layers: list[int], written) -> None:
        pages = list(self.stage_pages[i])
        for j, arrs in zip(layers, written):
            pages[j] = arrs
        self.stage_pages[i] = pages

    def fork(self, pages: list[tuple[int, int]], slots: list[tuple[int, int]]) -> None:
        """n > 1 siblings start from their first child's computed prompt: on every stage its
        layers' pages and recurrent states copied into theirs, in step order."""
        src, dst = fork_pairs(pages, 0)  # page 0: the trash page
        c = self.runner.kv_config
        trash_slot = (c.num_state_slots or 0) + c.scratch_slots  # the pool's last slot
        ssrc, sdst = fork_pairs(slots, trash_slot)
        for i, smesh in enumerate(self.stage_meshes):
            if not self.local[i]:
                continue
            state = tuple(self._stage_layers(i, state=True))
            paged = tuple(j for j in self._stage_layers(i, state=False)
                          if len(self.stage_pages[i][j]))
            pool = fork_copy(list(self.stage_pages[i]), paged, state, src, dst, ssrc, sdst)
            tp = sharding.tp_size(smesh)
            kv, st = sharding.kv_pool_sharding(smesh), state_sharding(smesh, tp)
            self.stage_pages[i] = [jax.device_put(a, st if j in state else kv)
                                   for j, a in enumerate(pool)]

    # ---- after the verifier: the rollback on every stage, the MTP head on the last ----------
    def after_verify(self, inputs, packed, hidden, verify, prev_tokens, mtp, mm=None):
        """Each stage's LinearState layers rolled back to each verify row's last accepted
        token (the stage reads the last stage's verification), then the MTP head's drafts for
        the next step on the last stage (None without it); ``mm``: a vision-language step's
        ``StepImages`` (:meth:`head_images`)."""
        r = self.runner
        if r.snapshots is not None:
            for i, smesh in enumerate(self.stage_meshes):
                layers = self._stage_layers(i, state=True)
                if not layers:
                    continue
                tp = sharding.tp_size(smesh)
                rep = sharding.replicated(smesh)
                rollback = step_fns.rollback_fn(*r.snapshots, smesh if tp > 1 else None)
                states = rollback([self.stage_pages[i][j] for j in layers],
                                  jax.device_put(inputs.state_slots, rep),
                                  jax.device_put(inputs.num_draft, rep),
                                  jax.device_put(verify.num_emitted, rep))
                self._put(i, layers, jax.device_put(states, state_sharding(smesh, tp)))
        if mtp is None:
            return None
        pages = self.stage_pages[-1]  # the MTP head's layer: the last stage's last cache
        drafts, head = mtp(r._state_leaves, pages[-1], packed[0], hidden, prev_tokens,
                           verify.token_ids, verify.num_emitted, packed[1],
                           self.head_images(mm))
        self.stage_pages[-1] = list(pages[:-1]) + [head]
        return drafts

    def head_images(self, mm):
        """The MTP head's image inputs on the last stage: the encoder buffer stays on stage 0,
        so only the rows the head reads (each token's and each row's next token's, ``[T + S,
        H]``) are gathered there and handed on, with the rows renumbered into that block."""
        if mm is None:
            return None
        rows, nxt = np.asarray(mm.rows), np.asarray(mm.next_rows)
        t, s = rows.shape[0], nxt.shape[0]
        block = jax.device_put(_gather_rows(mm.embeds, np.concatenate([rows, nxt])),
                               sharding.replicated(self.stage_meshes[-1]))
        return mm._replace(
            rows=np.where(rows >= 0, np.arange(t, dtype=np.int32), -1).astype(np.int32),
            embeds=block, kv_limit=None,
            next_rows=np.where(nxt >= 0, t + np.arange(s, dtype=np.int32), -1).astype(np.int32))

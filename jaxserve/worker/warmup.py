"""Warm-up: every token bucket of a runner compiled ahead of time, on a thread pool.

Order: smallest first, then the sampler's full layout (penalties, wide tables) per sequence
bucket, then the prompt-logprobs graphs. The server serves once the smallest
bucket is ready, each step kept within the largest compiled one, so the ladder grows while
requests run. Each bucket is lowered and compiled (``jit(...).lower(...).compile()``, which
fills jit's own cache and the persistent compilation cache), then run on rows that live in the
trash page. Steps pick among the compiled buckets (:meth:`BucketWarmup.plan_ladder`) and wait
for a bucket still compiling rather than compile it themselves.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from functools import partial

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.sampling_metadata import COMPACT_STOP_WIDTH
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import TRASH_PAGE, StepPlan, seq_bucket
from jaxserve.worker.step_inputs import SamplerInputs, pack
from jaxserve.worker.compile_pool import TRACE_LOCK, CompilePool
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.host_memory import log_memory

logger = logging.getLogger(__name__)

# Warm-up sampling, compact layout (each token bucket's job): the long-rows plan samples with
# every compact feature on; then the sampler alone runs random sampling with top-k/p, min-p, bias,
# stop masking and logprobs. Full layout (a job per sequence bucket, after every token bucket:
# the rare requests with penalties or wide tables wait for it, the first answer does not): every
# feature with penalties, and greedy with a wide logit_bias.
_WARMUP_COMPACT_FEATURES = SamplingParams(
    temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, logprobs=2, logit_bias={0: 0.5})
_WARMUP_GREEDY = SamplingParams(temperature=0.0)
_WARMUP_OTHER_BRANCHES = (
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, logprobs=2,
                   logit_bias={0: 0.5}, min_tokens=2, stop_token_ids=[0]),
)
_WARMUP_FULL_LAYOUT = (
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.01, logprobs=2,
                   presence_penalty=0.1, frequency_penalty=0.1, repetition_penalty=1.1,
                   logit_bias={0: 0.5}),
    SamplingParams(temperature=0.0, logit_bias={i: 0.1 for i in range(9)}),
)


def full_layout(sampling) -> bool:
    """Whether a step's sampler arrays are in the full layout (``core.sampling_metadata``)."""
    return sampling is not None and sampling["stop_ids"].shape[1] != COMPACT_STOP_WIDTH


def freeze_startup_heap() -> None:
    """Move everything alive after start-up (model, tokenizer, compiled graphs: ~600,000
    objects even with a tiny model) out of the garbage collector's reach, as vLLM does:
    otherwise every full collection walks them, which took ~40 % of a host-bound step with 256
    running requests. Objects made later (requests, outputs) are collected as usual."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many engines
    atexit.register(gc.unfreeze)  # at exit they are finalised as usual (nanobind checks)


class BucketWarmup:
    """The compile jobs of one runner: a ``CompilePool`` keyed ``("forward", t)`` and
    ``("prompt_logprobs", t)``, its progress, and what the steps may use meanwhile."""

    def __init__(self, runner, workers: int | None = None, on_token_limit=None):
        self.runner = runner
        self._on_token_limit = on_token_limit
        self.ladder = runner.ladder
        self.done = False  # every bucket compiled and run once
        self.seconds: float | None = None
        self._t0 = time.perf_counter()
        self._jobs_done = 0
        self._lock = threading.Lock()
        self._sampler_locks: dict[int, threading.Lock] = {}
        self._warm_hidden: dict[int, object] = {}
        self._job_detail: dict = {}
        self._scratch_tokens = runner._device_zeros((runner.max_num_seqs,), np.int32)
        self._warm_logits: dict[int, object] = {}  # per sequence bucket, for its full job
        jobs = [(("forward", t), partial(self._compile_bucket, t)) for t in self.ladder]
        self._seq_buckets = sorted({seq_bucket(t, runner.max_num_seqs) for t in self.ladder})
        jobs += [(("sampler_full", s), partial(self._compile_full_sampler, s))
                 for s in self._seq_buckets]
        jobs += [(("prompt_logprobs", t), partial(self._compile_prompt_logprobs, t))
                 for t in self.ladder]
        self._num_jobs = len(jobs)
        self._bar = None
        if sys.stderr.isatty():
            self._bar = tqdm(total=len(jobs), desc="Compiling buckets", leave=False)
        # default: the cores but one, 1 to 4, leaving a core to the steps that run meanwhile
        workers = workers or max(1, min(4, (os.cpu_count() or 2) - 1))
        if jax.process_count() > 1:  # every host runs the warm-up steps in the same order
            workers = 1
        self.pool = CompilePool(jobs, workers, on_done=self._job_done)

    def start(self) -> "BucketWarmup":
        if self._on_token_limit is not None:
            self._on_token_limit(self.token_limit())
        self.pool.start()  # after the assignment: jobs wait on each other through it
        return self

    def ready(self) -> list[int]:
        return [t for t in self.ladder if self.pool.is_done(("forward", t))]

    def plan_ladder(self) -> tuple[int, ...]:
        """The buckets a step may use now: the compiled ones, and the ones above the largest
        compiled (a step too big for every compiled bucket waits for the smallest that fits)."""
        if self.done:
            return self.ladder
        ready = self.ready()
        top = max(ready, default=0)
        return tuple(t for t in self.ladder if t in ready or t > top)

    def token_limit(self) -> int | None:
        """While buckets compile, the largest compiled token bucket (the smallest one before
        any is ready); None once every bucket is compiled."""
        if self.done:
            return None
        return max(self.ready(), default=self.ladder[0])

    def progress(self) -> tuple[bool, int, int]:
        """(ready to serve, buckets compiled, buckets): ready once the smallest is compiled."""
        done = self.ready()
        return self.ladder[0] in done, len(done), len(self.ladder)

    def wait(self, plan: StepPlan) -> None:
        """Wait for the graphs a plan needs: a step never compiles."""
        self.pool.wait(("forward", plan.token_bucket))
        if full_layout(plan.sampling):
            self.pool.wait(("sampler_full", plan.sampling["stop_ids"].shape[0]))
        if plan.prompt_next_ids is not None:
            self.pool.wait(("prompt_logprobs", plan.token_bucket))

    def stop(self) -> None:
        """Drop the compiles not started and wait for the running one."""
        if not self.done:
            self.pool.cancel()
            self.pool.join()

    def _job_done(self, key, seconds: float) -> None:
        kind, t = key
        with self._lock:
            self._jobs_done += 1
            last = self._jobs_done == self._num_jobs
            if last:
                self.done = True
                self.runner.compiles_at_warmup = self.runner.num_compiles
            if self._on_token_limit is not None:  # under the lock: the latest value wins
                # (the pool marks this job done after this callback: count it here)
                ready = self.ready() + ([t] if kind == "forward" else [])
                self._on_token_limit(None if self.done else max(ready))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(f"{kind} {t}")
        else:
            detail = self._job_detail.get(key)
            logger.info("compiled %s for %s bucket %d (%d/%d) in %.1f s%s", kind,
                        "sequence" if kind == "sampler_full" else "token", t,
                        self._jobs_done, self._num_jobs, seconds,
                        f" ({detail})" if detail else "")
        if last:
            if self._bar is not None:
                self._bar.close()
            self.seconds = time.perf_counter() - self._t0
            logger.info("warm-up: %d compiles for token buckets %s in %.1f s",
                        self.runner.num_compiles, list(self.ladder), self.seconds)
            freeze_startup_heap()
            log_memory(self.runner)

    def _compile_bucket(self, t: int) -> None:
        """Compile token bucket ``t`` (model graph, the compact sampler layout), then run it.

        Two plans: many short rows next to one long row, and long rows only, so both the decode
        and the prefill paths of the attention run (greedy, and every compact sampler feature).
        Running real rows matters: XLA:CPU finishes a loop body's code on its first trip, and a
        padding-only plan never enters the loops, which left ~0.1-0.3 s of that work to the
        first real step of each bucket."""
        r = self.runner
        traces = r.trace_counter()
        before = traces.n  # this worker thread's traces
        s = seq_bucket(t, r.max_num_seqs)
        plans = [warmup_plan(r, t, s, full) for full in (False, True)]
        if r.lora is not None:  # the adapters' side of the LoRA delta's lax.cond runs too
            plans[1] = dataclasses.replace(plans[1],
                                           lora_slots=np.zeros_like(plans[1].lora_slots))
        last = self._scratch_tokens
        t0 = time.perf_counter()
        if r.stages is not None:  # each stage's program (None: another host's stages)
            t1, logits = t0, r.stages.lower(plans[0])
        else:
            with r._pool_lock:
                kv = r.kv_pages
            with TRACE_LOCK:
                buf, layout = pack(r._step_inputs(plans[0])[0])
                lowered = r._forward.lower(r._state_leaves, kv, buf, last, r._lora_arrays(),
                                           layout, embeds=r.embeds_arg(plans[0]),
                                           mm=r.mm_arrays(plans[0]))
            t1 = time.perf_counter()
            logits = lowered.compile().out_info[0]  # or a load from the persistent cache
        t2 = time.perf_counter()
        # the other side of each sampler lax.cond: other sampling modes, a token mask that
        # forbids half the vocabulary, and drafts in every row (the verifier's random branch)
        ones, half = r._ones_bitmask(s), warmup_bitmask(r, s)
        others = [(sampler_variant(r, warmup_sampling(r, p, s), s), half)
                  for p in _WARMUP_OTHER_BRANCHES]
        own = [(r._step_inputs(p)[1], ones) for p in plans]
        with self._sampler_locks.setdefault(s, threading.Lock()):  # once per sequence bucket
            for sampler_inputs, mask in (own + others if logits is not None else ()):
                with TRACE_LOCK:
                    buf, layout = pack(sampler_inputs)
                    lowered = r._sample.lower(logits, buf, last, mask, layout)
                lowered.compile()
        with r._pool_lock:  # the runs donate the pool: one step at a time
            for plan in plans:
                inputs, sampler_inputs = r._step_inputs(plan)
                logits, hidden, _, packed = r.forward(plan, inputs, last)
                sampled = r.sample(logits, sampler_inputs, last, ones)
                if r.num_spec_tokens:  # the rollback and the MTP head's drafts (a
                    with TRACE_LOCK:  # vision-language model's: with its image inputs)
                        r.after_verify(inputs, packed, hidden, sampled[0], last,
                                       r.mm_arrays(plan))
                jax.block_until_ready(sampled)
            for sampler_inputs, mask in others:
                jax.block_until_ready(r.sample(logits, sampler_inputs, last, mask))
        self._job_detail[("forward", t)] = (
            f"trace+lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s, sampler and warm-up runs "
            f"{time.perf_counter() - t2:.1f} s")
        self._warm_hidden[t] = hidden
        self._warm_logits.setdefault(s, logits)
        r._add_compiles(traces.n - before)

    def _compile_full_sampler(self, s: int) -> None:
        """The full sampler layout of sequence bucket ``s`` (penalties, wide logit_bias or stop
        ids), compiled and run on the logits its first token bucket's warm-up left."""
        r = self.runner
        first = next(t for t in self.ladder if seq_bucket(t, r.max_num_seqs) == s)
        self.pool.wait(("forward", first))
        traces = r.trace_counter()
        before = traces.n
        logits = self._warm_logits.pop(s)
        last = self._scratch_tokens
        variants = [(sampler_variant(r, warmup_sampling(r, p, s), s), mask)  # (2nd: wide bias)
                    for p, mask in zip(_WARMUP_FULL_LAYOUT,
                                       (r._ones_bitmask(s), warmup_bitmask(r, s)))]
        with self._sampler_locks.setdefault(s, threading.Lock()):
            for sampler_inputs, mask in variants:
                with TRACE_LOCK:
                    buf, layout = pack(sampler_inputs)
                    lowered = r._sample.lower(logits, buf, last, mask, layout)
                lowered.compile()
        for sampler_inputs, mask in variants:
            jax.block_until_ready(r.sample(logits, sampler_inputs, last, mask))
        r._add_compiles(traces.n - before)

    def _compile_prompt_logprobs(self, t: int) -> None:
        """The prompt-logprobs graph of bucket ``t``, compiled and run on its warm-up hidden."""
        r = self.runner
        self.pool.wait(("forward", t))
        traces = r.trace_counter()
        before = traces.n
        hidden = self._warm_hidden.pop(t)
        ids = np.zeros(t, np.int32)
        if hidden is not None:  # (across hosts: the last stage's host only; run below)
            with TRACE_LOCK:
                lowered = r._prompt_logprobs.lower(r._state_leaves, hidden, ids)
            lowered.compile()
        jax.block_until_ready(r.prompt_logprobs(hidden, ids))
        r._add_compiles(traces.n - before)


def warmup_sampling(runner, params: SamplingParams, s: int) -> dict:
    """Sampler arrays for ``s`` rows of ``params`` (one token generated so far)."""
    plan = _rows_plan(runner, [1] * s, params, num_output=1)
    if plan.seq_bucket != s:
        raise ValueError(f"no token bucket has sequence bucket {s}")
    return plan.sampling


def sampler_variant(runner, sampling: dict, s: int) -> SamplerInputs:
    """Sampler inputs of ``s`` rows sampling with ``sampling``, drafts in every row when the
    engine speculates (the verifier's random branch), nothing pending or kept."""
    k = runner.num_spec_tokens
    return SamplerInputs(sampling=sampling, history_ref=np.full((s, 2), -1, np.int32),
                         token_rows=np.full(s, -1, np.int32),
                         draft_token_ids=np.zeros((s, k), np.int32),
                         num_draft=np.full(s, k, np.int32),
                         processors=runner.processor_template(s))


def warmup_bitmask(runner, s: int) -> jax.Array:
    """A mask that forbids half the vocabulary: warm-up runs the masking branch too."""
    m = np.full((s, runner.bitmask_width()), -1, np.int32)
    m[:, ::2] = 0
    return runner._put_bitmask(m)


def warmup_plan(runner, t: int, s: int, long_rows: bool) -> StepPlan:
    """Bucket ``t`` filled with rows whose pages are all the trash page: ``s`` rows (one
    long, the rest single tokens), or as few long rows as fit; padding if neither fits."""
    bs = runner.block_size
    cap = min(runner.max_pages_per_seq * bs, runner.max_model_len) - 1  # tokens a row holds
    n_rows = min(s, -(-t // cap)) if long_rows else s
    if n_rows * cap < t:
        return warmup_padding_plan(runner, t, s)
    lens = [1] * n_rows
    extra = t - n_rows
    for i in range(n_rows):
        add = min(extra, cap - 1)
        lens[i] += add
        extra -= add
    # the long-rows plan samples with every compact feature on, the other greedy
    params = _WARMUP_COMPACT_FEATURES if long_rows else _WARMUP_GREEDY
    plan = _rows_plan(runner, lens, params)
    if plan.token_bucket != t:
        return warmup_padding_plan(runner, t, s)
    return plan


def warmup_padding_plan(runner, t: int, s: int) -> StepPlan:
    """Bucket (t, s) with no real row."""
    plan = _rows_plan(runner, [], _WARMUP_GREEDY, bucket=t)
    assert plan.seq_bucket == s, (plan.seq_bucket, s)
    return plan


def _rows_plan(runner, lens: list[int], params: SamplingParams, num_output: int = 1,
               bucket: int | None = None) -> StepPlan:
    """A step of rows of ``lens`` new tokens sampling with ``params``, every page the trash
    page, built as the engine builds its steps: rows of a scratch persistent batch, one diff."""
    bs = runner.block_size
    batch = InputBatch.for_runner(runner, seed=0)
    ids = [f"warmup-{i}" for i in range(len(lens))]
    batch.apply(BatchDiff(new_reqs=[
        NewRequestData(rid, [0] * q, q - 1, params,
                       [[TRASH_PAGE] * -(-q // bs)] * runner.num_cache_groups)
        for rid, q in zip(ids, lens)]))
    return batch.prepare_inputs(BatchDiff(
        req_ids=ids, num_tokens=lens, token_ids=[0] * sum(lens), start_pos=[0] * len(lens),
        sample=[True] * len(lens), num_draft=[0] * len(lens),
        num_output=[num_output] * len(lens)), ladder=runner.ladder, bucket=bucket)

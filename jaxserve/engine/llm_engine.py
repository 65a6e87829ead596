"""LLMEngine: requests in, one scheduled device step at a time, RequestOutputs out.

    add_request -> Scheduler.schedule -> StepPlan (runner.build_plan) -> runner.dispatch
                -> Scheduler.update_from_output -> (one step later with async scheduling)
                runner.fetch -> Scheduler.check_stop -> CoreOutputs

Built by ``jaxserve.engine.builder.build_engine``. Async scheduling (on by default): ``step()``
schedules and dispatches step N+1, then reads step N's sampled ids, so the host work of one
step runs while the device computes the next. The scheduler appends a placeholder for each
token in flight; the step that consumes it reads the real id on the device. Stopping on ids
(EOS, stop token ids, max_tokens, max_model_len, a finished grammar) is the scheduler's
``check_stop``, run when the ids arrive, one step behind; a token sampled after a stop is
dropped. Without async scheduling the same step is fetched at once. ``n > 1`` fans out into
child requests; with prefix caching on, the scheduler admits siblings once the first child's
prompt pages are cached (``prefix_parent``), so they share those pages instead of recomputing
them.

The engine core is ``core_step`` (ids in, ``CoreOutput``s out); text (detokenization, stop
strings, logprob entries) is the ``OutputProcessor``'s. ``step`` runs both in this process (the
``LLM`` and ``AsyncLLM`` path); ``jaxserve serve`` runs ``core_step`` in the core process and the
processor in the API process (engine/core_process.py, engine/core_client.py).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from jaxserve.core.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import (CoreCompletion, CoreOutput, RequestMetrics, RequestOutput,
                                   TokenLogprobs)
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_metadata import SamplingRow
from jaxserve.core.step_plan import ScheduledSeq
from jaxserve.worker.runner import ModelRunner
from jaxserve.core.sampling_params import MAX_SEED, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.spec_decode import SpecDecodeStats, can_speculate
from jaxserve.engine.generation_config import default_sampling
from jaxserve.engine.token_filter import TokenFilter, bad_words_token_ids
from jaxserve.engine.output_processor import OutputProcessor, SequenceStop
from jaxserve.engine.tokenizer import prompt_ids

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    """One sequence of a request: what has been reported of it since it was added."""

    request: Request
    index: int
    num_reported: int = 0  # output ids already in a CoreOutput
    new_logprobs: list | None = None  # TokenLogprobs of ids not yet reported, when asked for


@dataclass
class _InFlight:
    """A dispatched step whose ids have not been read yet."""

    sched: object  # SchedulerOutput
    hits: list  # (parent, child) of each scheduled row
    handle: object  # runner.StepHandle
    prompt_rows: list
    query_start: np.ndarray
    constrained: bool = False  # a sampled row has a grammar: read it before the next schedule

    @property
    def sampled_rows(self) -> dict[str, int]:
        return {s.request.request_id: i for i, s in enumerate(self.sched.scheduled) if s.sample}


@dataclass
class _Parent:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[_Child] = field(default_factory=list)
    # prompt positions whose logprobs are recorded (position 0 has none), when asked for
    num_prompt_logprobs: int | None = None
    new_prompt_logprobs: list = field(default_factory=list)  # not yet reported

    @property
    def finished(self) -> bool:
        return all(c.request.status.is_finished for c in self.children)


class LLMEngine:
    """The engine core's loop over parts made by ``jaxserve.engine.builder.build_engine``."""

    def __init__(self, config: EngineConfig, *, model, model_config, model_dir, tokenizer,
                 dtype, mesh, max_model_len: int, generation_config: dict, eos_token_ids: list[int],
                 runner: ModelRunner, block_manager: BlockManager, scheduler: Scheduler,
                 proposer=None, kv_event_publisher=None, lora_manager=None):
        self.config = config  # resolved for the platform (EngineConfig.for_platform)
        self.model = model
        self.model_config = model_config
        self.model_dir = model_dir
        self.mesh = mesh  # None: the plain single-device path
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.generation_config = generation_config
        # request defaults for the sampling fields a request leaves unset (server, LLM)
        self.default_sampling = default_sampling(generation_config)
        # generation stops at any of these (unless ignore_eos); min_tokens masks them all
        self._eos_list = list(eos_token_ids)
        self.eos_token_ids = frozenset(self._eos_list)
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.proposer = proposer
        self.kv_event_publisher = kv_event_publisher  # None: KV-cache events off
        self.lora_manager = lora_manager  # jaxserve.lora.cache.LoRAManager; None: LoRA off
        spec = config.speculative
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.output_processor = OutputProcessor(tokenizer)
        self.async_scheduling = config.async_scheduling
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}
        self._swapped: dict[str, object] = {}
        self._swapped_state: dict[str, object] = {}  # host copies of swapped recurrent states
        self._child_ids = itertools.count()  # scheduler keys: never derived from a caller's id
        self._inflight: _InFlight | None = None
        self._structured = None  # StructuredOutputManager, made on the first grammar request
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    @property
    def attention_backend(self) -> str:
        return self.config.attention_backend  # resolved for the platform

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve without waiting for a compile, buckets compiled, buckets)."""
        return self.runner.startup_progress()

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, final_only: bool = False, lora_request=None) -> None:
        """Tokenize, then add to the output processor and the core (``final_only``: offline
        use, no output until the request finishes; ``lora_request``: the adapter to run)."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        prompt_text, ids = prompt_ids(self.tokenizer, prompt)
        self.add_core_request(request_id, ids, params, arrival_time=arrival_time,
                              priority=priority, lora_request=lora_request)
        self.output_processor.add_request(request_id, prompt_text, ids, params, final_only)

    def add_core_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams, *, arrival_time: float | None = None,
                         priority: int = 0, lora_request=None) -> None:
        """The core's half of ``add_request``: checked token ids into the scheduler."""
        if request_id in self._parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        if priority and self.config.scheduler.policy == "fcfs":
            raise InvalidRequestError(f"priority {priority}: priority scheduling is not enabled "
                                      "(--scheduling-policy fcfs)", param="priority")
        ids = self._check_prompt_ids(prompt_token_ids)
        self._check_lora(lora_request)
        params.verify_vocab(self.model_config.vocab_size)
        params = params.verify_logprobs(self.config.max_logprobs, self.model_config.vocab_size)
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        now = arrival_time if arrival_time is not None else time.time()
        parent = _Parent(request_id, ids, params, RequestMetrics(arrival_time=now),
                         num_prompt_logprobs=1 if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = child_seed(params.seed, i)
            # The scheduler's key is the engine's own: unique whatever ids callers choose.
            rid = f"{next(self._child_ids)}:{request_id}#{i}"
            # siblings wait for child 0's prompt pages to be cached, then share them
            share = None
            if i > 0 and self.config.cache.enable_prefix_caching:
                share = parent.children[0].request
            req = Request(rid, list(ids), child_params, arrival_time=now, priority=priority,
                          prefix_parent=share, lora_request=lora_request)
            if params.structured_outputs is not None:
                req.grammar = self.structured.grammar_for(params.structured_outputs)
            if params.allowed_token_ids is not None or params.bad_words:
                req.token_filter = TokenFilter(
                    self.model_config.vocab_size, params.allowed_token_ids,
                    bad_words_token_ids(self.tokenizer, params.bad_words or ()))
            req.use_spec = self.proposer is not None and can_speculate(child_params)
            child = _Child(req, i, new_logprobs=[] if params.logprobs is not None else None)
            parent.children.append(child)
            self._child_of[rid] = (parent, child)
            try:
                self.scheduler.add_request(req)
            except Exception:
                self.abort_request(request_id)
                raise
        self.prompt_tokens_total += len(ids)

    def _check_lora(self, lora_request) -> None:
        """The adapter is known, loaded on the host and fits the model (or the error says
        why, naming it)."""
        if lora_request is None:
            return
        if self.lora_manager is None:
            name = getattr(lora_request, "lora_name", lora_request)
            raise InvalidRequestError(f"LoRA adapter {name!r}: LoRA is not enabled (start "
                                      "with --enable-lora or LLM(enable_lora=True))",
                                      param="lora_request")
        self.lora_manager.add(lora_request)

    def add_lora(self, lora_request) -> bool:
        """Load and check an adapter ahead of its requests (``--lora-modules``, the runtime
        load route); raises naming the adapter when it cannot be served."""
        self._check_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already running keep theirs); False if unknown."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_int_id)

    def list_loras(self) -> list:
        return [] if self.lora_manager is None else self.lora_manager.list_loras()

    def _lora_stats(self) -> dict:
        """vLLM's ``lora_requests_info`` labels: adapter names running and waiting."""
        def names(reqs):
            return ",".join(sorted({r.lora_request.lora_name for r in reqs
                                    if r.lora_request is not None}))
        return dict(max_lora=self.lora_manager.max_loras,
                    running_lora_adapters=names(self.scheduler.running),
                    waiting_lora_adapters=names(self.scheduler.waiting))

    def _lora_slots(self, sched) -> dict[int, int]:
        """Each adapter of the step in a device slot: adapter id -> slot."""
        if self.lora_manager is None:
            return {}
        reqs = {s.request.lora_int_id: s.request.lora_request for s in sched.scheduled
                if s.request.lora_request is not None}
        return self.lora_manager.prepare(reqs.values()) if reqs else {}

    @property
    def structured(self):
        """The grammar compiler and matcher factory (llguidance), made on first use."""
        if self._structured is None:
            from jaxserve.engine.structured_output import StructuredOutputManager
            self._structured = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self._eos_list)
        return self._structured

    def _check_prompt_ids(self, prompt_token_ids) -> list[int]:
        """The ids as a list of ints: not empty, in the vocabulary (the length is checked by
        the scheduler)."""
        _, ids = prompt_ids(self.tokenizer, list(prompt_token_ids))
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {vocab})",
                                      param="prompt")
        return ids

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.output_processor.abort_request(rid)
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for child in parent.children:
                self._child_of.pop(child.request.request_id, None)
                self._swapped.pop(child.request.request_id, None)
                self._swapped_state.pop(child.request.request_id, None)
                if not child.request.status.is_finished:
                    self.scheduler.abort_request(child.request.request_id)
        if not self._parents:
            self._inflight = None  # only tokens nobody waits for are in flight

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    def finish_sequences(self, stops: Iterable[SequenceStop]) -> None:
        """End sequences the output processor stopped on a stop string. Ids reported after
        the one that completed it were never shown: they leave the token count."""
        for stop in stops:
            parent = self._parents.get(stop.request_id)
            if parent is None:
                continue
            child = parent.children[stop.index]
            req = child.request
            self.generation_tokens_total -= max(0, child.num_reported - stop.num_kept)
            if not req.status.is_finished:
                req.drop_pending()
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            if parent.finished:
                if parent.metrics.finished_time is None:
                    parent.metrics.finished_time = time.time()
                self._forget(parent)
        if not self._parents:
            self._inflight = None

    def _forget(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for c in parent.children:
            self._child_of.pop(c.request.request_id, None)

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the core, then its ids through the output processor."""
        outputs, stops = self.output_processor.process(self.core_step())
        if stops:
            self.finish_sequences(stops)
        return outputs

    def core_step(self) -> list[CoreOutput]:
        """Schedule -> execute (dispatch) -> update: read the previous step (async) or this
        one, and report what each touched request gained."""
        touched: dict[str, _Parent] = {}
        if self._inflight is not None and self._inflight.constrained:
            # a grammar's next mask needs the token in flight: read that step first
            done, self._inflight = self._inflight, None
            self._process(done, touched)
        sched = self.scheduler.schedule()
        self._move_pages(sched, touched)
        new = self._dispatch(sched) if sched.scheduled else None
        done = new
        if self.async_scheduling:
            done, self._inflight = self._inflight, new
        if done is not None:
            self._process(done, touched)
        self._publish_kv_events()
        return self._outputs(touched)

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.block_manager.take_events())

    def _move_pages(self, sched, touched: dict) -> None:
        """Before the step: host copies of swapped pages out and in (the freed pages may be
        reused by this very step), copies of requests that ended dropped; requests the
        scheduler aborted are reported."""
        for rid in sched.finished_req_ids:
            self._swapped.pop(rid, None)
            self._swapped_state.pop(rid, None)
        for rid, pages in sched.swap_out:
            self._swapped[rid] = (list(pages), self.runner.swap_out(pages))
        for rid, slot in sched.swap_out_state:
            self._swapped_state[rid] = self.runner.swap_out_state(slot)
        for rid, pages in sched.swap_in:
            _, saved = self._swapped.pop(rid)
            self.runner.swap_in(pages, saved)
        for rid, slot in sched.swap_in_state:
            self.runner.swap_in_state(slot, self._swapped_state.pop(rid))
        for rid in sched.finished_aborted:
            hit = self._child_of.get(rid)
            if hit:
                touched[hit[0].request_id] = hit[0]

    def _outputs(self, touched: dict) -> list[CoreOutput]:
        outputs = []
        for parent in touched.values():
            outputs.append(self._core_output(parent))
            if parent.finished:
                self._forget(parent)
        if not self._parents:
            self._inflight = None  # only tokens nobody waits for are in flight
        return outputs

    def _dispatch(self, sched) -> _InFlight:
        """Build the plan (pending tokens point at the step in flight) and enqueue it."""
        now = time.time()
        prev_rows = self._inflight.sampled_rows if self._inflight is not None else {}
        hits = [self._child_of[s.request.request_id] for s in sched.scheduled]
        for parent, _ in hits:
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now
        prompt_rows = self._prompt_logprob_rows(sched, hits)
        spans = {i: (parent, lo, hi) for i, parent, lo, hi in prompt_rows}
        slot_of = self._lora_slots(sched)
        rows = [self._plan_row(s, prev_rows, spans.get(i), slot_of.get(s.request.lora_int_id, -1))
                for i, s in enumerate(sched.scheduled)]
        bitmask, constrained = self._token_bitmask(sched)
        handle = self.runner.dispatch(self.runner.build_plan(rows, bitmask))
        self.scheduler.update_from_output(sched)  # placeholders until _process
        return _InFlight(sched, hits, handle, prompt_rows, handle.plan.query_start,
                         constrained=constrained)

    def _plan_row(self, s, prev_rows: dict[str, int], prompt_span, lora_slot: int = -1
                  ) -> ScheduledSeq:
        """One scheduled request as a plan row: its tokens and pages, its sampling params, the
        pending token of a penalty row's history, the next prompt tokens for prompt logprobs."""
        r = s.request
        history_ref = None
        if s.sample and r.num_pending and r.sampling_params.uses_penalties:
            # the pending id is the last output id in the penalty history
            history_ref = (prev_rows[r.request_id], r.num_tokens - 1)
        next_ids = None
        if prompt_span is not None:
            parent, lo, hi = prompt_span
            next_ids = parent.prompt_token_ids[lo + 1:hi + 1]
        return ScheduledSeq(
            new_token_ids=s.new_token_ids, start_pos=s.start_pos, block_ids=r.pages_per_group(),
            sample=s.sample, prev_row=prev_rows.get(r.request_id, -1), num_draft=s.num_draft,
            sampling=SamplingRow(r.sampling_params, r.output_token_ids, r.prompt_token_ids,
                                 self._eos_list, r.num_output_tokens) if s.sample else None,
            history_ref=history_ref, prompt_next_ids=next_ids, state_slot=r.state_slot,
            lora_slot=lora_slot, next_token=self._next_known_token(s))

    @staticmethod
    def _next_known_token(s) -> int:
        """The known token after a row that does not sample (a prefill chunk's next prompt
        token), for the MTP head; -1 for a sampling row (its own sampled token follows)."""
        if s.sample:
            return -1
        i = s.start_pos + s.num_new_tokens
        ids = s.request.all_token_ids
        return int(ids[i]) if i < len(ids) else -1

    def _token_bitmask(self, sched) -> tuple[np.ndarray | None, bool]:
        """The rows' allowed tokens (grammars, allowed_token_ids, bad_words), or None when no
        row is constrained; and whether a row's next mask needs the token this step samples."""
        constrained = [(i, s.request.grammar) for i, s in enumerate(sched.scheduled)
                       if s.sample and s.request.grammar is not None]
        filtered = [(i, s.request) for i, s in enumerate(sched.scheduled)
                    if s.sample and s.request.token_filter is not None]
        if not constrained and not filtered:
            return None, False
        bitmask = np.full((len(sched.scheduled), self.runner.bitmask_width()), -1, np.int32)
        if constrained:
            self.structured.fill_bitmask(constrained, bitmask)
        for i, r in filtered:
            bitmask[i] &= r.token_filter.row(r.output_token_ids)
        return bitmask, bool(constrained) or any(r.needs_known_tokens for _, r in filtered)

    def _process(self, done: _InFlight, touched: dict) -> None:
        """Read a dispatched step's ids: resolve the placeholders, record logprobs, stop."""
        out = self.runner.fetch(done.handle)
        for i, parent, lo, hi in done.prompt_rows:
            self._record_prompt_logprobs(parent, out, int(done.query_start[i]), lo, hi)
        token_ids = out.token_ids.tolist()  # Python ints
        now = time.time()
        to_propose = []
        for i, (s, hit) in enumerate(zip(done.sched.scheduled, done.hits)):
            req = s.request
            if not s.sample or req.is_finished or self._child_of.get(req.request_id) is not hit:
                continue  # no token, or stopped / aborted since: its token is dropped
            parent, child = hit
            touched[parent.request_id] = parent
            if s.num_draft:
                self._on_verified(req, parent, child, s.num_draft, out, i, now)
            else:
                req.resolve_pending(token_ids[i])
                self.block_manager.cache_full_blocks(req)
                self._on_token(parent, child, token_ids[i], out, i, now)
            if req.use_spec and not req.is_finished and not req.num_pending:
                to_propose.append(req)
        if hasattr(self.proposer, "observe"):  # drafts made on the device in this step
            self.proposer.observe(done.sched.scheduled, out)
        if to_propose:
            self._propose(to_propose)

    def _on_verified(self, req: Request, parent: _Parent, child: _Child, num_draft: int, out,
                     row: int, now: float) -> None:
        """A verify row: accepted drafts + the target's token, each through the stop checks
        (a stop inside the run drops what follows it)."""
        n = int(out.num_emitted[row])
        toks = out.spec_token_ids[row, :n].tolist()
        self.spec_stats.observe(num_draft, n - 1)
        self.scheduler.commit_verified(req, n - 1)
        for tok in toks:
            req.append_output_token(tok)
            self._on_token(parent, child, tok, out, row, now)
            if req.is_finished:
                return
        self.block_manager.cache_full_blocks(req)

    def _propose(self, reqs: list[Request]) -> None:
        """Drafts for requests whose tokens are all known, up to what max_tokens and
        max_model_len leave room for."""
        want, room = [], []
        for req in reqs:
            n = self.max_model_len - req.num_tokens
            if req.max_tokens is not None:
                n = min(n, req.max_tokens - req.num_output_tokens - 1)
            req.spec_token_ids = []
            if n > 0:
                want.append(req)
                room.append(n)
        if want:
            for req, draft in zip(want, self.proposer.propose(want, room)):
                req.spec_token_ids = [int(t) for t in draft]

    def _prompt_logprob_rows(self, sched, hits: list) -> list:
        """(row, parent, lo, hi): prompt positions lo..hi-1 of this step whose next prompt token
        still needs its logprob (child 0 only; a recomputed prefix is not recorded twice).
        ``hits`` is the (parent, child) of each scheduled row."""
        rows = []
        for i, (s, (parent, child)) in enumerate(zip(sched.scheduled, hits)):
            if child.index != 0 or parent.num_prompt_logprobs is None:
                continue
            lo = max(s.start_pos, parent.num_prompt_logprobs - 1)
            hi = min(s.start_pos + s.num_new_tokens, len(parent.prompt_token_ids) - 1)
            if hi > lo:
                rows.append((i, parent, lo, hi))
        return rows

    def _record_prompt_logprobs(self, parent: _Parent, out, t0: int, lo: int, hi: int) -> None:
        tok_lp, top_ids, top_lp, ranks = out.prompt_logprobs
        k = parent.params.prompt_logprobs
        for j in range(lo, hi):
            t = t0 + (j - lo)
            parent.new_prompt_logprobs.append(TokenLogprobs(
                parent.prompt_token_ids[j + 1], float(tok_lp[t]), int(ranks[t]),
                top_ids[t, :k].tolist(), top_lp[t, :k].tolist()))
            parent.num_prompt_logprobs += 1

    def _on_token(self, parent: _Parent, child: _Child, tok: int, out, row: int, now: float):
        """A known output id: logprobs kept for the next report, then the stops seen on ids."""
        req, params = child.request, child.request.sampling_params
        self.generation_tokens_total += 1
        m = parent.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if child.new_logprobs is not None:
            child.new_logprobs.append(self._position_logprobs(tok, out, row, params.logprobs))
        if self.scheduler.check_stop(req, tok) and parent.finished:
            m.finished_time = now

    @staticmethod
    def _position_logprobs(tok: int, out, row: int, k: int) -> TokenLogprobs:
        tl = TokenLogprobs(tok, float(out.logprobs[row]),
                           int(out.ranks[row]) if out.ranks is not None else None)
        if k and out.topk_ids is not None:
            tl.top_ids = out.topk_ids[row, :k].tolist()
            tl.top_logprobs = out.topk_logprobs[row, :k].tolist()
        return tl

    def _core_output(self, parent: _Parent) -> CoreOutput:
        """What this request gained since its last report."""
        comps = []
        for c in parent.children:
            r = c.request
            known = r.num_known_output_tokens
            new = r.output_token_ids[c.num_reported:known]
            if not new and not r.status.is_finished:
                continue
            comps.append(CoreCompletion(
                c.index, new, c.new_logprobs, finish_reason=r.finish_reason,
                stop_reason=r.stop_reason))
            c.num_reported = known
            if c.new_logprobs is not None:
                c.new_logprobs = []
        first = parent.children[0].request
        prompt_lps = parent.new_prompt_logprobs or None
        parent.new_prompt_logprobs = []
        return CoreOutput(parent.request_id, comps, finished=parent.finished,
                          new_prompt_logprobs=prompt_lps, metrics=parent.metrics,
                          num_cached_tokens=getattr(first, "num_cached_tokens", 0))

    # ---- stats -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page; False (nothing dropped) while pages are in use."""
        dropped = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return dropped

    def stats(self) -> dict:
        """The scheduler's stats plus what only the engine knows (compiles, token counters, pool
        size). The short names (``num_running`` ...) are what metrics, the server and dp read."""
        s = self.scheduler.stats()
        s.update(
            num_running=s["num_requests_running"],
            num_waiting=s["num_requests_waiting"],
            kv_cache_usage=s["kv_cache_usage_perc"],
            num_preemptions=s["num_preemptions_total"],
            num_compiles=self.runner.num_compiles + getattr(self.proposer, "num_compiles", 0),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_free_pages=self.block_manager.num_free_pages,
            num_pages=self.runner.num_pages,
        )
        if self.proposer is not None:
            s.update(self.spec_stats.as_dict())
        if self.lora_manager is not None:
            s.update(self._lora_stats())
        return s


def child_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of an ``n > 1`` request (vLLM's ``seed + index``), kept in
    the sampler's 64-bit range: distinct for distinct indices of one parent."""
    return (seed + index) % (MAX_SEED + 1)

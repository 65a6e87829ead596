"""LLMEngine: requests in, one scheduled device step at a time, RequestOutputs out.

    add_request (front: tokenize, fan n > 1 out, register with the output processor)
      -> add_core_request (core: one checked request per sequence into the scheduler)
    core_step: Scheduler.schedule -> InputBatch.apply + prepare_inputs -> runner.dispatch
      -> update_after_dispatch
      -> (one step later with async scheduling) runner.fetch -> Scheduler.update_from_output
      -> CoreOutputs -> OutputProcessor.process -> RequestOutputs

Built by ``jaxserve.engine.builder.build_engine``. The core keeps a **batch queue** of
dispatched steps (vLLM's ``step_with_batch_queue``) and reads the oldest once the queue holds
``batch_queue_size`` of them or nothing new was scheduled. Async scheduling (on by default):
two, so ``step()`` schedules and dispatches step N+1, then reads step N's sampled ids and the
host work of one step runs while the device computes the next. With P pipeline stages: P, each
step a micro-batch of other requests (the scheduler skips a request whose token is in flight
and spreads the running ones over the micro-batches), so stage 0 runs step N+1 while stage 1
runs step N; prefill chunks of one request may be in flight together, since every stage runs
the steps in order. The scheduler appends a placeholder for each
token in flight; the step that consumes it reads the real id on the device. Stopping on ids
and building each request's ``CoreOutput`` is the scheduler's ``update_from_output``, run when
the ids arrive, one step behind; a token sampled after a stop is dropped. Without async
scheduling the same step is fetched at once.

The core only ever sees requests of one sequence: ``n > 1`` is fanned out by the front end
(engine/parallel_sampling.py) and merged back by the output processor. Text (detokenization,
stop strings, logprob entries) is the ``OutputProcessor``'s. ``step`` runs both halves in this
process (the ``LLM`` and ``AsyncLLM`` path); ``jaxserve serve`` runs ``core_step`` in the core
process and the front end in the API process (engine/core_process.py, engine/core_client.py).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from jaxserve.core.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.core import prompt_embeds as prompt_embeds_lib
from jaxserve.core.outputs import CoreOutput, RequestOutput
from jaxserve.core.request import Request, RequestStatus
from jaxserve.worker.host_memory import memory_by_part
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.logits_processors import LogitsProcessorError
from jaxserve.worker.runner import ModelRunner
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.spec_decode import SpecDecodeStats, can_speculate
from jaxserve.engine.generation_config import default_sampling
from jaxserve.engine.token_filter import TokenFilter, bad_words_token_ids
from jaxserve.engine.output_processor import OutputProcessor, SequenceStop
from jaxserve.engine import multimodal
from jaxserve.engine.tokenizer import prompt_ids
from jaxserve.engine.weight_sync import WeightControl
from jaxserve.engine.decoder_pooling import DecoderPooling, decoder_pooling_info
from jaxserve.core.pooling_params import PoolingParams

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A dispatched step whose ids have not been read yet."""

    sched: object  # SchedulerOutput
    handle: object  # runner.StepHandle
    constrained: bool = False  # a sampled row has a grammar: read it before the next schedule
    generations: np.ndarray | None = None  # the batch rows' generations at dispatch


class LLMEngine(WeightControl):
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
        self._compiles_at_warmup: int | None = None  # stats' num_compiles when warm-up ended
        self.kv_event_publisher = kv_event_publisher  # None: KV-cache events off
        self.kv_connector = None  # engine.kv_connector.KVConnector (--kv-transfer-config)
        self.lora_manager = lora_manager  # jaxserve.lora.cache.LoRAManager; None: LoRA off
        spec = config.speculative
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        scheduler.spec_stats = self.spec_stats if proposer is not None else None
        # state-pool models have no prefix cache: n > 1 siblings copy the first child's pages
        # and state instead (followers of a multi-host leader replay steps only, not copies)
        scheduler.siblings.fork_prompts = (block_manager.state_slots is not None
                                           and config.parallel.num_hosts == 1)
        self.output_processor = OutputProcessor(tokenizer)
        self.async_scheduling = config.async_scheduling
        self._swapped: dict[str, object] = {}  # host copies of swapped pages, by request
        # the prefix cache's host tier, its buffers (worker.kv_offload.HostKVCache; None: off)
        self.host_kv = None
        self._swapped_state: dict[str, object] = {}  # host copies of swapped recurrent states
        # dispatched steps whose ids are not read yet, oldest first (the batch queue)
        self._queue: collections.deque[_InFlight] = collections.deque()
        pp = config.parallel.pipeline_parallel_size
        self.batch_queue_size = max(2, pp) if self.async_scheduling else 1
        if pp > 1 and self.async_scheduling:  # micro-batches of different requests
            scheduler.skip_pending = True
            scheduler.max_seqs_per_step = -(-scheduler.max_num_seqs // self.batch_queue_size)
        self.max_in_flight = 0  # the most steps ever in flight
        # the worker's persistent rows: the scheduler's diffs in, each step's inputs out
        self.input_batch = InputBatch.for_runner(runner, self._eos_list, seed=config.seed)
        # images: the front end's processor and the runner's encoder step (engine.multimodal)
        self.mm_processor = multimodal.input_processor(self)
        multimodal.attach_encoder(self, self.mm_processor)
        self._structured = None  # StructuredOutputManager, made on the first grammar request
        self.prompt_tokens_total = 0  # an n > 1 prompt counts once
        # custom logits processors (worker.logits_processors; the builder sets them), and
        # the outputs of requests a failing processor ended, reported with the next step
        self.logits_processors = None
        self._failed: list[CoreOutput] = []
        # embeddings from this decoder (LAST pooling of the final hidden state) beside its
        # generation; None where a stage or host other than this one holds the last layer
        self.pooling = (DecoderPooling(self, decoder_pooling_info(model_config,
                                                                  config.pooler_config))
                        if config.parallel.pipeline_parallel_size == 1
                        and config.parallel.num_hosts == 1 else None)

    @property
    def attention_backend(self) -> str:
        return self.config.attention_backend  # resolved for the platform

    def startup_progress(self) -> tuple[bool, int, int]:
        """(ready to serve without waiting for a compile, buckets compiled, buckets)."""
        return self.runner.startup_progress()

    # ---- requests: the front end ---------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, arrival_time: float | None = None,
                    priority: int = 0, final_only: bool = False, lora_request=None,
                    **kw) -> None:
        """Tokenize, register with the output processor and add its core requests (one per
        sequence; ``final_only``: offline use, no output until the request finishes;
        ``lora_request``: the adapter to run)."""
        if isinstance(params, PoolingParams):
            if self.pooling is None:
                raise InvalidRequestError("embeddings from a generative model need its last "
                                          "layer on this host (no pipeline parallelism)",
                                          param="model")
            return self.pooling.add(request_id, prompt, params, arrival_time=arrival_time,
                                    priority=priority, lora_request=lora_request, **kw)
        if kw:
            raise TypeError(f"unexpected arguments {sorted(kw)}")
        params = params or SamplingParams()
        embeds = images = None
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            embeds = self._check_prompt_embeds(prompt["prompt_embeds"])
            prompt_text, ids = None, [prompt_embeds_lib.PLACEHOLDER_ID] * len(embeds)
        else:
            prompt, mm_data = multimodal.split_prompt(prompt)
            prompt_text, ids = prompt_ids(self.tokenizer, prompt)
            if mm_data is not None:
                if self.mm_processor is None:
                    raise multimodal.text_only_error()
                ids, images = self.mm_processor.process(ids, mm_data)
        parent = self.output_processor.add_request(request_id, prompt_text,
                                                   [] if embeds is not None else ids, params,
                                                   final_only)
        now = arrival_time if arrival_time is not None else time.time()
        try:
            for child in parent.children:
                self.add_core_request(child.request_id, ids, child.params, arrival_time=now,
                                      priority=priority, lora_request=lora_request,
                                      prefix_parent=child.prefix_parent,
                                      final_only=final_only and not child.params.stop,
                                      mm=images, prompt_embeds=embeds)
        except Exception:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort front-end requests: every core request of each."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        pooled = [rid for rid in request_ids
                  if self.pooling is not None and rid in self.pooling.pending]
        self.abort_core_requests(pooled + self.output_processor.abort_requests(request_ids))

    def get_num_unfinished_requests(self) -> int:
        pooling = len(self.pooling.pending) if self.pooling is not None else 0
        return self.output_processor.num_requests + pooling

    def step(self) -> list[RequestOutput]:
        """One step of the core, then its ids through the output processor."""
        core = self.core_step()
        pooled = []
        if self.pooling is not None and self.pooling.pending:
            pooled, core = self.pooling.outputs(core)
        outputs, stops = self.output_processor.process(core)
        if stops:
            self.finish_sequences(stops)
        return pooled + outputs

    # ---- requests: the core ------------------------------------------------------------
    def add_core_request(self, request_id: str, prompt_token_ids: list[int],
                         params: SamplingParams, *, arrival_time: float | None = None,
                         priority: int = 0, lora_request=None,
                         prefix_parent: str | None = None, final_only: bool = False,
                         mm=None, prompt_embeds=None, pooling=None) -> None:
        """Checked token ids of one sequence into the scheduler (``prefix_parent``: the core
        request whose prompt this one repeats, an n > 1 sibling's child 0; ``final_only``: no
        output until it finishes, for a front end that shows nothing before and checks no
        stop string; ``mm``: its processed images, ``core.mm_inputs.MultiModalInputs``;
        ``prompt_embeds``: ``[len(ids), hidden]`` rows the prompt positions read instead of
        their ids)."""
        if params.n != 1:
            raise InvalidRequestError(f"n={params.n}: the engine core runs one sequence per "
                                      "request (the front end fans n > 1 out)", param="n")
        if self.scheduler.get_request(request_id) is not None:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        if priority and self.config.scheduler.policy == "fcfs":
            raise InvalidRequestError(f"priority {priority}: priority scheduling is not enabled "
                                      "(--scheduling-policy fcfs)", param="priority")
        ids = self._check_prompt_ids(prompt_token_ids)
        self._check_lora(lora_request)
        params.verify_vocab(self.model_config.vocab_size)
        params = params.verify_logprobs(self.config.max_logprobs, self.model_config.vocab_size)
        params = params.verify_hidden_states(self.model_config.num_layers,
                                             self.config.max_hidden_state_layers)
        if params.structured_outputs is not None:
            self.structured.validate(params.structured_outputs)
        if self.logits_processors is not None:
            try:
                self.logits_processors.validate(params)
            except ValueError as e:
                raise InvalidRequestError(str(e), param="logits_processors") from None
        salt = None
        if prompt_embeds is not None:
            prompt_embeds = self._check_prompt_embeds(prompt_embeds)
            if len(prompt_embeds) != len(ids):
                raise InvalidRequestError(f"prompt_embeds has {len(prompt_embeds)} rows for "
                                          f"{len(ids)} prompt ids", param="prompt_embeds")
            salt = prompt_embeds_lib.digest(prompt_embeds)
        req = Request(request_id, ids, params, arrival_time=arrival_time, priority=priority,
                      prefix_parent=prefix_parent, lora_request=lora_request, cache_salt=salt)
        req.prompt_embeds = prompt_embeds
        req.pooling_params = pooling
        if mm is not None:
            if getattr(self.runner, "mm", None) is None:
                raise multimodal.text_only_error()
            req.mm = mm
        if params.structured_outputs is not None:
            req.grammar = self.structured.grammar_for(params.structured_outputs)
        if params.allowed_token_ids is not None or params.bad_words:
            req.token_filter = TokenFilter(
                self.model_config.vocab_size, params.allowed_token_ids,
                bad_words_token_ids(self.tokenizer, params.bad_words or ()))
        req.use_spec = self.proposer is not None and can_speculate(params)
        req.final_only = final_only
        self._admit(req)  # held while a weight swap waits; refused while asleep
        if prefix_parent is None:
            self.prompt_tokens_total += len(ids)

    def abort_core_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        if self.pooling is not None:
            self.pooling.abort(request_ids)
        for rid in request_ids:
            self._swapped.pop(rid, None)
            self._swapped_state.pop(rid, None)
            self.scheduler.abort_request(rid)
        self._drop_held(request_ids)
        self._drop_inflight_if_idle()

    def finish_sequences(self, stops: Iterable[SequenceStop]) -> None:
        """End core requests the output processor stopped on a stop string. Ids reported after
        the one that completed it were never shown: they leave the token count."""
        for stop in stops:
            req = self.scheduler.get_request(stop.request_id)
            if req is None:
                continue  # the core ended it meanwhile
            self.scheduler.generation_tokens_total -= max(0, req.num_reported - stop.num_kept)
            req.drop_pending()
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        self._drop_inflight_if_idle()

    @property
    def generation_tokens_total(self) -> int:
        return self.scheduler.generation_tokens_total

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._weights_busy()

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def _drop_inflight_if_idle(self) -> None:
        if not self.scheduler.has_unfinished():
            self._queue.clear()  # only tokens nobody waits for are in flight

    # ---- checks, adapters, grammars --------------------------------------------------
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

    def _check_prompt_embeds(self, value):
        """``[n, hidden]`` float32 embeddings, when the engine takes them."""
        if not self.config.enable_prompt_embeds:
            raise InvalidRequestError("prompt_embeds needs an engine started with "
                                      "enable_prompt_embeds (--enable-prompt-embeds)",
                                      param="prompt_embeds")
        return prompt_embeds_lib.as_embeds(value, self.model_config.hidden_size)

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

    # ---- the step ----------------------------------------------------------------------
    def core_step(self) -> list[CoreOutput]:
        """Schedule -> execute -> update: what each request gained from the step read now (the
        previous one with async scheduling)."""
        outputs = self._weight_step()  # aborted by an update; a waiting swap once idle
        if self.kv_connector is not None:  # pulled pages in, held ones out, late pulls failed
            outputs += self.kv_connector.before_schedule()
        while any(d.constrained for d in self._queue):
            # a grammar's next mask needs the token in flight: read that step first
            outputs += self._update(self._queue.popleft())
        sched = self.scheduler.schedule()
        if self.kv_connector is not None:
            self.kv_connector.after_schedule(bool(sched.scheduled))
        step = self._execute(sched)
        if step is not None:
            self._queue.append(step)
            self.max_in_flight = max(self.max_in_flight, len(self._queue))
        if self._queue and (len(self._queue) >= self.batch_queue_size or step is None):
            outputs += self._update(self._queue.popleft())
        return self._end_step(sched, outputs)

    def _end_step(self, sched, outputs: list[CoreOutput]) -> list[CoreOutput]:
        self._publish_kv_events()
        self._drop_inflight_if_idle()
        if self._failed:
            outputs, self._failed = self._failed + outputs, []
        return sched.finished_outputs + outputs

    def _publish_kv_events(self) -> None:
        if self.kv_event_publisher is not None:
            events = self.block_manager.take_events()
            if self.scheduler.kv_offload is not None:
                events += self.scheduler.kv_offload.take_events()
            self.kv_event_publisher.publish(events)

    def _execute(self, sched) -> _InFlight | None:
        """Move swapped pages, apply the diff to the persistent batch, then build the step's
        inputs (pending tokens name the batch row that sampled them) and enqueue it; None
        when nothing was scheduled."""
        self._move_pages(sched)
        batch = self.input_batch
        batch.apply(sched.batch)
        encoder = self.runner.mm  # a vision-language model's encoder step, or None
        if encoder is not None:
            encoder.apply(sched.batch)
        if not sched.scheduled:
            return None
        bitmask, constrained = self._token_bitmask(sched)
        plan = batch.prepare_inputs(sched.batch, ladder=self.runner._plan_ladder(),
                                    token_bitmask=bitmask, lora_slots=self._lora_slots(sched))
        mm = None if encoder is None else encoder.prepare(sched.batch, plan.positions,
                                                                plan.seq_bucket)
        if self.pooling is not None and self.pooling.pending:
            # pooling requests' last prompt chunks: their final hidden states reach the host
            pool_rows = [s.sample and s.request.pooling_params is not None
                         for s in sched.scheduled]
            if any(pool_rows):
                mask = np.zeros(plan.seq_bucket, bool)
                mask[:len(pool_rows)] = pool_rows
                plan = dataclasses.replace(plan, pool_rows=mask)
        if self.logits_processors is not None:
            try:
                handle = self._dispatch_with_processors(sched, plan, mm)
            except LogitsProcessorError as e:
                self._fail_step(sched, str(e))
                return None
        elif mm is None:
            handle = self.runner.dispatch(plan)
        else:
            handle = self.runner.dispatch(plan, mm)
        self.scheduler.update_after_dispatch(sched)  # placeholders until _update
        rows = plan.token_rows[:plan.num_seqs]
        return _InFlight(sched, handle, constrained=constrained,
                         generations=batch.generation[np.maximum(rows, 0)])

    def _dispatch_with_processors(self, sched, plan, mm=None):
        """Tell the custom logits processors the step's batch, then dispatch with their
        state (jax) and their host function."""
        reqs = {s.request.request_id: s.request for s in sched.scheduled}

        def added(rid):
            r = reqs[rid]
            return r.sampling_params, r.prompt_token_ids, r.output_token_ids

        state, host = self.logits_processors.begin_step(sched.batch.req_ids, added,
                                                        plan.seq_bucket)
        plan = dataclasses.replace(plan, processor_state=state)
        return self.runner.dispatch(plan, mm, host_logits=host)

    def _fail_step(self, sched, why: str) -> None:
        """A logits processor raised: every request of the step ends (``abort``, the error
        as its stop reason); the others go on."""
        logger.error("%s: failing the %d requests of the step", why, len(sched.scheduled))
        for s in sched.scheduled:
            req = s.request
            if req.is_finished:
                continue
            req.drop_pending()
            req.stop_reason = why
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
            self._failed.append(req.take_output())

    def _update(self, done: _InFlight) -> list[CoreOutput]:
        """Read a dispatched step's ids into the scheduler (and the batch rows' token
        buffers); drafts for what may speculate."""
        out = self.runner.fetch(done.handle)
        self._record(done, out)
        outputs = self.scheduler.update_from_output(done.sched, out)
        if self.proposer is not None:
            if hasattr(self.proposer, "observe"):  # drafts made on the device in this step
                self.proposer.observe(done.sched.scheduled, out)
            to_propose = [s.request for s in done.sched.scheduled
                          if s.sample and s.request.use_spec and not s.request.is_finished
                          and not s.request.num_pending]
            if to_propose:
                self._propose(to_propose)
        return outputs

    def _move_pages(self, sched) -> None:
        """Before the step: host copies of swapped pages out and in (the freed pages may be
        reused by this very step), copies of requests that ended dropped, and n > 1 siblings'
        forks (the first child's prompt pages and state into theirs)."""
        host_kv = self.host_kv
        if host_kv is not None:  # first: a store reads a page this step may reuse
            host_kv.store(self.scheduler.kv_offload.take_stores())
        for rid in sched.finished_req_ids:
            self._swapped.pop(rid, None)
            self._swapped_state.pop(rid, None)
        for rid, pages in sched.swap_out:
            self._swapped[rid] = (list(pages), self.runner.swap_out(pages))
        for rid, slot in sched.swap_out_state:
            self._swapped_state[rid] = self.runner.swap_out_state(slot)
        if host_kv is not None:  # host-tier hits into fresh pages (after the swap-outs)
            host_kv.load(sched.kv_loads)
        for rid, pages in sched.swap_in:
            _, saved = self._swapped.pop(rid)
            self.runner.swap_in(pages, saved)
        for rid, slot in sched.swap_in_state:
            self.runner.swap_in_state(slot, self._swapped_state.pop(rid))
        if sched.fork_pages or sched.fork_states:
            self.runner.fork(sched.fork_pages, sched.fork_states)

    def _record(self, done: _InFlight, out) -> None:
        """The step's sampled ids into their batch rows' token buffers (penalty histories and
        the MTP head's next tokens read them there), at the position each id takes."""
        plan = done.handle.plan
        n = plan.num_seqs
        rows = plan.token_rows[:n]
        pos = plan.seq_lens[:n].copy()
        if out.num_emitted is None:
            self.input_batch.record(rows, done.generations, pos, out.token_ids[:n])
            return
        # verify rows: the accepted drafts and the target's token, from the first draft's slot
        nd = plan.num_draft[:n]
        pos -= nd
        k = out.spec_token_ids.shape[1]
        j = np.arange(k)[None, :]
        keep = j < out.num_emitted[:n, None]
        self.input_batch.record(np.repeat(rows, k)[keep.ravel()],
                                np.repeat(done.generations, k)[keep.ravel()],
                                (pos[:, None] + j)[keep], out.spec_token_ids[:n][keep])

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
            memory_bytes=memory_by_part(self.runner),
        )
        if self.runner.compiles_at_warmup is not None:
            if self._compiles_at_warmup is None:  # the draft's count as it stands then
                self._compiles_at_warmup = s["num_compiles"] - (self.runner.num_compiles
                                                                - self.runner.compiles_at_warmup)
            s["num_compiles_at_warmup"] = self._compiles_at_warmup
        if self.proposer is not None:
            s.update(self.spec_stats.as_dict())
        if self.lora_manager is not None:
            s.update(self._lora_stats())
        if self.kv_connector is not None:
            s.update(self.kv_connector.stats())
        return s

"""Continuous batching under a token budget (vLLM V1 semantics), host side only (no jax).

Each ``schedule()`` call builds one step:
1. running requests, in (priority, arrival) order, each get its next chunk: one token for a
   decode, up to the remaining budget for a prefill. If its pages run out, the lowest-priority
   / latest running request is preempted (recompute: pages dropped; swap: pages copied to host
   memory by the runner) until it fits. A request that cannot fit even alone is aborted.
2. if nothing was preempted, waiting requests (new, preempted, swapped) are admitted in
   (priority, arrival) order while budget, ``max_num_seqs`` and pages last; a new request
   first takes the longest cached prefix from the prefix cache.

The engine's step is ``schedule`` -> dispatch -> ``update_after_dispatch`` (the sampled ids
are placeholders while on the device) -> ``update_from_output`` once the ids reach the host:
placeholders resolved, verified drafts committed, logprobs kept, stops checked on ids
(``check_stop``: EOS, stop token ids, max_tokens, max_model_len, a finished grammar) and one
``CoreOutput`` per request that gained ids. Progress is counted only after dispatch, so
``num_computed_tokens`` never runs ahead of what the device has been asked to compute
(schedule() only sets it to a prefix-cache hit, or to 0 on a recompute preemption).
"""
from __future__ import annotations

import bisect
import time
from typing import Iterable

from jaxserve.core.batch_diff import NewRequestData, page_updates
from jaxserve.core.block_manager import BlockManager, cdiv
from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import CoreOutput, TokenLogprobs
from jaxserve.core.request import FINISHED_STATUSES, PLACEHOLDER, Request, RequestStatus
from jaxserve.core.sched_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.siblings import Siblings
from jaxserve.core.stop_check import stop_status

ABORT_KV_CACHE_EXHAUSTED = "kv_cache_exhausted"


def _order_key(req: Request):
    return (req.priority, req.arrival_time, req._seq_no)


class Scheduler:
    # plain rows (a decode inside its last page; an id that needs no grammar or logprobs)
    # go through the loops' inline branches; False: the general per-row path for every row,
    # which those branches must match exactly (tests compare the two)
    inline_plain_rows = True

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        block_manager: BlockManager,
        max_model_len: int,
        page_bytes: int | None = None,
        eos_token_ids: Iterable[int] = (),
        max_loras: int | None = None,
    ):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if block_manager.block_size != cache_config.block_size:
            raise ValueError(
                f"block manager block_size {block_manager.block_size} != cache_config.block_size"
                f" {cache_config.block_size}"
            )
        if (not scheduler_config.enable_chunked_prefill
                and scheduler_config.max_num_batched_tokens < max_model_len):
            raise ValueError(
                f"--max-num-batched-tokens ({scheduler_config.max_num_batched_tokens}) is smaller"
                f" than --max-model-len ({max_model_len}) with --no-enable-chunked-prefill: a"
                " longer prompt could never be scheduled; raise --max-num-batched-tokens, lower"
                " --max-model-len or enable chunked prefill (--enable-chunked-prefill)"
            )
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)  # stop ids of every request (ignore_eos)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.preemption_mode = scheduler_config.preemption_mode
        # LoRA: at most this many distinct adapters run at once (None: LoRA off)
        self.max_loras = max_loras
        # while the runner's buckets compile: the largest compiled token bucket (limit_tokens)
        self.token_limit: int | None = None
        # pipeline parallel: a request whose sampled token is still in flight waits for it, so
        # the steps in flight are micro-batches of different requests (the engine core's batch queue, engine/llm_engine.py);
        # and a step holds at most max_seqs_per_step of them, so the running requests spread
        # over the micro-batches instead of travelling in one
        self.skip_pending = False
        self.max_seqs_per_step: int | None = None
        # an image's placeholder tokens see each other both ways (Gemma 4's
        # use_bidirectional_attention="vision"): a chunk never ends inside an image's run, since
        # its earlier tokens attend to its later ones in the same step (set by the engine)
        self.whole_image_runs = False
        self._run_waits = False
        if page_bytes is None:
            self.swap_capacity_pages: float = float("inf")
        else:
            if page_bytes < 1:
                raise ValueError(f"page_bytes must be >= 1, got {page_bytes}")
            self.swap_capacity_pages = int(cache_config.swap_space * (1 << 30)) // page_bytes

        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by (priority, arrival, seq)
        self.running: list[Request] = []  # sorted by (priority, arrival, seq)
        self._swapped_pages: dict[str, int] = {}  # request_id -> pages held in host memory
        self._finished_since_schedule: list[str] = []
        # the step being scheduled: (req_id, num_tokens, start_pos, sample, num_draft,
        # num_output) of each row, in order (BatchDiff's row columns)
        self._cols: list[tuple] = []
        self._seq_counter = 0
        # n > 1 siblings: who waits for whose prompt, and (fork_prompts) who forks from it
        self.siblings = Siblings(self.requests, block_manager)
        self.num_preemptions_total = 0
        self.num_swap_outs_total = 0
        self.num_aborted_by_scheduler = 0
        self.generation_tokens_total = 0  # output ids read from the device
        self.spec_stats = None  # SpecDecodeStats of a speculating engine
        # disaggregated prefill/decode (core.kv_transfer.KVTransferState); None: off
        self.kv_transfer = None
        # the prefix cache's host-memory tier (core.kv_offload.KVOffload); None: off
        self.kv_offload = None

    # -- counters ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped_pages)

    @property
    def swap_used_pages(self) -> int:
        return sum(self._swapped_pages.values())

    @property
    def max_pages_per_seq(self) -> int:
        """Block-table width M: no request ever computes a position >= max_model_len."""
        return cdiv(self.max_model_len, self.block_size)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_loading(self) -> int:
        """Requests waiting for their prompt KV from a prefill instance."""
        return len(self.kv_transfer.loading) if self.kv_transfer is not None else 0

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def reset_prefix_cache(self) -> bool:
        dropped = self.block_manager.reset_prefix_cache()
        if dropped and self.kv_offload is not None:
            self.kv_offload.reset()
        return dropped

    def stats(self) -> dict:
        """Gauges and counters for metrics (vLLM names, without the prefix)."""
        bm = self.block_manager
        return dict(
            num_requests_running=self.num_running,
            num_requests_waiting=self.num_waiting + self.num_loading,
            num_requests_swapped=self.num_swapped,
            cpu_cache_usage_perc=(self.swap_used_pages / self.swap_capacity_pages
                                  if 0 < self.swap_capacity_pages < float("inf") else 0.0),
            kv_cache_usage_perc=bm.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_hit_rate=bm.hit_rate,
        ) | ({} if self.kv_offload is None else dict(
            external_prefix_cache_queries=self.kv_offload.queries,
            external_prefix_cache_hits=self.kv_offload.hits,
            kv_offload_usage_perc=self.kv_offload.usage,
        ))

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Validate and queue. Prompts over ``max_model_len`` (or the whole KV pool) are rejected;
        ``request.max_tokens`` is capped so prompt + output fits ``max_model_len``."""
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", param="request_id")
        n = request.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("the prompt cannot be empty", param="prompt")
        if n > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt (length {n}) is longer than the maximum model length of"
                f" {self.max_model_len}", param="prompt")
        if cdiv(n, self.block_size) > self.block_manager.num_usable_pages:
            raise InvalidRequestError(
                f"the prompt (length {n}) needs {cdiv(n, self.block_size)} KV cache pages but the"
                f" cache only has {self.block_manager.num_usable_pages}", param="prompt")
        if self.whole_image_runs and request.mm is not None:
            for i, im in enumerate(request.mm.images):
                if im.num_tokens > self.config.max_num_batched_tokens:
                    raise InvalidRequestError(
                        f"image {i} becomes {im.num_tokens} tokens that attend to each other "
                        "and so run in one step, more than --max-num-batched-tokens "
                        f"({self.config.max_num_batched_tokens})",
                        param=f"multi_modal_data.image[{i}]")
        if request.max_tokens is not None and request.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {request.max_tokens}", param="max_tokens")
        # Like vLLM: generation stops once prompt + output reaches max_model_len (>= 1 token).
        cap = max(1, self.max_model_len - n)
        request.max_tokens = cap if request.max_tokens is None else min(request.max_tokens, cap)
        request.status = RequestStatus.WAITING
        if self.kv_transfer is not None:
            self.kv_transfer.on_add(request)
        elif (getattr(request.sampling_params, "extra_args", None) or {}).get(
                "kv_transfer_params") is not None:
            raise InvalidRequestError(
                "kv_transfer_params needs a server started with --kv-transfer-config",
                param="kv_transfer_params")
        self.siblings.add(request)
        request._seq_no = self._seq_counter
        self._seq_counter += 1
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_order_key)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Mark a request finished and release everything it holds. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.kv_transfer is None or not self.kv_transfer.hold(
                req, status, *self._held_rows(req)):
            self.block_manager.free(req)  # a held prefill's pages wait for their pull
            self.free_state_snapshot(req)
        req.in_batch = False
        self._swapped_pages.pop(request_id, None)
        self.siblings.drop(req)
        req.status = status
        self._finished_since_schedule.append(request_id)
        return req

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    # -- one step ---------------------------------------------------------------------------
    def _num_drafts(self, req: Request, n: int, budget: int) -> int:
        """Drafts verified with a decode of ``n`` tokens: only after a plain decode's one known
        token, within the budget, below max_model_len, and never more than max_tokens allows
        (every accepted draft is an output token, plus the one the target adds)."""
        if not req.spec_token_ids or n != 1 or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        nd = min(len(req.spec_token_ids), budget - 1, self.max_model_len - req.num_tokens)
        if req.max_tokens is not None:
            nd = min(nd, req.max_tokens - req.num_output_tokens - 1)
        return max(0, nd)

    def _image_run_cut(self, req: Request, start: int, n: int) -> int:
        """``n`` new tokens from ``start``, cut back so the chunk does not end inside an image's
        placeholder run (``whole_image_runs``); 0 when the run's remainder does not fit. A
        prefill for a remote decode with a recurrent state ends a chunk before its last prompt
        token: the state there is what the decode instance continues from."""
        if (self.kv_transfer is not None and self.block_manager.state_slots is not None
                and req.request_id in self.kv_transfer.remote_decode
                and start < req.num_prompt_tokens - 1 < start + n):
            n = req.num_prompt_tokens - 1 - start
        if not self.whole_image_runs or req.mm is None:
            return n
        end = start + n
        for im in req.mm.images:
            if im.offset < end < im.offset + im.num_tokens:
                return max(0, im.offset - start)
        return n

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        n = min(n, self.max_model_len - req.num_computed_tokens)
        return self.siblings.cap(req, min(n, budget))

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        # only the computed pages inside the window are copied (the rest are never read again)
        self.block_manager.release_out_of_window(victim)
        pages = self.block_manager.swap_pages(victim)  # per pool
        n_pages = max(len(p) for p in pages)
        swap = (
            self.preemption_mode == "swap"
            and n_pages > 0
            and self.swap_used_pages + n_pages <= self.swap_capacity_pages
        )
        if swap:
            out.swap_out.append((victim.request_id, pages))
            self._swapped_pages[victim.request_id] = n_pages
            if victim.state_slot >= 0:  # its slot is freed below; the state goes to host too
                out.swap_out_state.append((victim.request_id, victim.state_slot))
            victim.status = RequestStatus.SWAPPED
            self.num_swap_outs_total += 1
        else:
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        self.block_manager.free(victim)
        victim.in_batch = False  # its row is freed; it comes back as a new one
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(victim.request_id)
        bisect.insort(self.waiting, victim, key=_order_key)

    def _abort_unfittable(self, req: Request, out: SchedulerOutput) -> None:
        req.abort_reason = ABORT_KV_CACHE_EXHAUSTED
        self.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
        self.num_aborted_by_scheduler += 1
        out.finished_outputs.append(req.take_output())

    def _add_scheduled(self, out: SchedulerOutput, req: Request, n: int,
                       drafts: list[int] | None = None) -> None:
        start = req.num_computed_tokens
        nd = len(drafts) if drafts else 0
        ids = req.all_token_ids[start:start + n - nd]
        if nd:
            ids += drafts
        sample = start + n - nd == len(req.all_token_ids)
        out.scheduled.append(ScheduledRequest(req, n, start, sample, ids, nd))
        out.num_batched_tokens += n
        b = out.batch
        if not req.in_batch:  # a new row: everything the worker keeps of it, once
            pages = req.pages_per_group()
            b.new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                req.sampling_params, [list(p) for p in pages], req.lora_int_id,
                req.state_slot, req.mm, req.prompt_embeds))
            req.in_batch, req.sent_pages, req.pages_dirty = True, [len(p) for p in pages], False
        elif (req.pages_dirty or req.group_block_ids is not None
              or len(req.block_ids) != req.sent_pages[0]):
            ups, req.sent_pages = page_updates(req, req.sent_pages, req.pages_dirty)
            req.pages_dirty = False
            b.page_updates += ups
        # else: one pool, no page gained (a decode inside its last page): nothing to send
        if (start == req.num_prompt_tokens - 1 > 0 and self.kv_transfer is not None
                and req.request_id in self.kv_transfer.remote_decode):
            self._snapshot_state(out, req)
        self._cols.append((req.request_id, len(ids), start, sample, nd,
                           len(req.output_token_ids)))
        b.token_ids += ids
        if req.num_prompt_logprobs is not None:
            lo = max(start, req.num_prompt_logprobs - 1)  # a recomputed prefix is not redone
            hi = min(start + n, req.num_prompt_tokens - 1)
            if hi > lo:
                out.scheduled[-1].prompt_span = (lo, hi)
                b.prompt_spans[len(out.scheduled) - 1] = (lo, hi)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.time()

    def limit_tokens(self, token_limit: int | None) -> None:
        """Keep every step within ``token_limit`` tokens (None: the configured budget). The
        warm-up sets it to the largest compiled bucket while the others compile, so steps run
        on the graphs there are instead of waiting for a bigger one."""
        self.token_limit = token_limit

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget (and ``token_limit`` while it is set)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.token_limit is not None:
            budget = max(1, min(budget, self.token_limit))
        rows = self.max_num_seqs if self.max_seqs_per_step is None else self.max_seqs_per_step
        # the diff's row columns, one tuple a row while scheduling, then as columns
        self._cols = cols = []
        self._run_waits = False
        budget = self._schedule_running(out, budget, rows)
        # vLLM V1: no admissions in a step that had to preempt; nor while a running request
        # waits for the budget of a whole image run (new rows would keep taking it)
        if not out.preempted and not self._run_waits:
            self._schedule_waiting(out, budget, rows)
        b = out.batch
        if cols:
            (b.req_ids, b.num_tokens, b.start_pos, b.sample, b.num_draft,
             b.num_output) = map(list, zip(*cols))
        out.finished_req_ids = self._finished_since_schedule
        self._finished_since_schedule = []
        out.batch.removed = out.finished_req_ids + out.preempted
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, rows: int) -> int:
        """Running requests, in order (the preemption victim is always the last one): a
        decode or their next prefill chunk each. Returns the budget left."""
        bm = self.block_manager
        running, in_step, cols = self.running, out.scheduled, self._cols
        add_tok = out.batch.token_ids.append
        # a plain decode inside its last page (most rows of most steps): the general path
        # below would feed its one token, allocate nothing and send no pages; the same row is
        # added here without its calls
        bs, max_len, skip_pending = self.block_size, self.max_model_len, self.skip_pending
        inline = self.inline_plain_rows and bm.sliding_window is None
        no_slots = bm.state_slots is None
        num_plain = 0
        i = 0
        while i < len(running) and budget > 0 and len(in_step) < rows:
            req = running[i]
            if req.num_pending and (
                    skip_pending
                    # its last token is still on the device; the engine finishes it then
                    or (req.max_tokens is not None
                        and len(req.output_token_ids) >= req.max_tokens)
                    # its next token mask needs the token still on the device
                    # (req.needs_known_tokens)
                    or req.grammar is not None
                    or (req.token_filter is not None and req.token_filter.needs_history)
                    # speculation: the next drafts need every token known (how many a verify
                    # step accepted is only known once it is read): it runs synchronously
                    or req.use_spec):
                i += 1
                continue
            if req.spec_in_flight:  # a verify step not read yet (synchronous, as above)
                i += 1
                continue
            c = req.num_computed_tokens
            toks = req.all_token_ids
            # (a prompt's last token alone takes the general path: a remote decode's state)
            if (inline and len(toks) - c == 1 and c < max_len and req.in_batch
                    and c != req.num_prompt_tokens - 1
                    and c < len(req.block_ids) * bs and not req.spec_token_ids
                    and not req.pages_dirty and req.group_block_ids is None
                    and len(req.block_ids) == req.sent_pages[0]
                    and req.num_prompt_logprobs is None and (no_slots or req.state_slot >= 0)):
                tok = toks[c]
                in_step.append(ScheduledRequest(req, 1, c, True, [tok]))
                cols.append((req.request_id, 1, c, True, 0, len(req.output_token_ids)))
                add_tok(tok)
                num_plain += 1
                budget -= 1
                i += 1
                continue
            n = self._num_new_tokens(req, budget)
            if n <= 0:  # at max_model_len; a correct engine has stopped it at max_tokens
                self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
                out.finished_outputs.append(req.take_output())
                continue
            n = self._image_run_cut(req, c, n)
            if n == 0:  # the rest of an image's run waits for a step with the budget for it
                self._run_waits = True
                i += 1
                continue
            drafts = None
            if req.spec_token_ids:
                nd = self._num_drafts(req, n, budget)
                drafts = req.spec_token_ids[:nd]
                n += nd  # lookahead slots: pages for the drafts' K/V too
            scheduled = True
            while not bm.allocate_slots(req, n):
                victim = self.running[-1]
                if victim is req:
                    if i == 0:  # alone in the pool and still does not fit: never will
                        self._abort_unfittable(req, out)
                    else:  # higher-priority requests hold the pages: wait for them
                        self._preempt(req, out)
                    scheduled = False
                    break
                self._preempt(victim, out)
            if scheduled:
                self._add_scheduled(out, req, n, drafts)
                if drafts is not None:
                    req.spec_token_ids = []
                budget -= n
                i += 1
        out.num_batched_tokens += num_plain
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, rows: int) -> None:
        """Waiting requests (new, preempted, swapped) in order while budget, rows and pages
        last; a new one first takes its cached prefix."""
        bm = self.block_manager
        j = 0
        loras: set[int] | None = None  # the running adapters, read once a request has one
        while (j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.scheduled) < rows):
            req = self.waiting[j]
            if loras is None and req.lora_int_id:
                loras = self._running_loras()
            if self._lets_others_pass(req, loras):
                j += 1
                continue
            fork = self.siblings.fork_source(req)
            if fork is not None:
                req.num_computed_tokens = fork.num_computed_tokens
            if self.kv_transfer is not None and self.kv_transfer.wants_load(req):
                if not self._start_load(req):
                    break  # FCFS: nobody overtakes the head of the queue
                self.waiting.pop(j)
                continue
            resumed_swap = req.status == RequestStatus.SWAPPED
            hits: list[int] | None = None
            n_hit = n_host = 0
            host = None  # per pool, the host-tier slots continuing the device hits
            if not resumed_swap and req.num_computed_tokens == 0:
                hits, n_hit = ([], 0) if req.skip_prefix_cache else bm.get_computed_blocks(req)
                if self.kv_offload is not None and not req.skip_prefix_cache:
                    host = self.kv_offload.lookup(req, n_hit // self.block_size)
                    n_host = len(host[0]) * self.block_size
            n_hit += n_host  # host hits are computed once loaded (before the step)
            n = req.num_tokens - req.num_computed_tokens - n_hit
            n = self.siblings.cap(req, min(n, self.max_model_len - req.num_computed_tokens - n_hit))
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            n = self._image_run_cut(req, req.num_computed_tokens + n_hit, n)
            if n == 0:  # its next image's run does not fit this step's budget: wait for one
                if fork is not None:
                    req.num_computed_tokens = 0
                break
            if not bm.allocate_slots(req, n + n_host, hits):
                if fork is not None:
                    req.num_computed_tokens = 0
                if not self.running:  # nothing else holds pages: it can never fit
                    self.waiting.pop(j)
                    self._abort_unfittable(req, out)
                    continue
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.pop(j)
            if fork is not None:  # copy its first child's computed prompt, pages and state
                pages, states = self.siblings.fork(fork, req)
                out.fork_pages += pages
                out.fork_states += states
            elif resumed_swap:
                self._swapped_pages.pop(req.request_id)
                out.swap_in.append((req.request_id, bm.swap_pages(req)))
                if req.state_slot >= 0:  # a fresh slot: the saved state goes there
                    out.swap_in_state.append((req.request_id, req.state_slot))
            elif hits is not None:
                req.num_computed_tokens = n_hit
                if host is not None:
                    self._load_host_hits(req, (n_hit - n_host) // self.block_size, host, out)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = n_hit
            req.status = RequestStatus.RUNNING
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            bisect.insort(self.running, req, key=_order_key)
            self._add_scheduled(out, req, n)
            budget -= n

    def _snapshot_state(self, out: SchedulerOutput, req: Request) -> None:
        """A remote decode's prefill about to compute its last prompt token: its recurrent
        state so far copied into a slot of its own (before the step), which the decode
        instance pulls; it recomputes that token itself. No free slot: nothing is kept and
        the pull is refused."""
        slots = self.block_manager.state_slots
        if slots is None or req.state_slot < 0 or req.kv_state_snapshot >= 0 \
                or not slots.num_free:
            return
        req.kv_state_snapshot = slots.allocate(req.request_id + "#kv")
        out.fork_states.append((req.state_slot, req.kv_state_snapshot))

    def free_state_snapshot(self, req: Request) -> None:
        if req.kv_state_snapshot >= 0:
            self.block_manager.state_slots.free(req.kv_state_snapshot)
            req.kv_state_snapshot = -1

    def _held_rows(self, req: Request) -> tuple[list[list[int]], int]:
        """A finished request's pages per pool by position up to its computed tokens (0:
        released out of a window; a sliding pool keeps what its last step read), and the
        first full-attention pool's row."""
        end = -(-req.num_computed_tokens // self.block_size)
        managers = getattr(self.block_manager, "managers", [self.block_manager])
        full = next((g for g, m in enumerate(managers) if m.sliding_window is None), 0)
        return [list(p[:end]) for p in req.pages_per_group()], full

    def _start_load(self, req: Request) -> bool:
        """A decode whose prompt KV is remote: fresh pages for all but its last prompt token,
        then it waits beside the queue while the connector pulls them (False: no pages).
        Allocated as if those tokens were computed, so a sliding-window pool takes only the
        pages the last token's window reads."""
        n = req.num_prompt_tokens - 1
        req.num_computed_tokens = n
        if not self.block_manager.allocate_slots(req, 0, []):
            req.num_computed_tokens = 0
            return False
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.kv_transfer.start_load(req, req.pages_per_group(), n)
        return True

    def remote_kv_loaded(self, request_id: str) -> None:
        """The connector wrote a request's pulled pages: it is computed up to its last prompt
        token and queues again (its last token samples the first output token)."""
        load = self.kv_transfer.take_load(request_id)
        if load is None or self.requests.get(request_id) is not load.request:
            return
        req = load.request
        req.num_computed_tokens = load.num_tokens
        req.num_cached_tokens = load.num_tokens
        req.status = RequestStatus.WAITING
        self.kv_transfer.num_loaded_total += 1
        bisect.insort(self.waiting, req, key=_order_key)

    def remote_kv_failed(self, request_id: str, why: str) -> CoreOutput | None:
        """A pull failed or timed out: ``fail`` ends the request with the error (its pages
        freed); ``recompute`` computes its prompt here. Returns the output to report."""
        load = self.kv_transfer.take_load(request_id)
        if load is None or self.requests.get(request_id) is not load.request:
            return None
        req = load.request
        self.kv_transfer.num_load_failures_total += 1
        if self.kv_transfer.config.kv_load_failure_policy == "recompute":
            self.block_manager.free(req)  # taken again (with any prefix hit) when admitted
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            bisect.insort(self.waiting, req, key=_order_key)
            return None
        req.stop_reason = why
        self.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        return req.take_output()

    def _load_host_hits(self, req: Request, first_page: int, host: list[list[int]],
                        out: SchedulerOutput) -> None:
        """An admitted request's host-tier hits: copied into its fresh pages before the step."""
        if not host[0]:
            self.kv_offload.record_miss(req)
            return
        slots, pages = self.kv_offload.admit(req, first_page, host, req.pages_per_group())
        out.kv_loads.append((req.request_id, slots, pages))

    def _lets_others_pass(self, req: Request, loras: set[int] | None) -> bool:
        """A waiting request that is not admitted yet, without holding up the ones behind."""
        return bool(
            # preempted mid-verify, or (pipelined) its token still in flight: read it first
            req.spec_in_flight or (req.num_pending and self.skip_pending)
            or self.siblings.waits(req)  # an n > 1 sibling: once its first child's prompt is in
            or (req.grammar is not None and not req.grammar.ready)  # grammar still compiling
            or not self._lora_fits(req, loras))  # max_loras other adapters are running

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running if r.lora_int_id}

    def _lora_fits(self, req: Request, loras: set[int] | None) -> bool:
        """Whether ``req`` may run beside the adapters in ``loras`` (max_loras distinct; None
        only for a request without an adapter)."""
        lid = req.lora_int_id
        if not lid or lid in loras:
            return True
        return self.max_loras is not None and len(loras) < self.max_loras

    def update_after_dispatch(self, scheduler_output: SchedulerOutput,
                              sampled: dict[str, int] | None = None) -> list[Request]:
        """The step was dispatched: advance its requests and append the sampled token of every
        row that samples (``PLACEHOLDER`` when ``sampled`` is None, until ``update_from_output``
        reads the ids); register newly full pages in the prefix cache. Returns the requests
        that got a token (with ``sampled``: a host-only caller then checks their stops)."""
        got_token = []
        requests, bm, bs = self.requests, self.block_manager, self.block_size
        cached = bm.cached_page_counts if bm.enable_prefix_caching else None
        for s in scheduler_output.scheduled:
            req = s.request
            if requests.get(req.request_id) is not req or req.status in FINISHED_STATUSES:
                continue  # finished/aborted while the step ran
            if s.num_draft:
                # the drafts' K/V are written but count only once accepted (commit_verified)
                req.num_computed_tokens += s.num_new_tokens - s.num_draft
                if sampled is not None:
                    raise ValueError("a verify step's tokens are read through commit_verified")
                req.spec_in_flight = True
                bm.cache_full_blocks(req)
                continue
            req.num_computed_tokens += s.num_new_tokens
            if s.sample:
                if sampled is None:  # req.append_output_token(PLACEHOLDER), inline
                    req.num_pending += 1
                    req.output_token_ids.append(PLACEHOLDER)
                    req.all_token_ids.append(PLACEHOLDER)
                else:
                    tok = sampled.get(req.request_id)
                    if tok is None:
                        raise ValueError(f"no sampled token for request {req.request_id!r}")
                    req.append_output_token(tok)
                got_token.append(req)
            # cache_full_blocks, called only when a page filled (its own first test)
            if cached is not None and min(
                    req.num_computed_tokens, len(req.all_token_ids) - req.num_pending
            ) // bs > cached.get(req.request_id, 0):
                bm.cache_full_blocks(req)
        return got_token

    def update_from_output(self, scheduler_output: SchedulerOutput, out) -> list[CoreOutput]:
        """A dispatched step's ids reached the host (``out``: the runner's ``StepOutput``, numpy
        arrays, one row per scheduled request): resolve each row's placeholder or verified
        drafts, keep logprobs, stop what ends (``check_stop``) and report what each request
        gained (a ``final_only`` one: everything, once it finishes). Rows of requests finished
        or aborted since are dropped."""
        now = time.time()
        token_ids = out.token_ids.tolist()  # Python ints
        requests, bm, bs = self.requests, self.block_manager, self.block_size
        cached = bm.cached_page_counts if bm.enable_prefix_caching else None
        eos, max_len = self.eos_token_ids, self.max_model_len
        inline = self.inline_plain_rows
        outputs: list[CoreOutput] = []
        num_plain = 0  # plain rows: one id each
        t0 = 0  # the row's first token in the plan (rows are laid out in order)
        for i, s in enumerate(scheduler_output.scheduled):
            req, row_t0 = s.request, t0
            t0 += len(s.new_token_ids)
            if s.prompt_span is not None:
                req.record_prompt_logprobs(out.prompt_logprobs, row_t0, *s.prompt_span)
            if req.hidden_layers is not None and out.hidden_states is not None \
                    and req.status not in FINISHED_STATUSES:
                req.record_hidden_states(out.hidden_states, row_t0, s.start_pos,
                                         s.num_new_tokens - s.num_draft)
            if (not s.sample or req.status in FINISHED_STATUSES
                    or requests.get(req.request_id) is not req):
                continue  # no token, or stopped / aborted since: its token is dropped
            if req.pooling_params is not None:  # its prompt is computed: pooled, not sampled
                self._finish_pooled(req, out.final_hidden[i], now)
                outputs.append(req.take_output())
                continue
            if s.num_draft:
                self._accept_verified(req, s.num_draft, out, i, now)
                if not req.final_only or req.status in FINISHED_STATUSES:
                    outputs.append(req.take_output())
                continue
            tok = token_ids[i]
            pend = req.num_pending
            if (not pend or req.grammar is not None or req.new_logprobs is not None
                    or req.new_prompt_logprobs or not inline):
                req.resolve_pending(tok)
                bm.cache_full_blocks(req)
                self._on_token(req, tok, out, i, now)
                if not req.final_only or req.status in FINISHED_STATUSES:
                    outputs.append(req.take_output())
                continue
            # a plain row: resolve_pending, cache_full_blocks, _on_token and take_output, with
            # stop_status called only where one of its tests can hold
            ids, all_ids = req.output_token_ids, req.all_token_ids
            n_out = len(ids) - pend + 1  # known output ids, this one included
            n_known = len(all_ids) - pend + 1
            ids[n_out - 1] = tok
            all_ids[n_known - 1] = tok
            req.num_pending = pend - 1
            if cached is not None and (min(req.num_computed_tokens, n_known) // bs
                                       > cached.get(req.request_id, 0)):
                bm.cache_full_blocks(req)
            num_plain += 1
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if ((tok in eos or req.sampling_params.stop_token_ids or n_out >= req.max_tokens
                 or n_known >= max_len) and self.check_stop(req, tok)):
                m.finished_time = now
                outputs.append(req.take_output())
                continue
            if req.final_only:
                continue
            outputs.append(CoreOutput(req.request_id, ids[req.num_reported:n_out], None, None,
                                      req.stop_reason, None, m, req.num_cached_tokens))
            req.num_reported = n_out
        self.generation_tokens_total += num_plain
        return outputs

    def _accept_verified(self, req: Request, num_draft: int, out, row: int, now: float) -> None:
        """A verify row: accepted drafts + the target's token, each through the stop checks
        (a stop inside the run drops what follows it)."""
        n = int(out.num_emitted[row])
        if self.spec_stats is not None:
            self.spec_stats.observe(num_draft, n - 1)
        self.commit_verified(req, n - 1)
        for tok in out.spec_token_ids[row, :n].tolist():
            req.append_output_token(tok)
            self._on_token(req, tok, out, row, now)
            if req.is_finished:
                return
        self.block_manager.cache_full_blocks(req)

    def _on_token(self, req: Request, tok: int, out, row: int, now: float) -> None:
        """A known output id: its logprobs kept for the next report, then the stops on ids."""
        self.generation_tokens_total += 1
        m = req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        if req.new_logprobs is not None:
            req.new_logprobs.append(
                TokenLogprobs.of_row(tok, out, row, req.sampling_params.logprobs))
        if self.check_stop(req, tok):
            m.finished_time = now

    def _finish_pooled(self, req: Request, final_hidden, now: float) -> None:
        """A pooling request's prompt is computed: it ends with its last token's final hidden
        state (no output token); its full pages stay in the prefix cache."""
        req.pooled = final_hidden
        req.drop_pending()
        self.block_manager.cache_full_blocks(req)
        req.metrics.first_token_time = req.metrics.finished_time = now
        self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def check_stop(self, req: Request, token: int) -> bool:
        """``token`` became known as ``req``'s latest output id: finish the request (True) when
        it stops it (``stop_check.stop_status``). Ids sampled after it (still on the device)
        are dropped."""
        stop = stop_status(req, token, self.eos_token_ids, self.max_model_len)
        if stop is None:
            return False
        status, req.stop_reason = stop
        req.drop_pending()
        self.finish_request(req.request_id, status)
        return True

    def commit_verified(self, req: Request, num_accepted: int) -> None:
        """A verify step was read and kept ``num_accepted`` drafts: their K/V (already in their
        slots) become computed; rejected slots are simply overwritten later. A request
        preempted meanwhile recomputes them instead (its pages are gone, or were swapped out
        without them). The engine then appends the emitted tokens one by one with its stop
        checks, so nothing past a stop or max_tokens is kept."""
        req.spec_in_flight = False
        if req.status == RequestStatus.RUNNING:
            req.num_computed_tokens += num_accepted


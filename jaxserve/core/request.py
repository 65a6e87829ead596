"""One generation request as the scheduler sees it: tokens, progress, pages, status.

Host side only (no jax). vLLM V1 style: a request has ``num_computed_tokens`` (tokens whose
K/V are in its pages) and ``all_token_ids`` (prompt + output); the difference is what the
next step has to feed. Prefill, chunked prefill, decode and recompute after preemption are all
the same thing: feed ``all_token_ids[num_computed_tokens:]``.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Sequence

from jaxserve.core.outputs import CoreOutput, RequestMetrics, TokenLogprobs

PLACEHOLDER = -1  # an output id sampled on the device, not yet copied to the host


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: pages dropped, back in the waiting queue
    SWAPPED = "swapped"  # pages copied to host memory, back in the waiting queue
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"  # client abort, or it can never fit the KV pool
    FINISHED_ERROR = "finished_error"  # its remote KV never arrived (core.kv_transfer)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # pages taken, prompt KV being pulled

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM ``finish_reason`` string of a finished status."""
        return _FINISH_REASON[self] if self in _FINISHED else None


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
# a tuple: ``in`` compares members by identity (an enum member's hash is a Python call), and
# this is read for every request on every step
FINISHED_STATUSES = _FINISHED = tuple(_FINISH_REASON)


class Request:
    """A request's token state. ``sampling_params`` is opaque here (only ``max_tokens`` is read)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Any = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prefix_parent: str | None = None,
        lora_request: Any = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else float(arrival_time)
        self.priority = int(priority)
        self.cache_salt = cache_salt  # mixed into the first page's prefix-cache hash
        # the adapter it runs with (jaxserve.lora.LoRARequest; None: the base model): kept
        # through preemption and swap, part of its prefix-cache keys
        self.lora_request = lora_request
        # its images (core.mm_inputs.MultiModalInputs; None: text only), set by the engine
        self.mm: Any = None
        # n > 1: the id of the request (child 0) whose prompt this one repeats; the scheduler
        # admits it once that prompt is computed, so it takes the full prompt pages from the
        # prefix cache (copy-free)
        self.prefix_parent = prefix_parent
        # [n, hidden] float32 numpy: the prompt given as embeddings (prompt ids placeholders);
        # its digest is in cache_salt, so its pages are never shared with a token prompt
        self.prompt_embeds = None
        # a pooling request (core.pooling_params.PoolingParams) on the generative engine: its
        # prompt runs as a prefill and it ends with its last token's final hidden state
        self.pooling_params: Any = None
        self.pooled: Any = None
        # prompt_logprobs need every prompt position computed, so no prefix-cache reads (vLLM)
        # so do hidden states (return_hidden_states), of every prompt token
        self.hidden_layers = getattr(sampling_params, "return_hidden_states", None)
        self.skip_prefix_cache = (getattr(sampling_params, "prompt_logprobs", None) is not None
                                  or self.hidden_layers is not None)

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        # trailing output ids still on the device (async scheduling): PLACEHOLDER on the host
        self.num_pending = 0
        # speculative decoding: drafts proposed after the last known token (verified when next
        # scheduled), whether this request may speculate, and whether a verify step is unread
        self.spec_token_ids: list[int] = []
        self.use_spec = False
        self.spec_in_flight = False
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []  # KV pages owned, in position order
        # one page list per pool (block-table row) when there are several
        # (core.kv_cache_coordinator); block_ids is row 0's, the same list. None: one pool.
        self.group_block_ids: list[list[int]] | None = None
        self.state_slot = -1  # recurrent-state pool slot (LinearState layers); -1: none
        # a remote decode's prefill: the slot holding its state before its last prompt token
        self.kv_state_snapshot = -1
        # what the worker's persistent batch holds of it (core.batch_diff): whether it has a
        # row, each group's page-list length it knows, and whether entries it knows changed
        # in place since (a sliding window released pages)
        self.in_batch = False
        self.sent_pages: list[int] | None = None
        self.pages_dirty = False
        self.block_hashes: list[int] = []  # prefix-cache hash chain of full pages (lazy)
        self.num_cached_tokens = 0  # prefix-cache hit at first schedule
        self.num_preemptions = 0
        # structured outputs: the engine's grammar matcher (opaque here). The scheduler reads
        # ``grammar.ready``: a request whose grammar is still compiling waits without a slot,
        # and one with a pending token is not scheduled (its next mask needs that token).
        self.grammar: Any = None
        # allowed_token_ids / bad_words (engine.token_filter): a mask row per step
        self.token_filter: Any = None
        self.stop_reason: int | str | None = None  # stop token id / stop string, set by engine
        self.abort_reason: str | None = None  # why the scheduler aborted it, if it did
        # disaggregated prefill/decode (core.kv_transfer): the remote prefill this request
        # pulls before its first step, and the params a finished prefill hands a decode
        self.remote_prefill: Any = None
        self.kv_transfer_params: dict | None = None
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # what update_from_output has reported: output ids, and (when asked) the logprobs of
        # ids and prompt positions not reported yet; prompt positions recorded so far
        self.num_reported = 0
        # its front end wants only the finished output (offline, no stop strings to check on
        # text): update_from_output reports it once, when it finishes, with everything
        self.final_only = False
        self.new_logprobs: list | None = (
            [] if getattr(sampling_params, "logprobs", None) is not None else None)
        self.num_prompt_logprobs: int | None = 1 if self.skip_prefix_cache else None
        self.new_prompt_logprobs: list = []
        # return_hidden_states: positions whose hidden states are kept, and those not reported
        self.num_hidden = 0
        self.new_hidden_states: list = []
        self._seq_no = 0  # tie-breaker for equal (priority, arrival), set by the scheduler
        # Effective generation cap (the scheduler lowers it to fit max_model_len).
        mt = getattr(sampling_params, "max_tokens", None)
        self.max_tokens: int | None = None if mt is None else int(mt)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else int(self.lora_request.lora_int_id)

    # -- sizes ------------------------------------------------------------------------------
    @property
    def needs_known_tokens(self) -> bool:
        """Its next token mask depends on its last token: never scheduled with one pending."""
        return self.grammar is not None or bool(
            self.token_filter is not None and self.token_filter.needs_history)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # -- status -----------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def num_known_output_tokens(self) -> int:
        """Output ids the host has (the pending ones excluded)."""
        return len(self.output_token_ids) - self.num_pending

    def append_output_token(self, token_id: int) -> None:
        token_id = int(token_id)
        if token_id == PLACEHOLDER:
            self.num_pending += 1
        elif self.num_pending:
            raise ValueError("a known token cannot follow a pending one")
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def resolve_pending(self, token_id: int) -> None:
        """The oldest pending id arrived from the device."""
        if not self.num_pending:
            raise ValueError(f"request {self.request_id!r} has no pending token")
        k = len(self.output_token_ids) - self.num_pending
        self.output_token_ids[k] = int(token_id)
        self.all_token_ids[self.num_prompt_tokens + k] = int(token_id)
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget ids sampled after the request stopped (never shown, never counted)."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            del self.all_token_ids[-self.num_pending:]
            self.num_pending = 0

    def record_prompt_logprobs(self, arrays, t0: int, lo: int, hi: int) -> None:
        """Keep the logprobs of prompt tokens lo+1..hi, read at plan tokens t0.. of a step
        (``arrays``: the step's (logprob [T], top-k ids [T, K], top-k logprobs [T, K], rank [T]))."""
        tok_lp, top_ids, top_lp, ranks = arrays
        k = self.sampling_params.prompt_logprobs
        for j in range(lo, hi):
            t = t0 + (j - lo)
            self.new_prompt_logprobs.append(TokenLogprobs(
                self.prompt_token_ids[j + 1], float(tok_lp[t]), int(ranks[t]),
                top_ids[t, :k].tolist(), top_lp[t, :k].tolist()))
            self.num_prompt_logprobs += 1

    def record_hidden_states(self, captured, t0: int, start: int, n: int) -> None:
        """Keep the hidden states of positions ``start .. start+n-1``, read at plan tokens
        ``t0..`` of a step (``captured [T, K, H]``); positions kept before (a preempted
        request recomputes them) are skipped."""
        skip = self.num_hidden - start
        if skip >= n:
            return
        skip = max(skip, 0)
        k = len(self.hidden_layers)
        self.new_hidden_states.append(captured[t0 + skip:t0 + n, :k])
        self.num_hidden = start + n

    def take_output(self) -> CoreOutput:
        """What this request gained since its last report (known ids, their logprobs, prompt
        logprobs), and why it finished if it did."""
        known = self.num_known_output_tokens
        new, self.num_reported = self.output_token_ids[self.num_reported:known], known
        logprobs = self.new_logprobs
        if logprobs is not None:
            self.new_logprobs = []
        prompt_lps, self.new_prompt_logprobs = self.new_prompt_logprobs or None, []
        out = CoreOutput(self.request_id, new, logprobs, self.finish_reason, self.stop_reason,
                         prompt_lps, self.metrics, self.num_cached_tokens)
        if self.new_hidden_states:
            out.new_hidden_states, self.new_hidden_states = self.new_hidden_states, []
        out.pooled = self.pooled
        if self.kv_transfer_params is not None:
            out.kv_transfer_params = self.kv_transfer_params
        return out

    def pages_per_group(self) -> list[list[int]]:
        """The block-table rows of this request, one per paged cache group."""
        return self.group_block_ids if self.group_block_ids is not None else [self.block_ids]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens},"
            f" out={self.num_output_tokens}, computed={self.num_computed_tokens},"
            f" pages={len(self.block_ids)})"
        )


"""What one ``Scheduler.schedule()`` call decided: the rows of the step, the pages to swap
around it, and the requests it ended. Host side only (no jax)."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.batch_diff import BatchDiff
from jaxserve.core.outputs import CoreOutput
from jaxserve.core.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    start_pos: int  # num_computed_tokens before the step
    sample: bool  # the step completes the request's known tokens: its sampled token is kept
    new_token_ids: list[int]
    num_draft: int = 0  # speculative tokens at the end of new_token_ids (not yet the request's)
    # prompt logprobs: positions lo..hi-1 whose next prompt token gets its logprob this step
    prompt_span: tuple[int, int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class SchedulerOutput:
    # what the worker reads: its persistent batch's diff and the step's rows (no Request)
    batch: BatchDiff = field(default_factory=BatchDiff)
    # the scheduler's own record of the step's rows (live requests, for update_from_output
    # and the engine's host-side extras: grammars, adapters, drafts); never sent to a worker
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # preempted this step (both modes)
    # (request_id, page ids per pool): copy these pages device -> host BEFORE running the step
    # (the pages are already free and may be reused by this very step).
    swap_out: list[tuple[str, list[list[int]]]] = field(default_factory=list)
    # (request_id, page ids per pool): copy the host copy back into these pages BEFORE running
    # the step.
    swap_in: list[tuple[str, list[list[int]]]] = field(default_factory=list)
    # (request_id, state slot): the recurrent state of a swapped request, copied out of its old
    # slot / back into its new one, beside its pages (LinearState models)
    swap_out_state: list[tuple[str, int]] = field(default_factory=list)
    swap_in_state: list[tuple[str, int]] = field(default_factory=list)
    # (request_id, host slots per pool, page ids per pool): host-tier prefix hits copied into
    # the request's fresh pages BEFORE running the step (core.kv_offload)
    kv_loads: list[tuple[str, list[list[int]], list[list[int]]]] = field(default_factory=list)
    # n > 1 siblings forked from their first child (state-pool models): (source, destination)
    # pages and state slots, copied on the device BEFORE running the step
    fork_pages: list[tuple[int, int]] = field(default_factory=list)
    fork_states: list[tuple[int, int]] = field(default_factory=list)
    # requests the scheduler itself ended while scheduling (aborted: they can never fit),
    # reported at once
    finished_outputs: list[CoreOutput] = field(default_factory=list)
    # every request finished since the previous schedule() (engine stops, aborts, and the
    # above): the runner drops per-request state (host swap copies, sampler state).
    finished_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

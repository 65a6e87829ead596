"""The pipelined engine core: up to P step plans in flight, one per pipeline stage.

With P stages a single step in flight leaves P-1 stages idle (the bubble). The core keeps a
queue of up to ``depth`` dispatched steps (vLLM's batch queue of micro-batches) and reads the
oldest only once the queue is full or nothing new could be scheduled:

    step:   schedule -> dispatch (queue it) -> queue full? read the oldest

Each step is a micro-batch of different requests: the scheduler skips a request whose sampled
token is still in flight (``Scheduler.skip_pending``), so no plan waits on another plan's ids
and stage 0 runs step N+1 while stage 1 runs step N (``jaxserve.worker.pipeline``); and a step
takes at most ``max_num_seqs / depth`` rows (``Scheduler.max_seqs_per_step``), so requests that
arrived together still spread over the micro-batches rather than decode as one. Prefill
chunks of one request may be in flight together: each stage runs the plans in order, so a chunk
always finds the previous chunk's K/V written.
"""
from __future__ import annotations

import collections

from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.core.outputs import CoreOutput


class PipelinedEngine(LLMEngine):
    """``LLMEngine`` whose core keeps up to ``depth`` steps in flight (``depth`` = stages with
    async scheduling, 1 without)."""

    def __init__(self, *args, depth: int, **kwargs):
        self._queue: collections.deque = collections.deque()
        super().__init__(*args, **kwargs)
        self.depth = depth if self.async_scheduling else 1
        self.scheduler.skip_pending = True
        # the running requests (at most max_num_seqs) spread over `depth` micro-batches
        self.scheduler.max_seqs_per_step = -(-self.scheduler.max_num_seqs // self.depth)
        self.max_in_flight = 0  # the most steps ever in flight (a test reads it)

    # The base class's single step in flight is the newest queued one; clearing it (nobody
    # waits for what is in flight) clears the queue.
    @property
    def _inflight(self):
        return self._queue[-1] if self._queue else None

    @_inflight.setter
    def _inflight(self, value) -> None:
        self._queue.clear()
        if value is not None:
            self._queue.append(value)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def core_step(self) -> list[CoreOutput]:
        outputs = self._weight_step()  # aborted by an update; a waiting swap once idle
        sched = self.scheduler.schedule()
        step = self._execute(sched)
        if step is not None:
            self._queue.append(step)
            self.max_in_flight = max(self.max_in_flight, len(self._queue))
        if self._queue and (len(self._queue) >= self.depth or step is None):
            outputs += self._update(self._queue.popleft())
        return self._end_step(sched, outputs)

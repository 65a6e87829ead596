"""``n > 1`` in the front end (vLLM's ``parallel_sampling``): one request becomes ``n``
independent core requests, and their outputs become one ``RequestOutput`` again.

The engine core only ever sees requests of one sequence. Child ``i`` samples with seed
``seed + i`` (mod 2**64); child ``i > 0`` names child 0 in ``prefix_parent``, so with prefix
caching the scheduler admits it once child 0's prompt is computed and it takes those pages
from the prefix cache instead of recomputing them; it leaves prompt logprobs to child 0, so
they are computed and reported once. The output processor (engine/output_processor.py) keeps
one state per parent and merges the children's ids, finish reasons and metrics into it.

Core request ids are made here, never taken from a caller: ``"{k}:{request_id}#{i}"`` with
``k`` unique in this process, so no caller id can name another request's child.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from jaxserve.core.outputs import RequestMetrics
from jaxserve.core.sampling_params import MAX_SEED, SamplingParams

_keys = itertools.count()  # next() is atomic under the GIL: unique across threads


@dataclass(frozen=True)
class ChildRequest:
    """One core request of a front-end request."""

    request_id: str  # the core's id
    index: int  # its CompletionOutput index
    params: SamplingParams  # n = 1
    prefix_parent: str | None  # the core request whose prompt pages it shares (child 0)


class ParentRequest:
    """A front-end request and the core requests it fans out into."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id = request_id
        self.params = params
        key = next(_keys)
        ids = [f"{key}:{request_id}#{i}" for i in range(params.n)]
        self.children = [ChildRequest(rid, i, child_params(params, i),
                                      ids[0] if i else None) for i, rid in enumerate(ids)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling params of choice ``index``: one sequence, its own seed; prompt logprobs
    only on choice 0."""
    if params.n == 1:
        return params
    p = params.clone()
    p.n = 1
    if params.seed is not None:
        p.seed = child_seed(params.seed, index)
    if index:
        p.prompt_logprobs = None
    return p


def child_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of an ``n > 1`` request (vLLM's ``seed + index``), kept in
    the sampler's 64-bit range: distinct for distinct indices of one parent."""
    return (seed + index) % (MAX_SEED + 1)


def merge_metrics(per_child: list[RequestMetrics | None]) -> RequestMetrics | None:
    """The parent's timeline: the first child's arrival, scheduling and first token, the last
    child's last token, and finished when every child has."""
    ms = [m for m in per_child if m is not None]
    if not ms:
        return None
    if len(per_child) == 1:
        return ms[0]

    def first(name):
        vals = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return min(vals) if vals else None

    done = len(ms) == len(per_child) and all(m.finished_time is not None for m in ms)
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        first_scheduled_time=first("first_scheduled_time"),
        first_token_time=first("first_token_time"),
        last_token_time=max((m.last_token_time for m in ms if m.last_token_time is not None),
                            default=None),
        finished_time=max(m.finished_time for m in ms) if done else None,
        num_preemptions=sum(m.num_preemptions for m in ms))

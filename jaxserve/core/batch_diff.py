"""What the worker hears of one ``Scheduler.schedule()``: a diff of its persistent batch.

Host side only (no jax); msgspec structs, so a step's diff encodes as it is (multi-host,
pipeline stages). A request enters the batch once, with all it needs (``NewRequestData``: its
known token ids, sampling parameters, adapter, pages and state slot); afterwards a step names
it by id with its new token count and only the pages it gained (``PageUpdate``). A request
leaves on finish or preemption (``removed``) and comes back, when resumed, as new. The rows of
one step are the column lists of ``BatchDiff`` in schedule order.
"""
from __future__ import annotations

import msgspec

from jaxserve.core.mm_inputs import MultiModalInputs
from jaxserve.core.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request entering the batch (first schedule, or resumed after a preemption)."""

    req_id: str
    token_ids: list[int]  # prompt then the known output ids (PLACEHOLDER: still on device)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # its pages, one list per paged cache group
    lora_int_id: int = 0  # 0: the base model
    state_slot: int = -1  # its recurrent-state pool slot; -1: none
    mm: MultiModalInputs | None = None  # its images (vision-language models)
    # [num_prompt_tokens, hidden] float32 numpy: its prompt as embeddings (its prompt ids are
    # placeholders); in-process only (a numpy array does not cross hosts)
    prompt_embeds: object = None


class PageUpdate(msgspec.Struct, array_like=True, gc=False):
    """Pages of group ``group`` from entry ``start`` on (``start`` 0: the whole list, which
    replaces the row's; else appended after the ``start`` entries the worker has)."""

    req_id: str
    group: int
    start: int
    block_ids: list[int]


class BatchDiff(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    removed: list[str] = []  # finished or preempted since the previous diff: rows freed first
    new_reqs: list[NewRequestData] = []
    page_updates: list[PageUpdate] = []
    # -- the step's rows, in order (one entry per scheduled request)
    req_ids: list[str] = []
    num_tokens: list[int] = []  # new ids of each row
    token_ids: list[int] = []  # every row's new ids, in row order (PLACEHOLDER: pending;
    #                            a row's drafts at its end)
    start_pos: list[int] = []  # num_computed_tokens before the step
    sample: list[bool] = []  # the row's sampled token is kept
    num_draft: list[int] = []  # speculative tokens at the end of token_ids
    num_output: list[int] = []  # output ids so far (incl. pending): key step, min_tokens
    prompt_spans: dict[int, tuple[int, int]] = {}  # row -> (lo, hi) prompt logprob positions

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)


def page_updates(req, sent: list[int] | None, dirty: bool) -> tuple[list[PageUpdate], list[int]]:
    """The pages ``req`` gained since the worker last heard (``sent``: each group's list
    length then; ``dirty``: entries changed in place, e.g. a sliding window released pages),
    and the lengths it knows after them."""
    lists = req.pages_per_group()
    out = []
    for g, pages in enumerate(lists):
        start = 0 if dirty or sent is None else sent[g]
        if dirty or len(pages) > start:
            out.append(PageUpdate(req.request_id, g, start, pages[start:]))
    return out, [len(p) for p in lists]

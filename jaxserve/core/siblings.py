"""The children of an ``n > 1`` request, as the scheduler sees them: independent requests, the
later ones naming the first in ``prefix_parent`` (engine/parallel_sampling.py). Host only.

Two ways to not recompute the shared prompt:
- prefix caching: a sibling waits until the first child's prompt is computed, then takes its
  full pages from the prefix cache (copy-free);
- ``fork_prompts`` (state-pool models, which have no prefix cache): the first child computes
  its prompt but the last token and stops there while siblings wait; each sibling then gets
  its own pages and state slot, the scheduler asks the engine to copy the first child's pages
  and state into them (``SchedulerOutput.fork_pages`` / ``fork_states``, before the step), and
  the sibling computes the last prompt token itself, so it samples its own first token.

A sibling whose chance passed (its first child ended, ran past the fork point, or either was
preempted) computes its own prompt, as with neither.
"""
from __future__ import annotations

from jaxserve.core.block_manager import BlockManager, cdiv
from jaxserve.core.request import Request, RequestStatus


class Siblings:
    def __init__(self, requests: dict[str, Request], block_manager: BlockManager):
        self.requests = requests  # the scheduler's live requests, by id
        self.block_manager = block_manager
        self.fork_prompts = False  # set by the engine where its runner can copy pages and slots
        self._waiting: dict[str, int] = {}  # first child id -> siblings still waiting to fork

    def add(self, req: Request) -> None:
        if self.fork_prompts and req.prefix_parent is not None:
            self._waiting[req.prefix_parent] = self._waiting.get(req.prefix_parent, 0) + 1

    def drop(self, req: Request) -> None:
        """``req`` no longer waits for its first child."""
        pp, req.prefix_parent = req.prefix_parent, None
        if pp in self._waiting:
            self._waiting[pp] -= 1
            if not self._waiting[pp]:
                del self._waiting[pp]

    def _parent(self, req: Request) -> Request | None:
        if req.prefix_parent is None or req.num_preemptions:
            return None
        return self.requests.get(req.prefix_parent)

    def waits(self, req: Request) -> bool:
        """Whether the waiting ``req`` must let others pass for now."""
        p = self._parent(req)
        if p is not None:
            if self.block_manager.enable_prefix_caching:
                if p.num_computed_tokens < p.num_prompt_tokens:
                    return True
            elif self.fork_prompts and p.num_computed_tokens <= p.num_prompt_tokens - 1:
                return (p.num_computed_tokens < p.num_prompt_tokens - 1
                        or p.status != RequestStatus.RUNNING)
        self.drop(req)  # the gate is open for good
        return False

    def cap(self, req: Request, n: int) -> int:
        """``n`` new tokens for ``req``, stopped one short of its prompt's end while siblings
        wait to fork from it."""
        stop = req.num_prompt_tokens - 1
        if self._waiting.get(req.request_id) and req.num_computed_tokens < stop:
            return min(n, stop - req.num_computed_tokens)
        return n

    def fork_source(self, req: Request) -> Request | None:
        """The first child ``req`` forks from if admitted now (None: it computes its prompt)."""
        p = self._parent(req)
        if (p is None or not self.fork_prompts or p.status != RequestStatus.RUNNING
                or p.num_computed_tokens != p.num_prompt_tokens - 1 or p.state_slot < 0
                or p.group_block_ids is not None):
            return None
        return p

    def fork(self, parent: Request, req: Request) -> tuple[list, list]:
        """``req`` was admitted with ``parent``'s progress: the (source, destination) pages
        and state slots to copy."""
        k = cdiv(parent.num_computed_tokens, self.block_manager.block_size)
        pages = list(zip(parent.block_ids[:k], req.block_ids[:k]))
        states = [(parent.state_slot, req.state_slot)] if k else []
        req.num_cached_tokens = parent.num_computed_tokens  # reused, as a prefix-cache hit is
        self.drop(req)
        return pages, states

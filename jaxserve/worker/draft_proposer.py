"""The ``draft_model`` proposer: a smaller model with the target's tokenizer drafts greedily.

The draft has its own KV pool with the target's page ids: page ``p`` of a request holds the
target's K/V in one pool and the draft's in the other, so the one block manager accounts for
both (the target's pool is sized with the draft's bytes per page added). Each proposal first
feeds the draft every token it has not seen (the catch-up, chunked to the token budget: the
whole prompt the first time, then the tokens the last verify step accepted), then runs
``k - 1`` single-token steps on its own argmax. The drafts are deterministic, so the verifier
treats them as point masses (``draft_probs=None``), which keeps rejection sampling exact.

Only K/V of known tokens is counted as the draft's: the K/V it wrote for its own guesses is
overwritten by the next catch-up. A preempted request (its pages dropped or swapped without the
draft's half) starts the draft over.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.core.batch_diff import BatchDiff, NewRequestData
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.worker.input_batch import InputBatch

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, runner, block_manager, num_speculative_tokens: int):
        self.runner = runner  # a ModelRunner of the draft model on the target's page ids
        self.bm = block_manager
        self.k = int(num_speculative_tokens)
        self.budget = runner.ladder[-1]
        # request id -> (request, its preemption count, tokens whose draft K/V is written)
        self._seen: dict[str, tuple[Request, int, int]] = {}
        # the draft's steps are built as the target's: rows of a batch, one diff a step (the
        # rows change from step to step here, so each step's requests come in as new rows)
        self.batch = InputBatch.for_runner(runner)

    @staticmethod
    def load_model(spec, config, attention_backend: str, target_vocab: int, mesh=None):
        """The draft's weights and config, before the target's pool is sized. ``mesh``: a
        one-device mesh to place it on (a pipeline's last stage); default: the default device."""
        from jaxserve.loaders.model_loader import load_model

        model, mc, _ = load_model(spec.model, dtype=config.dtype, load_format="auto",
                                  attention_backend=attention_backend, mesh=mesh)
        if mc.vocab_size != target_vocab:
            raise ValueError(f"speculative_config.model has a vocabulary of {mc.vocab_size},"
                             f" the target's is {target_vocab}: they must share a tokenizer")
        return model, mc

    @classmethod
    def build(cls, spec, config, model, mc, target_runner, block_manager, max_model_len,
              dtype, mesh=None) -> "DraftModelProposer":
        from jaxserve.worker.runner import ModelRunner

        cfg = dataclasses.replace(
            config, speculative=None,
            cache=dataclasses.replace(config.cache,
                                      num_gpu_blocks_override=target_runner.num_pages))
        runner = ModelRunner(model, mc, cfg, max_model_len, dtype, mesh=mesh)
        runner.warmup()
        return cls(runner, block_manager, spec.num_speculative_tokens)

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def _run(self, rows: list[tuple[Request, list[int], int]]) -> list[int]:
        """One greedy step of the draft over ``rows`` (request, new ids, first position);
        each row's sampled id."""
        b = self.batch
        b.apply(BatchDiff(removed=list(b.row_of), new_reqs=[
            NewRequestData(req.request_id, [], 0, _GREEDY, [list(req.block_ids)])
            for req, _, _ in rows]))
        n = len(rows)
        plan = b.prepare_inputs(BatchDiff(
            req_ids=[req.request_id for req, _, _ in rows],
            num_tokens=[len(ids) for _, ids, _ in rows],
            token_ids=[int(t) for _, ids, _ in rows for t in ids],
            start_pos=[start for _, _, start in rows], sample=[True] * n,
            num_draft=[0] * n, num_output=[0] * n), ladder=self.runner.ladder)
        return self.runner.execute(plan).token_ids[:n].tolist()

    def propose(self, requests: Sequence[Request], max_len: Sequence[int]) -> list[list[int]]:
        for rid in [r for r, (req, _, _) in self._seen.items() if req.is_finished]:
            del self._seen[rid]
        drafts: list[list[int]] = [[] for _ in requests]
        live = []  # (index, request, drafts wanted, first unseen position)
        for i, (req, m) in enumerate(zip(requests, max_len)):
            nk = min(self.k, int(m))
            if nk <= 0 or req.status != RequestStatus.RUNNING or req.num_pending:
                continue
            _, pre, seen = self._seen.get(req.request_id, (req, req.num_preemptions, 0))
            if pre != req.num_preemptions:
                seen = 0
            # pages for every position the draft writes: up to L - 1 + (nk - 1)
            if not self.bm.allocate_slots(req, req.num_tokens + nk - 1 - req.num_computed_tokens):
                continue  # no room: no drafts this time
            live.append((i, req, nk, seen))
        if not live:
            return drafts

        # catch-up: every unseen known token, in steps within the budget and max_num_seqs
        pos = {i: seen for i, _, _, seen in live}
        while True:
            rows, who, budget = [], [], self.budget
            for i, req, _, _ in live:
                left = req.num_tokens - pos[i]
                if left <= 0 or budget <= 0 or len(rows) == self.runner.max_num_seqs:
                    continue
                n = min(left, budget)
                rows.append((req, req.all_token_ids[pos[i]:pos[i] + n], pos[i]))
                who.append((i, n == left))
                pos[i] += n
                budget -= n
            if not rows:
                break
            for (i, done), tok in zip(who, self._run(rows)):
                if done:
                    drafts[i].append(tok)
        for i, req, _, _ in live:
            self._seen[req.request_id] = (req, req.num_preemptions, req.num_tokens)

        # k - 1 more greedy steps, each a single-token row per request still drafting
        for j in range(1, self.k):
            step = [(i, req) for i, req, nk, _ in live if nk > j]
            if not step:
                break
            for s in range(0, len(step), self.runner.max_num_seqs):
                part = step[s:s + self.runner.max_num_seqs]
                rows = [(req, [drafts[i][-1]], req.num_tokens - 1 + j) for i, req in part]
                for (i, _), tok in zip(part, self._run(rows)):
                    drafts[i].append(tok)
        return drafts

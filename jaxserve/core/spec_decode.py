"""Speculative decoding, host side (numpy, no jax): proposers and their counters (the verify
arrays of a step are built with the plan, ``core.step_plan.verify_arrays``).

A proposer guesses the next few tokens of a request; the target model scores them all in one
multi-token row of the next step (positions ``L-1 .. L-1+k`` where ``L`` is the request's
length), and the device keeps the longest prefix the target agrees with plus one token of its
own (``jaxserve.worker.rejection_sampler``). Proposers sit behind ``Proposer``, so a draft model
or EAGLE heads replace the n-gram lookup without touching the scheduler or the step.

Which requests speculate: those whose sampling the verifier reproduces exactly at every
position (no penalties, no ``min_tokens``, no logprobs) and that did not opt out
(``SamplingParams.disable_speculative_decoding``); the rest decode one token a step.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np


class Proposer(Protocol):
    """Proposes up to ``max_len[i]`` next tokens for each request (all of whose tokens are
    known). A proposer with state on the device (a draft model's K/V) keys it on the request
    and its pages; a deterministic proposal (the draft's argmax, a lookup) needs no draft
    probabilities for exact rejection sampling."""

    def propose(self, requests: Sequence[Any], max_len: Sequence[int]) -> list[list[int]]: ...


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram``): find the request's last ``n`` tokens earlier in its own
    prompt + output, longest ``n`` in ``[min_n, max_n]`` first and the most recent occurrence
    of it, and propose the tokens that followed it there."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = int(num_speculative_tokens)
        self.min_n = int(prompt_lookup_min)
        self.max_n = int(prompt_lookup_max)

    def propose_one(self, tokens: np.ndarray, max_len: int | None = None) -> np.ndarray:
        k = self.k if max_len is None else min(self.k, int(max_len))
        tokens = np.asarray(tokens, dtype=np.int64)
        L = tokens.shape[0]
        if k <= 0 or L < self.min_n + 1:
            return tokens[:0]
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself: tokens[s : s + n], s <= L - n - 1
            win = np.lib.stride_tricks.sliding_window_view(tokens[:L - 1], n)
            hits = np.flatnonzero(np.all(win == tokens[L - n:], axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k]
        return tokens[:0]

    def propose(self, requests: Sequence[Any], max_len: Sequence[int]) -> list[list[int]]:
        return [self.propose_one(np.asarray(r.all_token_ids), m).tolist()
                for r, m in zip(requests, max_len)]


class MtpProposer:
    """Method ``mtp``: the drafts the model's multi-token-prediction head made on the device
    in the step just read (``StepOutput.draft_ids``, see ``jaxserve.worker.step_functions.mtp_fn``),
    handed out per request. A speculating request runs synchronously, so the step just read is
    always its latest and its row's drafts follow its last token.

    ``override``: a test hook ``(request, drafts) -> drafts`` that replaces what is proposed
    (e.g. always-wrong drafts, to exercise the rollback of the recurrent state)."""

    def __init__(self, num_speculative_tokens: int):
        self.k = int(num_speculative_tokens)
        self.override = None
        self._drafts: dict[str, np.ndarray] = {}

    def observe(self, scheduled: Sequence[Any], out: Any) -> None:
        """Keep the drafts of the step's sampling rows (``scheduled[i]`` is row ``i``)."""
        if out.draft_ids is None:
            return
        for i, s in enumerate(scheduled):
            if s.sample:
                self._drafts[s.request.request_id] = out.draft_ids[i]

    def propose(self, requests: Sequence[Any], max_len: Sequence[int]) -> list[list[int]]:
        out = []
        for r, m in zip(requests, max_len):
            d = self._drafts.get(r.request_id)
            d = [] if d is None else d[:min(self.k, int(m))].tolist()
            if self.override is not None and d:
                d = list(self.override(r, d))
            out.append(d)
        self._drafts.clear()
        return out


def can_speculate(params: Any) -> bool:
    """The request did not opt out, and the verifier reproduces its sampling at every drafted
    position: no history-dependent logits (penalties, min_tokens), no token mask and no
    per-token logprobs to report."""
    if params is None:
        return True
    return not (getattr(params, "disable_speculative_decoding", False)
                or params.uses_penalties or params.min_tokens or params.logprobs is not None
                or getattr(params, "prompt_logprobs", None) is not None
                # a token mask (grammar, allowed_token_ids, bad_words) holds at the sampled
                # position only; drafted positions would go unmasked
                or getattr(params, "structured_outputs", None) is not None
                or getattr(params, "allowed_token_ids", None) is not None
                or bool(getattr(params, "bad_words", None)))


class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts, drafted tokens, accepted tokens (per position)."""

    def __init__(self, k: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step (1 + accepted drafts on average), vLLM's log line figure."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return dict(spec_decode_num_drafts=self.num_drafts,
                    spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(self.accepted_per_pos),
                    spec_decode_mean_acceptance_length=self.mean_acceptance_length)

"""Request outputs shaped like vLLM's (RequestOutput / CompletionOutput / Logprob)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled token plus the top-k asked for).
PositionLogprobs = dict


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Cumulative: text and token_ids hold everything generated so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # return_hidden_states: [tokens, layers, hidden] float32 numpy, for the prompt then every
    # generated token but the last (the tokens the model read), layers in the order asked
    hidden_states: object = None
    # a prefill run for a remote decode (kv_transfer_params do_remote_decode): what the
    # decode request passes on to pull this prompt's KV (vLLM's field)
    kv_transfer_params: dict | None = None


# ---- what the engine core reports: token ids and floats, never text ------------------------
@dataclass
class TokenLogprobs:
    """One position's logprobs as the core knows them; the output processor adds the text."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_ids: list[int] = field(default_factory=list)  # the top-k asked for, best first
    top_logprobs: list[float] = field(default_factory=list)

    @classmethod
    def of_row(cls, tok: int, out, row: int, k: int | None) -> "TokenLogprobs":
        """The logprobs of id ``tok`` sampled in ``row`` of a step's output (the runner's
        ``StepOutput``): its own, its rank and the top ``k``."""
        tl = cls(tok, float(out.logprobs[row]),
                 int(out.ranks[row]) if out.ranks is not None else None)
        if k and out.topk_ids is not None:
            tl.top_ids = out.topk_ids[row, :k].tolist()
            tl.top_logprobs = out.topk_logprobs[row, :k].tolist()
        return tl


@dataclass
class CoreOutput:
    """One core request's news from a step: the ids it gained and, when the core ended it, why.
    The front end merges the outputs of an ``n > 1`` request's children into one
    ``RequestOutput`` (engine/parallel_sampling.py)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new id when logprobs were asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # return_hidden_states: [n, K, H] float32 arrays of the positions computed since (offline
    # and in-process engines only: the core process's wire format carries ids and floats)
    new_hidden_states: list | None = None
    # a pooling request on the generative engine: [H] float32, the final (normed) hidden state
    # of its prompt's last token (LAST pooling), once, with its finish
    pooled: Any = None
    # a finished prefill for a remote decode: the params that decode needs (core.kv_transfer)
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

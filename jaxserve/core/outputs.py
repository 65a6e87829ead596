"""Request outputs shaped like vLLM's (RequestOutput / CompletionOutput / Logprob)."""
from __future__ import annotations

from dataclasses import dataclass, field


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


# ---- what the engine core reports: token ids and floats, never text ------------------------
@dataclass
class TokenLogprobs:
    """One position's logprobs as the core knows them; the output processor adds the text."""

    token_id: int
    logprob: float
    rank: int | None = None
    top_ids: list[int] = field(default_factory=list)  # the top-k asked for, best first
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class CoreCompletion:
    """One sequence's news from a step: the ids it gained and, when the core ended it, why."""

    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one per new id when logprobs were asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class CoreOutput:
    """One request's news from a step (every sequence it touched); the API process turns it
    into a cumulative ``RequestOutput``."""

    request_id: str
    completions: list[CoreCompletion]
    finished: bool = False
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0

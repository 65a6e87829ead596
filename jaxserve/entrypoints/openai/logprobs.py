"""Logprobs in the OpenAI shapes: the legacy completion form, the chat form, prompt logprobs."""
from __future__ import annotations

import math


from jaxserve.entrypoints.openai import protocol as P
from jaxserve.entrypoints.openai import protocol_chat as PC
from jaxserve.core.outputs import RequestOutput


LOGPROB_FLOOR = -9999.0  # -inf (masked tokens) is not JSON; vLLM clamps the same way


def clamp_logprob(x: float | None) -> float | None:
    if x is None:
        return None
    return x if math.isfinite(x) else LOGPROB_FLOOR


class Tokens:
    """Token-string helpers over the HF tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def text(self, tid: int) -> str:
        return self.tok.decode([tid])

    def entry_text(self, tid: int, lp) -> str:
        return lp.decoded_token if getattr(lp, "decoded_token", None) is not None else self.text(tid)


def prompt_logprobs(tokens: Tokens, out: RequestOutput | None) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` field: per prompt position None (the first token has no
    logprob) or ``{token id: {logprob, rank, decoded_token}}``, the prompt's own token included."""
    if out is None or out.prompt_logprobs is None:
        return None
    result: P.PromptLogprobs = []
    for pos in out.prompt_logprobs:
        if pos is None:
            result.append(None)
            continue
        result.append({str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                  "decoded_token": tokens.entry_text(tid, lp)}
                       for tid, lp in pos.items()})
    return result


def legacy_logprobs(tokens: Tokens, token_ids: list[int], positions: list, start_offset: int
                     ) -> P.CompletionLogProbs:
    """The completions format: parallel lists of tokens, their logprobs, top-k dicts, offsets."""
    out = P.CompletionLogProbs()
    offset = start_offset
    for tid, pos in zip(token_ids, positions):
        lp = pos.get(tid) if pos else None
        s = tokens.entry_text(tid, lp) if lp is not None else tokens.text(tid)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp_logprob(lp.logprob))
        ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        out.top_logprobs.append({tokens.entry_text(t, e): clamp_logprob(e.logprob) for t, e in ranked})
    return out


def chat_logprobs(tokens: Tokens, token_ids: list[int], positions: list, k: int
                   ) -> list[PC.ChatCompletionLogProbsContent]:
    """The chat format: one entry per generated token with its top-k alternatives."""
    content = []
    for tid, pos in zip(token_ids, positions):
        lp = (pos or {}).get(tid)
        s = tokens.entry_text(tid, lp) if lp is not None else tokens.text(tid)
        ranked = sorted((pos or {}).items(),
                        key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))
        top = [PC.ChatCompletionLogProb(token=tokens.entry_text(t, e),
                                       logprob=clamp_logprob(e.logprob),
                                       bytes=list(tokens.entry_text(t, e).encode()))
               for t, e in ranked[:k]]
        content.append(PC.ChatCompletionLogProbsContent(
            token=s, logprob=clamp_logprob(lp.logprob) if lp is not None else LOGPROB_FLOOR,
            bytes=list(s.encode()), top_logprobs=top))
    return content



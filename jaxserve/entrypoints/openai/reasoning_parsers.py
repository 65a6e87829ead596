"""Reasoning output, vLLM's ``--reasoning-parser`` names: ``qwen3`` and ``deepseek_r1`` split a
``<think>...</think>`` block off the answer into ``reasoning_content``; ``gemma4`` splits Gemma
4's thought channel, ``<|channel>thought\n...<channel|>`` (special tokens, kept in the text for
requests it parses: ``special_markers``).

The two differ when the end tag never comes: Qwen3 opens ``<think>`` itself (and may skip it
when thinking is off), so text without a ``<think>`` is plain content; DeepSeek-R1's template
already opened the block, so everything until ``</think>`` is reasoning, even without a start
tag. ``split_streaming`` gives the part of a growing text that is safe to show, holding back
what could still be the start of a tag.
"""
from __future__ import annotations

def _held(text: str, tag: str) -> int:
    """Length of ``text`` not possibly the beginning of ``tag`` at its end."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ReasoningParser:
    name = ""
    start, end = "<think>", "</think>"
    implicit_start = False  # the block is open before the first generated token
    special_markers = False  # the tags are special tokens: keep them in the text

    def split_streaming(self, text: str, done: bool) -> tuple[str, str]:
        """(reasoning, content) of a growing text that are safe to show now: each is a
        prefix of what the finished text gives."""
        start, end = self.start, self.end
        s = text.lstrip()
        if s.startswith(start):
            body = s[len(start):]
        elif not done and start.startswith(s):
            return "", ""  # nothing yet, or a start tag in the making
        elif self.implicit_start:
            body = text
        else:
            return "", text
        i = body.find(end)
        if i >= 0:
            return body[:i], body[i + len(end):]
        return (body if done else body[:_held(body, end)]), ""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished answer; None for an empty part."""
        reasoning, content = self.split_streaming(text, done=True)
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class Gemma4ReasoningParser(ReasoningParser):
    name = "gemma4"
    start, end = "<|channel>thought\n", "<channel|>"
    special_markers = True


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser,
                                         Gemma4ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                         f"{sorted(REASONING_PARSERS)}") from None

"""Reasoning parsers on canned text: ``<think>...</think>`` goes to reasoning_content (Qwen3
only when the answer opens the block; DeepSeek-R1's block is open from the start), and what a
stream shows at each point is a prefix of the final split (a tag is never shown in pieces)."""
from __future__ import annotations

import pytest

from jaxserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser

CASES = {
    "qwen3": [
        ("<think>plan it</think>The answer.", ("plan it", "The answer.")),
        ("\n<think>\nx\n</think>\n\nok", ("\nx\n", "\n\nok")),
        ("No thinking here.", (None, "No thinking here.")),
        ("<think>cut short", ("cut short", None)),
        ("a </think> b", (None, "a </think> b")),
    ],
    "deepseek_r1": [
        ("plan it</think>The answer.", ("plan it", "The answer.")),
        ("<think>plan</think>ok", ("plan", "ok")),
        ("still thinking", ("still thinking", None)),
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_split(name):
    p = get_reasoning_parser(name)
    for text, want in CASES[name]:
        assert p.split(text) == want, text


@pytest.mark.parametrize("name", sorted(CASES))
def test_streaming_shows_only_prefixes_of_the_final_split(name):
    p = get_reasoning_parser(name)
    for text, _ in CASES[name]:
        final_r, final_c = p.split_streaming(text, done=True)
        for k in range(len(text) + 1):
            r, c = p.split_streaming(text[:k], done=False)
            assert final_r.startswith(r) and final_c.startswith(c), (text, k, r, c)
            assert "<think" not in r + c and "</thi" not in r + c or "</think> b" in text


def test_unknown():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")

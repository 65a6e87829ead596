"""vLLM's ``allowed_token_ids`` and ``bad_words`` as rows of the step's token bitmask.

Both become a packed row ``[ceil(V/32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set = token
``t`` allowed, the layout of the structured-output bitmask), ANDed into the step plan's mask,
so they cost no compile and share the sampler's one masking step. A bad word that is one token
is banned outright; a longer one bans its last token after its other tokens, like vLLM. That
needs the request's real last tokens, so such a request is never scheduled with a token still
on the device (as a grammar is not).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def _clear(row: np.ndarray, token: int) -> None:
    row.view(np.uint32)[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


class TokenFilter:
    def __init__(self, vocab_size: int, allowed_token_ids: Sequence[int] | None = None,
                 bad_words_ids: Sequence[Sequence[int]] = ()):
        width = (vocab_size + 31) // 32
        if allowed_token_ids is None:
            self.base = np.full(width, -1, np.int32)
        else:
            bits = np.zeros(width * 32, bool)
            bits[np.asarray(list(allowed_token_ids), np.int64)] = True
            self.base = np.packbits(bits.reshape(width, 32), axis=1,
                                    bitorder="little").view("<u4").reshape(width).view(np.int32)
        self.prefixed: list[tuple[int, ...]] = []
        for ids in bad_words_ids:
            if len(ids) == 1:
                _clear(self.base, int(ids[0]))
            elif ids:
                self.prefixed.append(tuple(int(t) for t in ids))

    @property
    def needs_history(self) -> bool:
        """A multi-token bad word: the row depends on the last tokens generated."""
        return bool(self.prefixed)

    def row(self, output_token_ids: Sequence[int]) -> np.ndarray:
        if not self.prefixed:
            return self.base
        row = self.base.copy()
        for ids in self.prefixed:
            k = len(ids) - 1
            if len(output_token_ids) >= k and tuple(output_token_ids[-k:]) == ids[:-1]:
                _clear(row, ids[-1])
        return row


def bad_words_token_ids(tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """Each bad word as tokens, alone and after a space (vLLM bans both spellings)."""
    out: list[list[int]] = []
    for word in bad_words:
        for text in (word, " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out

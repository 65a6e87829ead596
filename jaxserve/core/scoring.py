"""Pairing rules of vLLM's score API and cosine scoring for embedders (host, no jax)."""
from __future__ import annotations

import numpy as np

from jaxserve.core.pooling_params import PoolingOutput
from jaxserve.errors import InvalidRequestError


def score_pairs(text_1, text_2, names: tuple[str, str] = ("text_1", "text_2")
                ) -> list[tuple[str, str]]:
    """One against many (``text_1`` a string or a one-item list) or pairwise (equal lengths)."""
    a = [text_1] if isinstance(text_1, str) else list(text_1 or [])
    b = [text_2] if isinstance(text_2, str) else list(text_2 or [])
    for name, xs in zip(names, (a, b)):
        if not xs:
            raise InvalidRequestError(f"{name} is empty", param=name)
        if not all(isinstance(x, str) for x in xs):
            raise InvalidRequestError(f"{name} must be a string or a list of strings",
                                      param=name)
    if len(a) == 1:
        return [(a[0], y) for y in b]
    if len(a) != len(b):
        raise InvalidRequestError(f"{names[0]} has {len(a)} items and {names[1]} {len(b)}: "
                                  "give one query or lists of equal length", param=names[1])
    return list(zip(a, b))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def cosine_output(request_id: str, a, b) -> PoolingOutput:
    return PoolingOutput(request_id, np.asarray([cosine(a, b)], np.float32), [])

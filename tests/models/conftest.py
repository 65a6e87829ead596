"""Fixtures the model tests share: tiny Qwen 3.5 / 3.6 checkpoints by variant."""
from __future__ import annotations

from pathlib import Path

import pytest

# dense / MoE, text-only / vision-language wrapper (text weights only), each with a random
# MTP head; "no_mtp": dense without one.
QWEN35_VARIANTS = {
    "dense": dict(moe=False, vl=False), "dense-vl": dict(moe=False, vl=True),
    "moe": dict(moe=True, vl=False), "moe-vl": dict(moe=True, vl=True),
    "no_mtp": dict(moe=False, vl=False, mtp=False),
}


@pytest.fixture(scope="session")
def qwen35(tmp_path_factory):
    """``variant -> Path``: a tiny Qwen 3.5 checkpoint, built once per session."""
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    root = tmp_path_factory.mktemp("qwen3_5")
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_tiny_qwen3_5(root / variant, **QWEN35_VARIANTS[variant])
        return made[variant]

    return get

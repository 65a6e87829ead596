"""Fixtures of the multimodal tests: the tiny random Qwen 3.5 vision-language checkpoint and
HF's model on it as the reference (``jaxserve.testing.multimodal``)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("vlm") / "qwen3_5-vl", vl=True, mtp=False)


@pytest.fixture(scope="session")
def hf_ref(tiny_vlm):
    pytest.importorskip("torch")
    from jaxserve.testing.multimodal import HFReference

    return HFReference(tiny_vlm)


@pytest.fixture(scope="session")
def tiny_moe_vlm(tmp_path_factory) -> Path:
    """``Qwen3_5MoeForConditionalGeneration``: the same vision tower over the MoE text model."""
    from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

    return make_tiny_qwen3_5(tmp_path_factory.mktemp("moe-vlm") / "qwen3_5-moe-vl", moe=True,
                             vl=True, mtp=False)

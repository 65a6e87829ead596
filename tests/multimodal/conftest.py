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

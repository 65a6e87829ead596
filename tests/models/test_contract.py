"""The model contract is declared: every family class carries the capabilities the engine
reads as plain attributes, and the engine never probes a model for them."""
import re
from pathlib import Path

import pytest

from jaxserve.models import registry
from jaxserve.models.contract import ModelBase

ROOT = Path(__file__).parents[2] / "jaxserve"
CAPABILITIES = ("supports_pipeline", "supports_lora", "cache_groups_supported", "mtp")


@pytest.mark.parametrize("arch", sorted(registry.MODEL_REGISTRY))
def test_every_family_declares_the_contracts_capabilities(arch):
    cls = registry.MODEL_REGISTRY[arch]
    assert issubclass(cls, ModelBase)
    for name in CAPABILITIES + ("cache_specs", "compute_logits", "final_hidden"):
        assert hasattr(cls, name), (arch, name)
    if cls.supports_pipeline:
        for name in ("embed", "layer_inputs", "run_layer"):
            assert callable(getattr(cls, name, None)), (arch, name)


def test_the_engine_reads_capabilities_without_probing_the_model():
    probes = []
    for sub in ("worker", "engine"):
        for path in (ROOT / sub).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"(getattr|hasattr)\((model|draft_model|family|stage)\b", line):
                    probes.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert probes == []

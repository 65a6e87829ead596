"""Shared fixtures: CPU JAX by default, tiny random HF checkpoints, the `gpu` skip."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # tests run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))


def _gpu_selected(config) -> bool:
    expr = config.getoption("markexpr", default="") or ""
    return "gpu" in expr and "not gpu" not in expr


def pytest_configure(config):
    # Before anything imports jax: CPU unless the GPU tests were asked for (`-m gpu`).
    if not _gpu_selected(config):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # Triton's interpreter is chosen when triton is first imported, and several kernel
        # modules import it (through Pallas' Triton backend): set it before any of them
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if gpu_items and not _has_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to JAX")
        for it in gpu_items:
            it.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Every XLA:CPU program keeps its machine code in memory maps of its own (six or more
    each); the whole suite in one process passes the kernel's ``vm.max_map_count`` (65530),
    and there LLVM fails ("Cannot allocate memory") and the compile segfaults. After each
    module, the programs that only JAX's caches still hold are dropped (engines freeze the
    heap after warm-up, ``gc.freeze``: unfrozen first, so the collector sees all of it)."""
    yield
    if "jax" in sys.modules:
        import gc

        import jax

        gc.unfreeze()
        gc.collect()
        jax.clear_caches()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``(arch="llama", **overrides) -> Path``: a tiny random HF checkpoint, built once per session.

    Defaults (jaxserve.testing.tiny_model.DEFAULTS): 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512,
    float32; mistral gets sliding_window 16, qwen3 head_dim 32.
    """
    from jaxserve.testing.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = json.dumps([arch, overrides], sort_keys=True, default=str)
        if key not in cache:
            cache[key] = make_tiny_model(arch, root / f"{arch}-{len(cache)}", **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


# CI runs the same hypothesis examples every time (a failure is a real bug, not a new draw);
# HYPOTHESIS_RANDOM=1 explores fresh examples locally.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("jaxserve-ci", derandomize=True, deadline=None)
    if not os.environ.get("HYPOTHESIS_RANDOM"):
        _hyp_settings.load_profile("jaxserve-ci")
except ImportError:  # hypothesis is a test extra
    pass

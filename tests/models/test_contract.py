"""The model contract is declared: every family class carries the capabilities the engine
reads as plain attributes, and the engine never probes a model for them."""
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.models import registry
from jaxserve.models.contract import ModelBase, capture_hidden

ROOT = Path(__file__).parents[2] / "jaxserve"
# getattr / hasattr on a model (``model``, ``engine.model``, a draft model, a stage)
PROBE = r"(getattr|hasattr)\((\w+\.)?(model|draft_model|family|stage)\b"
CAPABILITIES = ("supports_pipeline", "supports_lora", "cache_groups_supported", "mtp", "visual")


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
                if re.search(PROBE, line):
                    probes.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert probes == []


# ---------------------------------------------------------------------------- the layer loop

def _split_forward(path, cut: int):
    """The whole forward, and the same step as two layer ranges [0, cut) and [cut, L) (what a
    pipeline stage runs): hidden states and pages of each."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.testing.paged import metadata, step_inputs
    from jaxserve.worker.kv_cache import allocate_layer_pages

    model, _, _ = load_model(str(path), dtype="float32")
    pages = allocate_layer_pages(model.cache_specs("float32"), 16, 8, jnp.float32)
    rng = np.random.default_rng(0)
    plan = step_inputs([(rng.integers(5, 500, 11), 0, [3, 7]), (rng.integers(5, 500, 4), 0, [5])],
                       block_size=8, max_pages=4)
    md, ids, pos = metadata(plan), jnp.asarray(plan.token_ids), jnp.asarray(plan.positions)
    graphdef, state = nnx.split(model)
    # hidden-state layers asked per token (0: the embeddings, L: the final norm's output)
    L = model.num_layers
    capture = jnp.asarray(np.stack([np.arange(ids.shape[0]) % (L + 1),
                                    np.full(ids.shape[0], -1)], axis=1), jnp.int32)

    @jax.jit
    def whole(state, pages):
        return nnx.merge(graphdef, state)(ids, pos, pages, md, capture=capture)

    @jax.jit
    def ranges(state, pages):
        m = nnx.merge(graphdef, state)
        inputs = m.layer_inputs(pos, md, ids.shape[0])
        x, first, cap0 = m.run_layers(m.embed(ids), inputs, pages[:cut], md, lo=0, hi=cut,
                                      capture=capture)
        x, second, cap1 = m.run_layers(x, inputs, pages[cut:], md, lo=cut, capture=capture)
        hidden = m.final_hidden(x)
        return hidden, first + second, capture_hidden(cap0 + cap1, capture, L, hidden)

    return whole(state, pages), ranges(state, pages), (model, pages, md)


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_layer_ranges_compute_exactly_the_whole_forward(tiny_model_factory, tmp_path, family):
    """The one layer loop over two ranges (Gemma 4: its KV-sharing layers read producers in
    their own range) gives the single program's hidden states, pages and captured hidden
    states (``return_hidden_states``), bit for bit."""
    if family == "gemma4":
        from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

        path, cut = make_tiny_gemma4(tmp_path / "g4"), 2  # layers 4, 5 read 3, 2
    else:
        path, cut = tiny_model_factory("llama", layers=3), 1
    (whole, whole_pages, whole_cap), (split, split_pages, split_cap), (model, pages, md) = \
        _split_forward(path, cut)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
    # the ranges' captures add up to the whole forward's (each layer captured by one range)
    np.testing.assert_array_equal(np.asarray(split_cap), np.asarray(whole_cap))
    cap = np.asarray(whole_cap)
    assert cap[:, 0].any(axis=-1).all() and not cap[:, 1].any()
    np.testing.assert_array_equal(cap[model.num_layers, 0], np.asarray(whole)[model.num_layers])
    assert len(split_pages) == len(whole_pages)
    for a, b in zip(jax.tree_util.tree_leaves(split_pages), jax.tree_util.tree_leaves(whole_pages)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if family == "gemma4":  # a KV-sharing layer hands back no pages of its own
        assert split_pages[-1] == () and split_pages[-2] == ()
        with pytest.raises(ValueError, match="layer 4 reads the pages of layer 3, outside"):
            model.run_layers(None, None, pages[4:], md, lo=4)


def test_register_model_serves_a_family_from_outside_the_package():
    """vLLM's ``ModelRegistry.register_model``: a test family is registered by the test, never
    by the registry; a non-model class or a taken name is an error."""
    from jaxserve.testing import tiny_hybrid

    arch, cls = tiny_hybrid.ARCHITECTURE, tiny_hybrid.TinyHybridForCausalLM
    saved = dict(registry.MODEL_REGISTRY)
    try:
        registry.MODEL_REGISTRY.pop(arch, None)
        with pytest.raises(ValueError, match="unsupported model architecture"):
            registry.get_model_class(arch)
        registry.register_model(arch, cls)
        registry.register_model(arch, cls)  # again: the same class
        assert registry.get_model_class(arch) is cls
        with pytest.raises(ValueError, match="already served by"):
            registry.register_model("LlamaForCausalLM", cls)
        with pytest.raises(ValueError, match="not a model class"):
            registry.register_model("X", dict)
    finally:
        registry.MODEL_REGISTRY.clear()
        registry.MODEL_REGISTRY.update(saved)


# ---------------------------------------------------------------------------- attention backend

def test_the_attention_backend_is_one_object_chosen_at_build_time(tiny_llama_dir):
    from jaxserve.loaders.model_loader import load_model
    from jaxserve.models.attention import AttentionBackend, resolve_attention_backend

    xla = resolve_attention_backend("xla")
    assert isinstance(xla, AttentionBackend) and resolve_attention_backend("xla") is xla
    assert resolve_attention_backend(xla) is xla
    model, _, _ = load_model(str(tiny_llama_dir), attention_backend=xla)
    assert model.attention is xla and model.attention_backend == "xla"
    hash(model.attention)  # static: part of the jit cache key
    with pytest.raises(ValueError, match="attention_backend 'cudnn' is not one of"):
        resolve_attention_backend("cudnn")
    # no layer dispatches on the backend's name
    for path in (ROOT / "models").glob("*.py"):
        assert not re.search(r"backend\s*==\s*[\"']", path.read_text()), path


# ---------------------------------------------------------------------------- GGUF tables

def test_every_gguf_architecture_is_declared_by_its_family_file():
    """The GGUF loader keeps no family table: each llama.cpp architecture's table is on the
    class that serves it (found through the registry)."""
    names = set()
    for gguf_name, spec in registry.GGUF_ARCHITECTURES.items():
        cls = registry.MODEL_REGISTRY[spec.architecture]
        assert spec in cls.gguf, gguf_name
        names |= {gguf_name, spec.model_type}
    mixtral = registry.gguf_arch("llama", experts=True)
    assert mixtral.architecture == "MixtralForCausalLM" and mixtral.experts
    assert registry.gguf_arch("llama").experts is None
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        registry.gguf_arch("gpt2")
    loader = (ROOT / "loaders" / "gguf.py").read_text()
    assert not [n for n in names | {"mixtral"} if f'"{n}"' in loader]

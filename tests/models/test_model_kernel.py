"""The Pallas kernel inside the model's jitted step: same logits as the other backends on CPU,
and the whole step lowers for CUDA with the pool donated.

The forward is the runner's own (``jaxserve.worker.step_functions.forward_fn``): params as a flat list of
leaves, the KV pool donated, logits of each row's last token.
"""
from __future__ import annotations

import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from jaxserve.worker.kv_cache import allocate_kv_pages
from jaxserve.loaders.model_loader import load_model
from jaxserve.worker.step_functions import forward_fn
from jaxserve.testing.paged import step_inputs
from jaxserve.worker.step_inputs import StepInputs, pack

BLOCK = 16
NUM_PAGES = 48
MAX_PAGES = 8  # per sequence: 128 tokens
LADDER = (8, 16, 32)
MAX_SEQS = 8
TRITON = "__gpu$xla.gpu.triton"


def _model(path, backend, dtype="float32"):
    model, cfg, _ = load_model(str(path), dtype=dtype, attention_backend=backend)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    return forward_fn(graphdef, treedef), leaves, cfg


def _mixed_rows(rng, vocab):
    """A prefill chunk over earlier context, a fresh prompt, and decodes (context 1, an exact
    page multiple, a long one), every sequence on pages scattered over the pool."""
    pages = iter(rng.permutation(np.arange(1, NUM_PAGES)).tolist())  # page 0 is the trash page
    rows = []
    for start, n in ((20, 13), (0, 5), (37, 1), (15, 1), (0, 1), (100, 1)):
        need = (start + n - 1) // BLOCK + 1
        ids = rng.integers(1, vocab, size=n).astype(np.int32)
        rows.append((ids, start, [next(pages) for _ in range(need)]))
    return rows


def _plan(rows):
    return step_inputs(rows, block_size=BLOCK, max_pages=MAX_PAGES, ladder=LADDER,
                       max_num_seqs=MAX_SEQS)


def _random_pool(cfg, rng, dtype=jnp.float32):
    """The pool with 'earlier context' already in it: random K/V in every page."""
    pool = allocate_kv_pages(cfg, NUM_PAGES, BLOCK, dtype)
    shape = pool[0][0].shape
    return [tuple(jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
                  for _ in range(2)) for _ in pool]


def _step(path, backend, pool_seed=1):
    """Logits and the updated pool of one mixed step of ``backend`` (same weights, plan, pool)."""
    forward, leaves, cfg = _model(path, backend)
    plan = _plan(_mixed_rows(np.random.default_rng(0), cfg.vocab_size))
    assert plan.token_bucket == 32 and plan.num_seqs == 6 < plan.seq_bucket  # padding rows too
    pool = _random_pool(cfg, np.random.default_rng(pool_seed))
    prev_tokens = jnp.zeros((plan.seq_bucket,), jnp.int32)  # no row refers to a pending token
    buf, layout = pack(StepInputs.from_plan(plan))
    logits, pool, _, _ = forward(leaves, pool, buf, prev_tokens, None, layout)
    return np.asarray(logits)[: plan.num_seqs], [np.asarray(a) for kv in pool for a in kv]


@pytest.mark.parametrize("arch,opts", [
    ("llama", dict(layers=1)),
    ("qwen3", dict(layers=1, head_dim=32)),
    ("mistral", dict(layers=1)),  # sliding window 16: the decode at 100 sees only its window
], ids=["llama", "qwen3", "mistral"])
def test_pallas_backend_matches_reference_and_xla_in_the_model(tiny_model_factory, arch, opts):
    path = tiny_model_factory(arch, **opts)
    got, pool = _step(path, "pallas")
    assert np.all(np.isfinite(got))
    for other in ("reference", "xla"):
        want, want_pool = _step(path, other)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=other)
        for a, b in zip(pool, want_pool):  # the step's K/V land in the same slots
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=other)


def test_plan_rows_attend_to_their_own_pages(tiny_model_factory):
    """The comparison above is not vacuous: another pool content changes the pallas logits."""
    path = tiny_model_factory("llama", layers=1)
    a, _ = _step(path, "pallas", pool_seed=1)
    b, _ = _step(path, "pallas", pool_seed=2)
    # Row 1 is a fresh prompt (no earlier context): it must not depend on the pool at all.
    np.testing.assert_allclose(a[1], b[1], atol=1e-5, rtol=0)
    # Every row with earlier context reads it from its pages.
    assert np.abs(a[[0, 2, 3, 5]] - b[[0, 2, 3, 5]]).max(axis=-1).min() > 1e-4


# ---------------------------------------------------------------------------- CUDA lowering

_HAS_PLUGIN = any(
    importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
)


@pytest.fixture
def lower_as_gpu(monkeypatch):
    """The model picks ``interpret=True`` when JAX's default backend is the CPU; exporting for
    CUDA from a CPU machine must lower the real Triton kernel instead."""
    import jaxserve.models.layers as layers

    monkeypatch.setattr(layers.jax, "default_backend", lambda: "gpu")


def _export_step(path, dtype, tokens, seqs):
    forward, leaves, cfg = _model(path, "pallas", dtype=dtype)
    sds = jax.ShapeDtypeStruct
    state = [sds(x.shape, x.dtype) for x in leaves]
    pool_shape = (cfg.num_kv_heads, 64, BLOCK, cfg.head_dim)
    pool = [(sds(pool_shape, dtype), sds(pool_shape, dtype)) for _ in range(cfg.num_layers)]
    # the bucket's inputs as the engine packs them: decode rows, or one long row and decodes
    lens = [1] * seqs if tokens == seqs else [tokens - seqs + 1] + [1] * (seqs - 1)
    rows = [([3] * n, 20 if n == 1 else 0, list(range(1 + 5 * i, 6 + 5 * i)))
            for i, n in enumerate(lens)]
    plan = step_inputs(rows, block_size=BLOCK, max_pages=16, ladder=(tokens,), max_num_seqs=seqs)
    assert (plan.token_bucket, plan.seq_bucket) == (tokens, seqs)
    buf, layout = pack(StepInputs.from_plan(plan))
    exp = export.export(forward, platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
        state, pool, sds(buf.shape, buf.dtype), sds((seqs,), jnp.int32), None, layout)
    return exp, cfg, len(state)


@pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
@pytest.mark.parametrize("tokens,seqs,kind", [(8, 8, "decode"), (64, 8, "mixed")],
                         ids=["decode_bucket", "mixed_bucket"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_step_lowers_for_cuda(tiny_model_factory, lower_as_gpu, dtype, tokens, seqs, kind):
    path = tiny_model_factory("llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64)
    exp, cfg, n_state = _export_step(path, dtype, tokens, seqs)
    text = exp.mlir_module()
    # Every layer calls the kernel; its decode call (and, with long rows, its prefill call)
    # lowers to Triton. Each layer calls one private function (the KV write and the jitted
    # kernel), lowered once for all layers.
    assert len(re.findall(r"call @attend\w*\(", text)) == cfg.num_layers
    assert len(re.findall(r"func\.func private @attend\w*\(", text)) == 1
    assert len(re.findall(r"call @_ragged_paged_attention\w*\(", text)) == 1
    want = 1 if kind == "decode" else 2  # a decode-only bucket has no room for a prefill block
    assert text.count(TRITON) == want
    assert "rpa_decode" in text
    assert ("rpa_prefill" in text) == (kind == "mixed")
    # The pool (args after the params) is donated and aliased to the returned pool.
    n_pool = 2 * cfg.num_layers
    # the params, the pool, the packed step inputs and prev_tokens are all inputs
    assert exp.module_kept_var_idx == tuple(range(n_state + n_pool + 2))
    aliases = {int(a): int(o) for a, o in re.findall(
        r"%arg(\d+): tensor<[^>]*> \{[^}]*tf\.aliasing_output = (\d+)", text)}
    assert aliases == {n_state + i: 1 + i for i in range(n_pool)}, aliases
    assert exp.out_avals[0].shape == (seqs, cfg.vocab_size)
    assert exp.out_avals[0].dtype == jnp.float32
    assert all(a.dtype == jnp.dtype(dtype) for a in exp.out_avals[1:])

"""GPTQ (jaxserve/testing/gptq.py): the algorithm against round-to-nearest on synthetic layers,
and the checkpoint it writes through the GPTQ loader on a tiny random Llama."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from jaxserve.testing.gptq import gptq_quantize  # noqa: E402
from jaxserve.testing.int4_checkpoint import dequantize_reference, rtn_int4  # noqa: E402


def _rtn_fp16_scales(w, group_size):
    """Plain round-to-nearest with the same grid as GPTQ (asymmetric min/max per group, scale
    rounded to float16), in float64 numpy."""
    n_in = w.shape[1]
    groups = np.arange(n_in) // group_size
    q = np.zeros(w.shape, np.uint8)
    for g in range(groups.max() + 1):
        cols = groups == g
        lo = np.minimum(w[:, cols].min(axis=1), 0.0)
        hi = np.maximum(w[:, cols].max(axis=1), 0.0)
        s = np.maximum((hi - lo) / 15, 1e-8).astype(np.float16).astype(np.float64)
        z = np.clip(np.round(-lo / s), 0, 15)
        q[:, cols] = np.clip(np.round(w[:, cols] / s[:, None]) + z[:, None], 0, 15)
    return q


def test_uncorrelated_inputs_make_gptq_round_to_nearest():
    """A diagonal Hessian (independent input channels) leaves no error to compensate: GPTQ's
    integers equal round-to-nearest's, including a short last group (80 = 2 x 32 + 16)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 80))
    h = np.diag(rng.uniform(0.5, 2.0, 80))
    q, scales, zeros, g_idx = gptq_quantize(w, h, group_size=32)
    assert scales.shape == zeros.shape == (24, 3) and scales.dtype == np.float16
    np.testing.assert_array_equal(g_idx, np.arange(80) // 32)
    np.testing.assert_array_equal(q, _rtn_fp16_scales(w, 32))


def _correlated_layer(rng, n=1024, n_in=128, n_out=48):
    z = rng.normal(size=(n, n_in))
    x = z @ (np.eye(n_in) + 0.6 * rng.normal(size=(n_in, n_in)) / np.sqrt(n_in))
    x[:, :4] *= 8.0  # a few outlier channels, as in LLM activations
    return x, rng.normal(size=(n_out, n_in)) * 0.05


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "desc_act"])
def test_gptq_output_error_is_well_below_rtn(act_order):
    """On correlated inputs GPTQ's layer output error ``||X W^T - X W_q^T||`` is under 0.8x
    round-to-nearest's (same 4-bit grid, group 32); with act-order each group still holds 32
    channels (``g_idx``) and the error is lower still."""
    rng = np.random.default_rng(1)
    x, w = _correlated_layer(rng)
    h = 2 * x.T @ x / len(x)
    q, scales, zeros, g_idx = gptq_quantize(w, h, group_size=32, act_order=act_order)
    assert np.bincount(g_idx).tolist() == [32] * 4
    if act_order:
        assert not np.array_equal(g_idx, np.arange(128) // 32)
    gptq_err = np.linalg.norm(x @ (w - dequantize_reference(q, scales, zeros, g_idx)).T)
    rq, rs, rz = rtn_int4(w, np.arange(128) // 32, 4)
    rtn_err = np.linalg.norm(x @ (w - dequantize_reference(rq, rs, rz, np.arange(128) // 32)).T)
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)


def test_gptq_checkpoint_loads_and_equals_its_reference(tiny_llama_dir, tmp_path):
    """The GPTQ-format checkpoint (act-order, a few hundred calibration tokens) loads through
    the gptq loader: every projection's in-matmul dequantization equals the reference weights,
    and the logits equal the float model carrying them."""
    import jax.numpy as jnp

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.testing.gptq import write_gptq_checkpoint
    from tests.models.test_quantization import _float_model_with, _logits

    ckpt = tmp_path / "gptq"
    ref = write_gptq_checkpoint(tiny_llama_dir, ckpt, group_size=32, desc_act=True,
                                num_tokens=256, seq_len=64)
    model, cfg, _ = load_model(str(ckpt), dtype="float32")
    assert model.model.layers[0].self_attn.q_proj.perm is not None
    assert len(ref) == 7 * cfg.num_layers
    x = np.random.default_rng(3).normal(size=(5, cfg.hidden_size)).astype(np.float32)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        mod = getattr(model.model.layers[1].self_attn, proj)
        w = ref[f"model.layers.1.self_attn.{proj}.weight"]
        np.testing.assert_allclose(np.asarray(mod(jnp.asarray(x))), x @ w.T, rtol=1e-4,
                                   atol=1e-5)
    float_model = _float_model_with(tiny_llama_dir, ref)
    ids = np.arange(7, 40, dtype=np.int32)
    np.testing.assert_allclose(_logits(model, cfg, ids), _logits(float_model, cfg, ids),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("desc_act", [False, True], ids=["plain", "desc_act"])
def test_gptq_short_last_group_loads(tiny_llama_dir, tmp_path, desc_act):
    """GPTQ's layout when the group size does not divide the input width (SmolLM2's 576 with
    group 128: 4 groups of 128 and one of 64): the loader keeps ``ceil(in / size)`` groups and
    the in-matmul dequantization equals the reference. Here 64 = 48 + 16."""
    import jax.numpy as jnp

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.testing.int4_checkpoint import write_int4_checkpoint

    ref = write_int4_checkpoint(tiny_llama_dir, tmp_path / "g48", "gptq", group_size=48,
                                desc_act=desc_act)
    model, cfg, _ = load_model(str(tmp_path / "g48"), dtype="float32")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.scales.get_value().shape[1] == 2
    x = np.random.default_rng(5).normal(size=(4, cfg.hidden_size)).astype(np.float32)
    for proj in ("q_proj", "o_proj"):
        w = ref[f"model.layers.0.self_attn.{proj}.weight"]
        np.testing.assert_allclose(np.asarray(getattr(attn, proj)(jnp.asarray(x))), x @ w.T,
                                   rtol=1e-4, atol=1e-5)


def test_act_order_int4_matmul_runs_in_bf16():
    """The act-order path (activations gathered by ``perm``) in bf16 compiles on every backend
    (XLA CPU has no bf16 x bf16 -> f32 dot after the gather) and equals the float32 matmul to
    bf16 precision."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.linear import int4_matmul
    from jaxserve.models.quantization import pack_nibbles

    rng = np.random.default_rng(6)
    q = rng.integers(0, 16, (16, 64)).astype(np.uint8)
    s = rng.uniform(0.01, 0.02, (16, 2)).astype(np.float32)
    z = rng.integers(0, 16, (16, 2)).astype(np.uint8)
    perm = jnp.asarray(rng.permutation(64).astype(np.int32))
    x = rng.normal(size=(8, 64)).astype(np.float32)
    mm = jax.jit(int4_matmul, static_argnums=(5, 6))
    got = mm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(pack_nibbles(q)),
             jnp.asarray(s, jnp.bfloat16), jnp.asarray(z), perm, 4, 32)
    want = mm(jnp.asarray(x), jnp.asarray(pack_nibbles(q)), jnp.asarray(s), jnp.asarray(z),
              perm, 4, 32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2,
                               atol=3e-2)

"""Gated DeltaNet: the reference means what HF's qwen3_5 means, and the XLA path equals it.

Random ragged steps mix long prefill rows (several chunks), short chunks continuing from a
non-zero state, decodes, rows starting from zero and padding rows whose slot holds data that must
survive. float32 throughout: tolerance 1e-5 relative to the largest output / state entry.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta_rule as xla_gdn
from pallas_kernels import reference
from pallas_kernels.ragged_batch import make_state_rows

T, S, N = 96, 8, 12
HK, HV, DK, DV = 2, 4, 16, 16
CONV, K = 24, 4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_rows(rng, *, num_tokens=T, num_seqs=S, num_slots=N, max_real=None):
    """A mixed step: every kind of row, in random order, with padding rows after."""
    n = int(rng.integers(1, (max_real or num_seqs - 1) + 1))
    q_lens, ctx = [], []
    budget = num_tokens - n
    for _ in range(n):
        kind = rng.choice(["long", "chunk", "decode", "fresh_short"])
        if kind == "long":
            ql = 1 + int(rng.integers(0, max(1, min(budget, 80)) + 1))
        elif kind == "chunk":
            ql = 1 + int(rng.integers(0, max(1, min(budget, 12)) + 1))
        else:
            ql = 1 + (int(rng.integers(0, min(budget, 3) + 1)) if kind == "fresh_short" else 0)
        budget -= ql - 1
        q_lens.append(ql)
        fresh = kind == "fresh_short" or (kind == "long" and rng.random() < 0.5)
        ctx.append(ql if fresh else ql + int(rng.integers(1, 200)))
    return make_state_rows(rng, q_lens, ctx, num_tokens=num_tokens, num_seqs=num_seqs,
                           num_slots=num_slots)


def random_gdn_inputs(rng, t=T, hk=HK, hv=HV, dk=DK, dv=DV, num_slots=N, dtype=np.float32):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v = f(t, hk, dk), f(t, hk, dk), f(t, hv, dv)
    # The model's gates: g = -exp(A_log) * softplus(a + dt_bias) <= 0, beta = sigmoid(b).
    g = -np.exp(f(hv) * 0.5) * np.log1p(np.exp(f(t, hv)))
    beta = 1 / (1 + np.exp(-f(t, hv)))
    state = f(num_slots, hv, dk, dv) * 0.5
    cast = lambda a: a.astype(dtype)
    return cast(q), cast(k), cast(v), cast(g), cast(beta), state


@functools.lru_cache(maxsize=None)
def _ref_gdn():
    return jax.jit(reference.gated_delta_rule)


@functools.lru_cache(maxsize=None)
def _ref_conv():
    return jax.jit(reference.causal_conv1d)


def check_pool(new, old, rows, ref_new):
    """Real rows' slots hold the reference's state; every other slot is untouched."""
    new, old = np.asarray(new), np.asarray(old)
    real = set(int(s) for s in rows.state_slots[: rows.num_seqs])
    for slot in range(old.shape[0]):
        if slot in real:
            assert _rel(new[slot], ref_new[slot]) < 1e-5, slot
        else:
            np.testing.assert_array_equal(new[slot], old[slot])


@pytest.mark.parametrize("seed", range(6))
def test_xla_gdn_equals_reference_on_random_ragged_steps(seed):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng)
    q, k, v, g, beta, state = random_gdn_inputs(rng)
    chunk = 16 if seed % 2 else 64
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    o, s = xla_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), chunk_size=chunk)
    assert _rel(o, o_ref) < 1e-5
    assert np.all(np.asarray(o)[rows.num_tokens:] == 0)
    check_pool(s, state, rows, np.asarray(s_ref))
    check_pool(s_ref, state, rows, np.asarray(s_ref))


def test_reference_fresh_row_ignores_its_slot_and_padding_rows_write_nothing():
    rng = np.random.default_rng(7)
    q, k, v, g, beta, state = random_gdn_inputs(rng)
    # Row 0 is new (ctx == q_len): its slot's old content must not leak into it.
    rows = make_state_rows(rng, [5, 1], [5, 9], num_tokens=T, num_seqs=S, num_slots=N)
    o1, s1 = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    state2 = state.copy()
    state2[rows.state_slots[0]] = 123.0
    o2, s2 = _ref_gdn()(q, k, v, g, beta, state2, *rows.args())
    np.testing.assert_array_equal(np.asarray(o1)[:5], np.asarray(o2)[:5])
    np.testing.assert_array_equal(np.asarray(s1)[rows.state_slots[0]],
                                  np.asarray(s2)[rows.state_slots[0]])
    # The continuing row does read its slot.
    assert not np.allclose(np.asarray(o1)[5], 0)


def test_two_chunks_equal_one_chunk():
    """A prompt prefilled in one step equals the same prompt in two steps, the state carried."""
    rng = np.random.default_rng(3)
    n, cut = 90, 37
    q, k, v, g, beta, state = random_gdn_inputs(rng)
    slot = np.int32(5)
    whole = make_state_rows(rng, [n], [n], num_tokens=T, num_seqs=S, num_slots=N)
    whole.state_slots[0] = slot
    o_all, s_all = xla_gdn.gated_delta_rule(q, k, v, g, beta, state, *whole.args())
    first = make_state_rows(rng, [cut], [cut], num_tokens=T, num_seqs=S, num_slots=N)
    first.state_slots[0] = slot
    o1, s1 = xla_gdn.gated_delta_rule(q, k, v, g, beta, state, *first.args())
    second = make_state_rows(rng, [n - cut], [n], num_tokens=T, num_seqs=S, num_slots=N)
    second.state_slots[0] = slot
    shift = lambda a: np.concatenate([a[cut:], a[:cut]])
    o2, s2 = xla_gdn.gated_delta_rule(*(shift(a) for a in (q, k, v, g, beta)), s1,
                                      *second.args())
    out = np.concatenate([np.asarray(o1)[:cut], np.asarray(o2)[: n - cut]])
    assert _rel(out, np.asarray(o_all)[:n]) < 1e-5
    assert _rel(np.asarray(s2)[slot], np.asarray(s_all)[slot]) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_xla_conv_equals_reference_on_random_ragged_steps(seed):
    rng = np.random.default_rng(100 + seed)
    rows = random_rows(rng)
    x = rng.standard_normal((T, CONV)).astype(np.float32)
    w = rng.standard_normal((CONV, K)).astype(np.float32)
    b = rng.standard_normal(CONV).astype(np.float32) if seed else None
    pool = rng.standard_normal((N, CONV, K - 1)).astype(np.float32)
    y_ref, c_ref = _ref_conv()(x, w, b, pool, *rows.args())
    y, c = xla_gdn.causal_conv1d(x, w, b, pool, *rows.args())
    assert _rel(y, y_ref) < 1e-5
    assert np.all(np.asarray(y)[rows.num_tokens:] == 0)
    check_pool(c, pool, rows, np.asarray(c_ref))


# ---- the reference against Hugging Face's qwen3_5 functions ----------------------------------

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
torch = pytest.importorskip("torch")


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def test_reference_equals_hf_chunked_prefill_and_recurrent_decode():
    """Two requests with different histories: a 70-token prefill continuing from a state (HF's
    chunked function) and a decode token (HF's recurrent function), in one ragged step."""
    rng = np.random.default_rng(11)
    q, k, v, g, beta, state = random_gdn_inputs(rng)
    rows = make_state_rows(rng, [70, 1], [100, 40], num_tokens=T, num_seqs=S, num_slots=N)
    o, s = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    o, s = np.asarray(o), np.asarray(s)
    for i, fn in ((0, hf.torch_chunk_gated_delta_rule), (1, hf.torch_recurrent_gated_delta_rule)):
        lo, hi = rows.query_start[i], rows.query_start[i + 1]
        slot = rows.state_slots[i]
        ho, hs = fn(*(_t(a[None, lo:hi]) for a in (q, k, v)), g=_t(g[None, lo:hi]),
                    beta=_t(beta[None, lo:hi]), initial_state=_t(state[slot][None]),
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert _rel(o[lo:hi], ho[0].numpy()) < 1e-5
        assert _rel(s[slot], hs[0].numpy()) < 1e-5


def test_reference_equals_hf_from_zero_state():
    rng = np.random.default_rng(12)
    q, k, v, g, beta, state = random_gdn_inputs(rng)
    rows = make_state_rows(rng, [33], [33], num_tokens=T, num_seqs=S, num_slots=N)
    o, s = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    ho, hs = hf.torch_chunk_gated_delta_rule(
        *(_t(a[None, :33]) for a in (q, k, v)), g=_t(g[None, :33]), beta=_t(beta[None, :33]),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _rel(np.asarray(o)[:33], ho[0].numpy()) < 1e-5
    assert _rel(np.asarray(s)[rows.state_slots[0]], hs[0].numpy()) < 1e-5


def test_conv_reference_equals_hf_prefill_then_decode():
    """HF's causal_conv1d_fn over a prompt, then causal_conv1d_update for one token (whose
    state is the last K inputs; ours keeps K-1), against two steps of the reference."""
    rng = np.random.default_rng(13)
    n = 11
    x = rng.standard_normal((n + 1, CONV)).astype(np.float32)
    w = rng.standard_normal((CONV, K)).astype(np.float32)
    pool = np.zeros((N, CONV, K - 1), np.float32)
    xt = _t(x.T[None])
    hy = hf.causal_conv1d_fn(xt[..., :n], _t(w), None, activation="silu")[0].numpy().T
    hstate = torch.nn.functional.pad(xt[..., :n], (K - n, 0))[..., -K:].clone()
    hy1 = hf.causal_conv1d_update(xt[..., n:], hstate, _t(w), None, "silu")[0].numpy().T
    pad = lambda a: np.concatenate([a, np.zeros((T - len(a), CONV), np.float32)])
    rows = make_state_rows(rng, [n], [n], num_tokens=T, num_seqs=S, num_slots=N)
    y, pool = _ref_conv()(pad(x[:n]), w, None, pool, *rows.args())
    assert _rel(np.asarray(y)[:n], hy) < 1e-5
    rows2 = make_state_rows(rng, [1], [n + 1], num_tokens=T, num_seqs=S, num_slots=N)
    rows2.state_slots[0] = rows.state_slots[0]
    y1, _ = _ref_conv()(pad(x[n:]), w, None, pool, *rows2.args())
    assert _rel(np.asarray(y1)[:1], hy1) < 1e-5

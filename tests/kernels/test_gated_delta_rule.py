"""Gated DeltaNet: the reference means what HF's qwen3_5 means, and the XLA path equals it.

Random ragged steps mix long prefill rows (several chunks), short chunks continuing from a
non-zero state, decodes, rows starting from zero and padding rows whose slot holds data that must
survive. float32 throughout: tolerance 1e-5 relative to the largest output / state entry. The
Pallas kernels run in interpret mode with small tiles (chunks of 16, 16 state columns per program,
decode rows of up to 2 tokens) so CPU shapes still cover multi-chunk rows, several column blocks
and both calls; one case runs the default tiles. Their CUDA lowering is checked with jax.export.
"""
from __future__ import annotations

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import gated_delta_rule as xla_gdn
from pallas_kernels import gated_delta_rule_pallas as pallas_gdn
from pallas_kernels import reference
from pallas_kernels.ragged_batch import make_state_rows

T, S, N = 96, 8, 12
HK, HV, DK, DV = 2, 4, 16, 16
CONV, K = 24, 4


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def random_rows(rng, *, num_tokens=T, num_seqs=S, num_slots=N, long_max=60):
    """A mixed step in random order, padding rows after: at least one long row (17 to
    ``long_max + 1`` tokens), one short chunk continuing from a state and one decode, the rest
    drawn from every kind."""
    n = int(rng.integers(3, num_seqs))
    kinds = ["long", "chunk", "decode"] + list(rng.choice(
        ["long", "chunk", "decode", "fresh_short"], size=n - 3))
    rng.shuffle(kinds)
    q_lens, ctx = [], []
    budget = num_tokens - n  # every row keeps >= 1 token
    for kind in kinds:
        if kind == "long":
            ql = 1 + int(rng.integers(min(budget, 16), max(min(budget, long_max), 16) + 1))
        elif kind == "chunk":
            ql = 2 + int(rng.integers(0, 10))
        elif kind == "fresh_short":
            ql = 1 + int(rng.integers(0, 4))
        else:
            ql = 1
        ql = min(ql, budget + 1)
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



# ---- the Pallas kernels: interpret mode on CPU --------------------------------------------

DV_P = 32  # two column blocks of 16
SMALL = dict(chunk_size=16, block_v=16, decode_max_tokens=2)


@pytest.mark.parametrize("seed", range(4))
def test_pallas_gdn_equals_reference_on_random_ragged_steps(seed):
    rng = np.random.default_rng(200 + seed)
    rows = random_rows(rng)
    q, k, v, g, beta, state = random_gdn_inputs(rng, dv=DV_P)
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    o, s = pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), interpret=True,
                                       **SMALL)
    assert _rel(o, o_ref) < 1e-5
    assert np.all(np.asarray(o)[rows.num_tokens:] == 0)
    check_pool(s, state, rows, np.asarray(s_ref))


def test_pallas_gdn_default_tiles_long_rows_bf16():
    """Chunks of 64: a 66-token row continuing from a state (two chunks), a fresh 20-token row,
    decodes and a 5-token row; bf16 q/k/v (the kernel computes in float32)."""
    rng = np.random.default_rng(9)
    rows = make_state_rows(rng, [66, 1, 20, 1, 5], [170, 9, 20, 1, 30], num_tokens=T,
                           num_seqs=S, num_slots=N)
    q, k, v, g, beta, state = random_gdn_inputs(rng, dv=DV_P, dtype=jnp.bfloat16)
    g, beta = g.astype(np.float32), beta.astype(np.float32)
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    o, s = pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), interpret=True)
    assert o.dtype == jnp.bfloat16
    assert _rel(o, o_ref) < 1e-2
    check_pool(s, state, rows, np.asarray(s_ref))


def test_pallas_gdn_prefill_grid_as_small_as_the_bucket_allows():
    """The prefill call has T // (decode_max_tokens + 1) programs per head: here 9 for 16 rows,
    and 9 rows of 5 tokens (the most that fit) beside 3 decodes all get theirs."""
    rng = np.random.default_rng(31)
    t, s = 48, 16
    rows = make_state_rows(rng, [5, 1] * 3 + [5] * 6, [5, 3, 9, 4, 20, 1] + [30] * 6,
                           num_tokens=t, num_seqs=s, num_slots=N + 8)
    q, k, v, g, beta, state = random_gdn_inputs(rng, t=t, dv=DV_P, num_slots=N + 8)
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    fn = functools.partial(pallas_gdn.gated_delta_rule, interpret=True, chunk_size=16,
                           block_v=32, decode_max_tokens=4)
    args = (q, k, v, g, beta, state, *rows.args())
    grids = re.findall(r"grid=\((\d+), ", str(jax.make_jaxpr(fn)(*args)))
    assert grids == ["9", "16"]  # prefill, decode
    o, st = fn(*args)
    assert _rel(o, o_ref) < 1e-5
    check_pool(st, state, rows, np.asarray(s_ref))


def test_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, state = random_gdn_inputs(rng, dv=DV_P)
    rows = make_state_rows(rng, [3], [3], num_tokens=T, num_seqs=S, num_slots=N)
    with pytest.raises(ValueError, match="float32"):
        pallas_gdn.gated_delta_rule(q, k, v, g, beta, state.astype(np.float16), *rows.args())
    with pytest.raises(ValueError, match="chunk_size"):
        pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), chunk_size=24)
    with pytest.raises(TypeError):
        pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), chunk=16)


# ---- CUDA lowering (Pallas -> Triton), checked on CPU ---------------------------------------

_HAS_PLUGIN = any(importlib.util.find_spec(m) is not None
                  for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
TRITON = "__gpu$xla.gpu.triton"


def export_for_cuda(fn, *specs):
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*specs)
    return exp.mlir_module()


@pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
@pytest.mark.parametrize(
    "shape",
    [
        # Large linear layers (16 key / 48 value heads of 128), a mixed bucket.
        dict(t=256, s=32, n=40, hk=16, hv=48, dk=128, dv=128, dtype=jnp.bfloat16),
        # Decode-only bucket, float32, per-device heads under tp 4, other tiles.
        dict(t=16, s=16, n=17, hk=4, hv=12, dk=128, dv=128, dtype=jnp.float32,
             cfg=dict(block_v=32, chunk_size=32, decode_max_tokens=1, dot_precision="default")),
        # Nothing a power of two but the head dims.
        dict(t=48, s=12, n=101, hk=2, hv=6, dk=64, dv=64, dtype=jnp.bfloat16),
    ],
    ids=["hk16_hv48", "decode_bucket_tp4", "odd_sizes"],
)
def test_gdn_lowers_for_cuda(shape):
    sds = jax.ShapeDtypeStruct
    t, s, n, hk, hv, dk, dv, dt = (shape[x] for x in ("t", "s", "n", "hk", "hv", "dk", "dv",
                                                     "dtype"))
    specs = (sds((t, hk, dk), dt), sds((t, hk, dk), dt), sds((t, hv, dv), dt),
             sds((t, hv), jnp.float32), sds((t, hv), jnp.float32),
             sds((n, hv, dk, dv), jnp.float32), sds((s + 1,), jnp.int32), sds((s,), jnp.int32),
             sds((s,), jnp.int32))
    text = export_for_cuda(functools.partial(pallas_gdn.gated_delta_rule,
                                             **shape.get("cfg", {})), *specs)
    assert text.count(TRITON) == 2
    assert "gdn_decode" in text and "gdn_prefill" in text


@pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
def test_gdn_with_snapshots_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    t, s, n, hk, hv, d = 64, 16, 100, 16, 32, 128
    specs = (sds((t, hk, d), jnp.bfloat16), sds((t, hk, d), jnp.bfloat16),
             sds((t, hv, d), jnp.bfloat16), sds((t, hv), jnp.float32), sds((t, hv), jnp.float32),
             sds((n, hv, d, d), jnp.float32), sds((s + 1,), jnp.int32), sds((s,), jnp.int32),
             sds((s,), jnp.int32), sds((s, 4), jnp.int32))
    fn = lambda *a: pallas_gdn.gated_delta_rule(*a[:-1], snapshot_slots=a[-1])
    assert export_for_cuda(fn, *specs).count(TRITON) == 2


# ---- per-token snapshots (speculative decoding) ----------------------------------------------

NS, W = 40, 4  # a pool with room for snapshots; verify rows of up to W tokens


def rows_with_snapshots(rng):
    """Verify rows (W tokens, and a shorter one), a decode, a long prefill (no snapshots) and
    padding; snapshot slots disjoint from the rows' slots, a few left -1."""
    rows = make_state_rows(rng, [W, 30, 1, 3, W], [W + 20, 30, 7, 10, W + 5], num_tokens=T,
                           num_seqs=S, num_slots=NS)
    free = np.setdiff1d(np.arange(1, NS), rows.state_slots[: rows.num_seqs])
    snap = rng.permutation(free)[: S * W].reshape(S, W).astype(np.int32)
    snap[4, 2] = -1
    return rows, snap


def test_reference_snapshots_are_the_states_after_each_token():
    """Snapshot i of a verify row == the row's final state had it stopped after token i: what a
    step that accepts i draft tokens must resume from (a draft that is always wrong: i = 0)."""
    rng = np.random.default_rng(21)
    q, k, v, g, beta, state = random_gdn_inputs(rng, num_slots=NS)
    rows, snap = rows_with_snapshots(rng)
    o, s = _ref_gdn()(q, k, v, g, beta, state, *rows.args(), snapshot_slots=snap)
    s = np.asarray(s)
    o_plain, s_plain = _ref_gdn()(q, k, v, g, beta, state, *rows.args())
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_plain))
    written = set()
    for b in (0, 3, 4):  # verify rows (row 4 skips its snapshot 2)
        lo, ql, ctx = rows.query_start[b], rows.query_start[b + 1] - rows.query_start[b], \
            rows.seq_lens[b]
        for i in range(ql):
            if snap[b, i] < 0:
                continue
            short = make_state_rows(rng, [i + 1], [ctx - ql + i + 1], num_tokens=T,
                                    num_seqs=S, num_slots=NS)
            short.state_slots[0] = rows.state_slots[b]
            shift = lambda a: np.roll(a, -lo, axis=0)
            _, s_short = _ref_gdn()(*(shift(a) for a in (q, k, v, g, beta)), state,
                                    *short.args())
            assert _rel(s[snap[b, i]], np.asarray(s_short)[rows.state_slots[b]]) < 1e-6
            written.add(int(snap[b, i]))
    # The last snapshot of a full verify row is its final state; nothing else was written.
    np.testing.assert_array_equal(s[snap[0, W - 1]], s[rows.state_slots[0]])
    written.add(int(snap[2, 0]))  # the decode row's one token
    for slot in range(NS):
        if slot not in written:
            np.testing.assert_array_equal(s[slot], np.asarray(s_plain)[slot])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_snapshots_equal_reference(impl):
    rng = np.random.default_rng(22)
    q, k, v, g, beta, state = random_gdn_inputs(rng, dv=DV_P, num_slots=NS)
    rows, snap = rows_with_snapshots(rng)
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args(), snapshot_slots=snap)
    if impl == "xla":
        o, s = xla_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(),
                                        snapshot_slots=snap, chunk_size=16)
    else:
        o, s = pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(),
                                           snapshot_slots=snap, interpret=True, **SMALL)
    assert _rel(o, o_ref) < 1e-5
    assert _rel(s, s_ref) < 1e-5
    changed = np.flatnonzero(np.any(np.asarray(s_ref) != state, axis=(1, 2, 3)))
    assert len(changed) == rows.num_seqs + W + 1 + 3 + W - 1  # rows + snapshots taken


def test_conv_snapshots_equal_reference_and_shorter_runs():
    rng = np.random.default_rng(23)
    rows, snap = rows_with_snapshots(rng)
    x = rng.standard_normal((T, CONV)).astype(np.float32)
    w = rng.standard_normal((CONV, K)).astype(np.float32)
    pool = rng.standard_normal((NS, CONV, K - 1)).astype(np.float32)
    y_ref, c_ref = _ref_conv()(x, w, None, pool, *rows.args(), snapshot_slots=snap)
    y, c = xla_gdn.causal_conv1d(x, w, None, pool, *rows.args(), snapshot_slots=snap)
    assert _rel(y, y_ref) < 1e-5
    np.testing.assert_allclose(np.asarray(c), np.asarray(c_ref), rtol=0, atol=0)
    b, lo = 0, rows.query_start[0]
    for i in range(W):
        short = make_state_rows(rng, [i + 1], [rows.seq_lens[b] - W + i + 1], num_tokens=T,
                                num_seqs=S, num_slots=NS)
        short.state_slots[0] = rows.state_slots[b]
        _, c_short = _ref_conv()(np.roll(x, -lo, axis=0), w, None, pool, *short.args())
        np.testing.assert_array_equal(np.asarray(c_ref)[snap[b, i]],
                                      np.asarray(c_short)[rows.state_slots[b]])


# ---- the same checks natively on a GPU (`-m gpu`) --------------------------------------------

def _gpu_available():
    try:
        return any(dev.platform == "gpu" for dev in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU backend")
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-4), (jnp.bfloat16, 2e-2)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("seed", range(3))
def test_pallas_gdn_gpu(seed, dtype, tol):
    """Default tiles, head dims of 128, chunks of 64: long rows, chunks, decodes, snapshots."""
    rng = np.random.default_rng(300 + seed)
    t, s, n = 512, 16, 64
    rows = random_rows(rng, num_tokens=t, num_seqs=s, num_slots=n - 2 * s, long_max=200)
    q, k, v, g, beta, state = random_gdn_inputs(rng, t=t, hk=4, hv=8, dk=128, dv=128,
                                                num_slots=n, dtype=dtype)
    g, beta = g.astype(np.float32), beta.astype(np.float32)
    snap = np.arange(n - 2 * s, n, dtype=np.int32)[: s * 2].reshape(s, 2)
    o_ref, s_ref = _ref_gdn()(q, k, v, g, beta, state, *rows.args(), snapshot_slots=snap)
    o, st = pallas_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(),
                                        snapshot_slots=snap)
    assert _rel(o, o_ref) < tol
    assert _rel(st, s_ref) < tol
    o2, s2 = xla_gdn.gated_delta_rule(q, k, v, g, beta, state, *rows.args(), snapshot_slots=snap)
    assert _rel(o2, o_ref) < tol and _rel(s2, s_ref) < tol


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


def test_state_shapes_match_hf_layer():
    cfg = pytest.importorskip("transformers").Qwen3_5TextConfig(
        hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    layer = hf.Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    shapes = xla_gdn.state_shapes(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8,
                                  conv_kernel=4)
    assert shapes["conv"] == (layer.conv1d.in_channels, layer.conv_kernel_size - 1)
    assert shapes["recurrent"] == (4, 16, 8)


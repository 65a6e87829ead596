"""The C++ CPU kernels (pallas_kernels/cpu_*.cc) against their jnp references: the W8A8
matmul and the paged attention."""
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_kernels, reference
from tests.kernels.test_xla_attention import make_batch, ragged_batches

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="no C++ compiler, or the backend is not the CPU")


def _numpy_reference(x, w, s):
    """Exact integer dots of the two int8 activation terms, then the scales."""
    a = np.maximum(np.abs(x).max(-1, keepdims=True) / 127.0, 1e-12).astype(np.float32)
    hi = np.clip(np.rint(x / a), -127, 127)
    lo = np.clip(np.rint((x / a - hi) * 254.0), -127, 127)
    wt = w.astype(np.int64).T
    acc_hi, acc_lo = hi.astype(np.int64) @ wt, lo.astype(np.int64) @ wt
    return (acc_hi.astype(np.float32) + acc_lo.astype(np.float32) * np.float32(1 / 254)) * a * s


# rows: one (decode), 2-8 (one pass over the weight for all rows: a verify step), the packed
# block path from 9 rows and its odd tail; K: whole 64-byte vectors, a masked tail, and one
# shorter than a vector; N: whole 64-row chunks and not
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (2, 1536, 576), (5, 576, 1536),
                                   (37, 100, 70), (4, 7, 40), (64, 257, 576),
                                   (13, 48, 64), (8, 16, 1536), (9, 40, 576),
                                   (3, 192, 576)])
def test_kernel_matches_reference(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    x[0, : min(k, 3)] = 0.0
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    s = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    y = np.asarray(jax.jit(lambda *a: cpu_kernels.int8_matmul(a[0], [a[1:]])[0])(x, w, s))
    ref = np.asarray(jax.jit(reference.int8_matmul_reference)(x, w, s))
    scale = np.abs(ref).max()
    # the integer sums are exact; only float rounding order differs
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(y, _numpy_reference(x, w, s), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("m", range(1, 10))
def test_few_rows_match_reference_on_ragged_shapes(m):
    """1-5 activation rows take the row-at-a-time loop, 6-8 the one-pass loop over each
    weight row for all of them, 9 the packed path (and its < 16-row tail). Odd K (a masked
    tail) and odd N (a tail of weight rows in each 64-row chunk and at the end)."""
    rng = np.random.default_rng(100 + m)
    for n, k in [(rng.integers(1, 200) * 2 + 1, rng.integers(1, 300) * 2 + 1), (77, 129)]:
        x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
        w = rng.integers(-127, 128, (n, k)).astype(np.int8)
        s = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
        y = np.asarray(cpu_kernels.int8_matmul(jnp.asarray(x), [(w, s)])[0])
        ref = np.asarray(reference.int8_matmul_reference(x, w, s))
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        np.testing.assert_allclose(y, _numpy_reference(x, w, s), rtol=0,
                                   atol=1e-5 * np.abs(ref).max())


def test_kernel_shares_one_input_between_weights():
    """Three weights in one call (q/k/v) give each weight's own matmul."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    ws = [(rng.integers(-127, 128, (n, 576)).astype(np.int8),
           rng.uniform(0.01, 0.1, n).astype(np.float32)) for n in (576, 192, 192)]
    ys = jax.jit(cpu_kernels.int8_matmul)(x, ws)
    assert [y.shape for y in ys] == [(3, 576), (3, 192), (3, 192)]
    for y, (w, s) in zip(ys, ws):
        ref = np.asarray(reference.int8_matmul_reference(x, w, s))
        np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_all_zero_rows_give_zeros():
    x = np.zeros((2, 128), np.float32)
    w = np.ones((8, 128), np.int8)
    s = np.ones(8, np.float32)
    y = np.asarray(cpu_kernels.int8_matmul(jnp.asarray(x), [(w, s)])[0])
    assert np.all(y == 0)


# ----------------------------------------------------------------------------- argmax

@pytest.mark.parametrize("v", [1, 15, 16, 17, 100, 49155])
def test_argmax_matches_jnp_argmax(v):
    """Random rows, a tied maximum (the first wins), a NaN (the first NaN wins), all -inf,
    +inf, and 0.0 against -0.0 (equal): the kernel gives jnp.argmax's index, in a masked
    tail too."""
    rng = np.random.default_rng(v)
    x = rng.standard_normal((9, v)).astype(np.float32)
    j = int(rng.integers(0, v))
    x[1, j] = x[1, (j + 1) % v] = x[1].max() + 1  # tie
    x[2, [v - 1, j]] = np.nan
    x[3] = -np.inf
    x[4, v - 1] = np.inf
    x[5] = -1.0
    x[5, j], x[5, v - 1] = -0.0, 0.0
    x[6, v - 1] = 50.0  # the last element, in the tail
    x[7, 0] = 50.0
    got = np.asarray(jax.jit(cpu_kernels.argmax)(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert got[6] == v - 1 and got[2] == min(j, v - 1)


def test_argmax_batched_and_under_vmap():
    """Leading axes are rows; vmap (the batch as more rows) and a 1-D row work too."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 4, 301)).astype(np.float32))
    want = np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(cpu_kernels.argmax(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(cpu_kernels.argmax))(x)), want)
    assert int(cpu_kernels.argmax(x[0, 0, 0])) == int(want[0, 0, 0])
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.argmax(x.astype(jnp.bfloat16))


# ----------------------------------------------------------------------------- attention

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=ragged_batches(),
    groups=st.sampled_from([1, 3]),
    window_cap=st.sampled_from([(None, None), (5, None), (None, 7.0), (6, 5.0)]),
    pass_num_seqs=st.booleans(),
    page_dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_attention_matches_reference(batch, groups, window_cap, pass_num_seqs, page_dtype, seed):
    """Random ragged batches (decodes, prefill chunks, padding rows and tokens, stale block
    table entries), float32 or bfloat16 pages: the kernel equals the jnp reference (which
    reads the pages as float32), padding tokens come back zero."""
    sliding_window, soft_cap = window_cap
    t_bucket, s_bucket, q_lens, ctx_lens = batch
    rng = np.random.default_rng(seed)
    q, kp, vp, qs, sl, bt = make_batch(rng, q_lens, ctx_lens, t_bucket, s_bucket, groups,
                                       jnp.float32)
    kp, vp = kp.astype(page_dtype), vp.astype(page_dtype)
    num_seqs = jnp.int32(len(q_lens)) if pass_num_seqs else None
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)
    ref = jax.jit(functools.partial(reference.ragged_paged_attention, **kw))(q, kp, vp, qs, sl,
                                                                             bt)
    out = jax.jit(functools.partial(cpu_kernels.paged_attention, **kw))(q, kp, vp, qs, sl, bt,
                                                                        num_seqs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[sum(q_lens):] == 0)


def _slots(rng, q_lens, ctx_lens, bt, t_bucket, n_slots):
    """Each new token's slot (page * PAGE + offset) from its row's block table; padding
    tokens go to the trash page (slot 0..PAGE-1), one to a negative slot (counts from the end)."""
    from tests.kernels.test_xla_attention import PAGE

    bt = np.asarray(bt)
    slots = list(rng.integers(0, PAGE, t_bucket - sum(q_lens)))
    if slots:
        slots[0] = -1 - int(rng.integers(0, PAGE))
    out = []
    for i, (ql, c) in enumerate(zip(q_lens, ctx_lens)):
        out += [int(bt[i, p // PAGE]) * PAGE + p % PAGE for p in range(c - ql, c)]
    return jnp.asarray(np.array(out + slots, np.int32))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=ragged_batches(),
    groups=st.sampled_from([1, 3]),
    window_cap=st.sampled_from([(None, None), (5, None), (6, 5.0)]),
    page_dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_write_and_attend_matches_write_kv_then_reference(batch, groups, window_cap, page_dtype,
                                                          seed):
    """The fused KV write + attention equals ``reference.write_kv`` then the reference
    attention: the same pages after (every slot, the trash page and a negative slot too;
    bfloat16 pages bit for bit, so the kernel rounds to nearest even as XLA's convert does)
    and the same outputs, which read the tokens written in the same call."""
    sliding_window, soft_cap = window_cap
    t_bucket, s_bucket, q_lens, ctx_lens = batch
    rng = np.random.default_rng(seed)
    q, kp, vp, qs, sl, bt = make_batch(rng, q_lens, ctx_lens, t_bucket, s_bucket, groups,
                                       jnp.float32)
    kp, vp = kp.astype(page_dtype), vp.astype(page_dtype)
    hkv, d = kp.shape[0], kp.shape[-1]
    k = jnp.asarray(rng.standard_normal((t_bucket, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t_bucket, hkv, d)), jnp.float32)
    slots = _slots(rng, q_lens, ctx_lens, bt, t_bucket, kp.shape[1] * kp.shape[2])
    kw = dict(sm_scale=0.25, sliding_window=sliding_window, soft_cap=soft_cap)

    @jax.jit
    def ref(q, k, v, kp, vp, slots, qs, sl, bt):
        kp, vp = reference.write_kv(kp, vp, k, v, slots)
        return reference.ragged_paged_attention(q, kp, vp, qs, sl, bt, **kw), kp, vp

    fused = jax.jit(functools.partial(cpu_kernels.write_and_attend, **kw), donate_argnums=(3, 4))
    r_out, r_kp, r_vp = ref(q, k, v, kp, vp, slots, qs, sl, bt)
    out, f_kp, f_vp = fused(q, k, v, jnp.array(kp), jnp.array(vp), slots, qs, sl, bt,
                            jnp.int32(len(q_lens)))
    assert f_kp.dtype == f_vp.dtype == jnp.dtype(page_dtype)
    np.testing.assert_array_equal(np.asarray(f_kp.astype(jnp.float32)),
                                  np.asarray(r_kp.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(f_vp.astype(jnp.float32)),
                                  np.asarray(r_vp.astype(jnp.float32)))
    assert not np.array_equal(np.asarray(f_kp.astype(jnp.float32)),
                              np.asarray(kp.astype(jnp.float32)))  # something was written
    n = sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(r_out)[:n], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[n:] == 0)


def test_calls_from_two_threads_at_once_give_each_its_own_result():
    """The kernels' helper team serves one call at a time; a call made meanwhile from another
    thread runs on its caller alone. Both threads' results equal the reference."""
    import threading

    rng = np.random.default_rng(7)
    cases = []
    for m in (1, 37):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        w = rng.integers(-127, 128, (1536, 576)).astype(np.int8)
        s = rng.uniform(1e-3, 1e-1, 1536).astype(np.float32)
        cases.append((x, w, s, np.asarray(reference.int8_matmul_reference(x, w, s))))
    fn = jax.jit(lambda *a: cpu_kernels.int8_matmul(a[0], [a[1:]])[0])
    for x, w, s, _ in cases:
        fn(x, w, s).block_until_ready()  # compiled before the threads start
    errors = []

    def work(x, w, s, ref):
        try:
            for _ in range(30):
                y = np.asarray(fn(x, w, s))
                np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

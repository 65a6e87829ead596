"""The C++ W8A8 kernel (pallas_kernels/cpu_int8_matmul.cc) against its jnp reference."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_int8

pytestmark = pytest.mark.skipif(not cpu_int8.available(),
                                reason="no C++ compiler, or the backend is not the CPU")


def _numpy_reference(x, w, s):
    """Exact integer dots of the two int8 activation terms, then the scales."""
    a = np.maximum(np.abs(x).max(-1, keepdims=True) / 127.0, 1e-12).astype(np.float32)
    hi = np.clip(np.rint(x / a), -127, 127)
    lo = np.clip(np.rint((x / a - hi) * 254.0), -127, 127)
    wt = w.astype(np.int64).T
    acc_hi, acc_lo = hi.astype(np.int64) @ wt, lo.astype(np.int64) @ wt
    return (acc_hi.astype(np.float32) + acc_lo.astype(np.float32) * np.float32(1 / 254)) * a * s


# rows: one (decode), the 4-row block path and its odd tail; K: whole 64-byte vectors, a
# masked tail, and one shorter than a vector; N: whole 64-row chunks and not
@pytest.mark.parametrize("m,n,k", [(1, 192, 576), (2, 1536, 576), (5, 576, 1536),
                                   (37, 100, 70), (4, 7, 40), (64, 257, 576)])
def test_kernel_matches_reference(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))).astype(np.float32)
    x[0, : min(k, 3)] = 0.0
    w = rng.integers(-127, 128, (n, k)).astype(np.int8)
    s = rng.uniform(1e-3, 1e-1, n).astype(np.float32)
    y = np.asarray(jax.jit(lambda *a: cpu_int8.int8_matmul(a[0], [a[1:]])[0])(x, w, s))
    ref = np.asarray(jax.jit(cpu_int8.int8_matmul_reference)(x, w, s))
    scale = np.abs(ref).max()
    # the integer sums are exact; only float rounding order differs
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(y, _numpy_reference(x, w, s), rtol=0, atol=1e-5 * scale)


def test_kernel_shares_one_input_between_weights():
    """Three weights in one call (q/k/v) give each weight's own matmul."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 576)).astype(np.float32)
    ws = [(rng.integers(-127, 128, (n, 576)).astype(np.int8),
           rng.uniform(0.01, 0.1, n).astype(np.float32)) for n in (576, 192, 192)]
    ys = jax.jit(cpu_int8.int8_matmul)(x, ws)
    assert [y.shape for y in ys] == [(3, 576), (3, 192), (3, 192)]
    for y, (w, s) in zip(ys, ws):
        ref = np.asarray(cpu_int8.int8_matmul_reference(x, w, s))
        np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_all_zero_rows_give_zeros():
    x = np.zeros((2, 128), np.float32)
    w = np.ones((8, 128), np.int8)
    s = np.ones(8, np.float32)
    y = np.asarray(cpu_int8.int8_matmul(jnp.asarray(x), [(w, s)])[0])
    assert np.all(y == 0)

"""Batch-invariant numerics (``--batch-invariant``, ``VLLM_BATCH_INVARIANT=1``): a token's
results do not depend on how many other rows share its step (the token bucket), so a request's
logprobs are bit-identical alone, beside any neighbours, or split by chunked prefill.

On XLA:CPU the matmuls of the step (``x @ W.T``) and the C++ attention kernel (one task per
token and KV head, no split of the context) already reduce in an order fixed by the shapes of
one row; what moves with the number of rows is XLA's row reductions (a mean over the hidden size, a sum over the vocabulary), whose loop
emitter changes its vectorisation with the row count. In this mode those reductions are a
fixed binary tree of elementwise adds over the reduced axis (:func:`row_sum`): the same adds in
the same order for every row, whatever the batch.

A tree padded to a power of two is not enough: XLA fuses the padding with the adds differently
in the smallest buckets; the tree here carries an odd entry to the next level instead. And the
dots of a 16-row bucket are emitted another way than those of 32 rows and more at SmolLM2's
shapes (bit-identity fails there, not at the tiny test model's): in this mode the smallest
token bucket is :data:`MIN_TOKEN_BUCKET`, which is most of the mode's cost when decode batches
are smaller than that (``benchmarks/batch_invariance.py``).

The mode is read while tracing (:func:`mode` around a jitted step's trace); every jitted
function whose trace reads it takes the flag in its cache key, so an engine in the default mode
never reuses an invariant trace, nor the reverse.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import jax.numpy as jnp

_STATE = threading.local()
MIN_TOKEN_BUCKET = 32


@contextmanager
def mode(on: bool):
    """Trace the block's code in batch-invariant mode (``on``) or not."""
    prev = getattr(_STATE, "on", False)
    _STATE.on = bool(on)
    try:
        yield
    finally:
        _STATE.on = prev


def enabled() -> bool:
    return getattr(_STATE, "on", False)


def row_sum(x, keepdims: bool = False):
    """Sum over the last axis as a fixed binary tree of adds: halves added elementwise, an odd
    entry carried to the next level."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        h = n // 2
        y = x[..., :h] + x[..., h:2 * h]
        x = jnp.concatenate([y, x[..., 2 * h:]], axis=-1) if n % 2 else y
    return x if keepdims else x[..., 0]


def row_mean(x, keepdims: bool = False):
    return row_sum(x, keepdims) / x.shape[-1]


def logsumexp(x):
    """``logsumexp`` over the last axis with :func:`row_sum` (the max is exact anyway)."""
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.log(row_sum(jnp.exp(x - m))) + m[..., 0]


def log_softmax(x):
    return x - logsumexp(x)[..., None]

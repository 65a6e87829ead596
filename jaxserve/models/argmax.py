"""The greedy pick over the vocabulary: ``jnp.argmax(x, axis=-1)`` as int32, by the C++ kernel
on one CPU device (``pallas_kernels.cpu_kernels.argmax``). XLA:CPU's argmax is a (value,
index) pair reduction that costs ~0.23 ms a row over SmolLM2's 49,152 logits, about 1.5 % of
a decode step and 4 rows' worth in a speculative verify step; the kernel reads the row twice
from cache. Same rule elsewhere: the first index of the maximum, the first NaN if any."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import cpu_kernels


def argmax(x):
    """``x [..., V]`` -> int32 ``[...]``: each row's first maximum (float32 through the kernel
    where it is available; other dtypes and backends through ``jnp.argmax``)."""
    if x.dtype == jnp.float32 and x.shape[-1] > 0 and cpu_kernels.available():
        return cpu_kernels.argmax(x)
    return jnp.argmax(x, axis=-1).astype(jnp.int32)

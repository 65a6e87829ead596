"""The attention backend: which kernel runs ragged paged attention, chosen once.

``resolve_attention_backend(name)`` resolves ``--attention-backend`` when the engine builds the
model (importing that kernel's module then); the model keeps the object and hands it to its layers,
which call ``attend`` (pages another layer wrote) or ``write_and_attend`` (this step's K/V into
the layer's pages, then attention). Backends are frozen and hashable: the model's graph is a
jit cache key, and a layer's jitted attention is cached per backend.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax

from pallas_kernels import cpu_kernels, reference
from pallas_kernels.reference import write_kv

# "pallas": Pallas-Triton; "mosaic": Pallas Mosaic GPU (Hopper, bf16/f16); "triton": Triton's
# language through jax_triton (GPU only); "xla": plain XLA, the C++ kernel on the CPU.
ATTENTION_BACKENDS = ("reference", "pallas", "xla", "mosaic", "triton")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One kernel family's ``ragged_paged_attention(q, k_pages, v_pages, query_start,
    seq_lens, block_tables, num_seqs, *, sm_scale, sliding_window, soft_cap[, kv_scale]
    [, kv_limit])``."""

    name: str
    kernel: Callable

    def attend(self, q, k_pages, v_pages, md, *, sm_scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None,
               kv_scale=None):
        """Attention of ``q [T, Hq, D]`` over the pages; ``kv_scale``: the ``[Hkv, 2]`` scales
        of float8 pages; ``md.kv_limit``: each token's last visible position, None: causal
        (``pallas_kernels/reference.py``)."""
        kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if kv_scale is not None:
            kwargs["kv_scale"] = kv_scale
        if md.kv_limit is not None:
            kwargs["kv_limit"] = md.kv_limit
        return self.kernel(q, k_pages, v_pages, md.query_start, md.seq_lens, md.block_tables,
                           md.num_seqs, **kwargs)

    def write_and_attend(self, q, k, v, k_pages, v_pages, md, *, sm_scale: float,
                         sliding_window: int | None, soft_cap: float | None, kv_scale,
                         sharded: bool):
        """Write ``k, v [T, Hkv, D]`` at ``md.slot_mapping``, then :meth:`attend`.
        ``sharded``: called per shard of heads under a mesh. -> (out, k_pages, v_pages)."""
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, md.slot_mapping, kv_scale=kv_scale)
        out = self.attend(q, k_pages, v_pages, md, sm_scale=sm_scale,
                          sliding_window=sliding_window, soft_cap=soft_cap, kv_scale=kv_scale)
        return out, k_pages, v_pages


@dataclasses.dataclass(frozen=True)
class XlaBackend(AttentionBackend):
    """Plain XLA, except where the C++ kernel serves (``cpu_attention_kernel``): then the
    attention, and on one device the KV write with it, run in the kernel."""

    def attend(self, q, k_pages, v_pages, md, *, sm_scale: float,
               sliding_window: int | None = None, soft_cap: float | None = None,
               kv_scale=None):
        if cpu_attention_kernel(k_pages, kv_scale):
            return cpu_kernels.paged_attention(
                q, k_pages, v_pages, md.query_start, md.seq_lens, md.block_tables, md.num_seqs,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                kv_limit=md.kv_limit)
        return super().attend(q, k_pages, v_pages, md, sm_scale=sm_scale,
                              sliding_window=sliding_window, soft_cap=soft_cap,
                              kv_scale=kv_scale)

    def write_and_attend(self, q, k, v, k_pages, v_pages, md, *, sm_scale: float,
                         sliding_window: int | None, soft_cap: float | None, kv_scale,
                         sharded: bool):
        if not sharded and cpu_attention_kernel(k_pages, kv_scale):
            return cpu_kernels.write_and_attend(
                q, k, v, k_pages, v_pages, md.slot_mapping, md.query_start, md.seq_lens,
                md.block_tables, md.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                soft_cap=soft_cap, kv_limit=md.kv_limit)
        return super().write_and_attend(q, k, v, k_pages, v_pages, md, sm_scale=sm_scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap,
                                        kv_scale=kv_scale, sharded=sharded)


def cpu_attention_kernel(k_pages, kv_scale) -> bool:
    """The C++ attention kernel serves the "xla" backend: float32 or bfloat16 pages, no KV
    scales, the kernels built (``pallas_kernels.cpu_kernels``), ``JAXSERVE_CPU_ATTENTION``
    not 0."""
    return (kv_scale is None and k_pages.dtype in cpu_kernels.PAGE_DTYPES
            and cpu_kernels.available()
            and os.environ.get("JAXSERVE_CPU_ATTENTION") != "0")


def _reference() -> AttentionBackend:
    return AttentionBackend("reference", reference.ragged_paged_attention)


def _pallas() -> AttentionBackend:
    from pallas_kernels import ragged_paged_attention as rpa

    def kernel(*args, **kwargs):  # interpreted where JAX runs on the CPU (decided per trace)
        return rpa.ragged_paged_attention(*args, interpret=jax.default_backend() == "cpu",
                                          **kwargs)

    return AttentionBackend("pallas", kernel)


def _xla() -> AttentionBackend:
    from pallas_kernels import xla_attention

    return XlaBackend("xla", xla_attention.ragged_paged_attention)


def _mosaic() -> AttentionBackend:
    from pallas_kernels import mosaic_gpu_attention

    return AttentionBackend("mosaic", mosaic_gpu_attention.ragged_paged_attention)


def _triton() -> AttentionBackend:
    from pallas_kernels import triton_attention

    return AttentionBackend("triton", triton_attention.ragged_paged_attention)


_BUILDERS = {"reference": _reference, "pallas": _pallas, "xla": _xla, "mosaic": _mosaic,
             "triton": _triton}
_RESOLVED: dict[str, AttentionBackend] = {}


def resolve_attention_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """The backend named by ``--attention-backend`` (one object per name, so models built
    with the same name share jit caches); an ``AttentionBackend`` is returned as is."""
    if isinstance(backend, AttentionBackend):
        return backend
    if backend not in _BUILDERS:
        raise ValueError(f"attention_backend {backend!r} is not one of {ATTENTION_BACKENDS}")
    if backend not in _RESOLVED:
        _RESOLVED[backend] = _BUILDERS[backend]()
    return _RESOLVED[backend]

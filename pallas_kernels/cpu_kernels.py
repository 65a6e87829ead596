"""C++ kernels for XLA:CPU through jax.ffi: the W8A8 int8 matmul and causal paged attention
(over float32 or bfloat16 pages).

* ``cpu_int8_matmul.cc``: XLA:CPU runs a one-row int8 dot well below the machine's read
  bandwidth, and the two-term activation quantization around it is a dozen small ops per
  projection; the kernel does both in one call, reading each int8 weight once with AVX-512
  VNNI where the CPU has it. One call takes up to three weights that share an input (q/k/v,
  gate/up), so the activation is quantized once for them.
* ``cpu_team.h``: helper threads shared by both, polling briefly between calls (a decode
  step makes ~150 short calls; waking a parked pool thread for each costs as much as its share).
* ``cpu_argmax.cc``: the greedy sampler's argmax over the vocabulary; XLA:CPU's (value,
  index) pair reduction takes ~0.23 ms a row over 49,152 logits, the kernel ~0.02 ms.
* ``cpu_attention.cc``: XLA's loop attention (``xla_attention.py``) costs a few dozen small
  ops per loop trip and gathers whole chunks of pages; the kernel reads only each token's
  own positions.

The kernels are built on first use with the machine's C++ compiler (``$CXX`` or g++, ``-O3
-march=native``) into ``~/.cache/jaxserve/kernels`` (one file per source, flags, jaxlib and
CPU), and registered as an FFI target. Where there is no compiler, the build fails, the
backend is not the CPU, or ``JAXSERVE_CPU_KERNELS=0``, :func:`available` is False and
callers use the XLA path (``reference.int8_matmul_reference``, ``xla_attention``,
``jnp.argmax``: the same rules).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(os.path.abspath(__file__))
_SRCS = [os.path.join(_DIR, f)
         for f in ("cpu_int8_matmul.cc", "cpu_attention.cc", "cpu_argmax.cc")]
_HEADERS = [os.path.join(_DIR, "cpu_team.h")]
_MATMUL = "jaxserve_int8_matmul"
_ATTENTION = "jaxserve_paged_attention"
_WRITE_ATTENTION = "jaxserve_paged_write_attention"
_ARGMAX = "jaxserve_argmax"
# the page dtypes the attention kernel reads (and writes) in place
PAGE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
_lock = threading.Lock()
_state: dict = {}


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _build() -> str | None:
    """The kernels' shared library (built once per sources, flags, jaxlib and CPU), or None."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        logger.info("cpu kernels: no C++ compiler; XLA's paths are used")
        return None
    import jaxlib

    src = b"".join(open(p, "rb").read() for p in [*_SRCS, *_HEADERS])
    key = hashlib.sha256(src + " ".join([cxx, *_FLAGS, jaxlib.__version__, _cpu_tag()])
                         .encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "jaxserve", "kernels")
    out = os.path.join(cache, f"cpu_kernels-{key}.so")
    if os.path.isfile(out):
        return out
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), "-I", _DIR, *_SRCS, "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        err = getattr(e, "stderr", b"") or b""
        logger.warning("cpu kernels: build failed (%s); XLA's paths are used\n%s",
                       e, err.decode(errors="replace")[-2000:])
        os.unlink(tmp)
        return None
    os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same file
    return out


def available() -> bool:
    """The kernels are built and registered, one CPU device is the default backend (XLA
    cannot partition a custom call), and ``JAXSERVE_CPU_KERNELS`` is not 0."""
    if (jax.default_backend() != "cpu" or jax.device_count() != 1
            or os.environ.get("JAXSERVE_CPU_KERNELS") == "0"):
        return False
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _load()
        return _state["ok"]


def prebuild() -> None:
    """Start building (or loading) the kernels on a background thread, so the first trace
    that needs them waits less; a no-op off the CPU."""
    if jax.default_backend() == "cpu" and "ok" not in _state:
        threading.Thread(target=available, name="cpu-kernels-build", daemon=True).start()


def _load() -> bool:
    path = _build()
    if path is None:
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(path)
        for target in [_MATMUL, _ATTENTION, _WRITE_ATTENTION, _ARGMAX]:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)),
                                        platform="cpu")
    except Exception as e:  # a broken cache entry or an ABI mismatch: fall back
        logger.warning("cpu kernels: loading %s failed (%s); XLA's paths are used", path, e)
        return False
    _state["lib"] = lib
    return True


def int8_matmul(x, weights) -> list:
    """``x[M, K]`` float32 against each ``(weight[N, K] int8, weight_scale[N] float32)`` of
    ``weights`` (1 to 3 sharing ``x``) -> a float32 ``[M, N]`` per weight, by the kernel.
    Same rule as ``reference.int8_matmul_reference``; call only where :func:`available`."""
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"1 to 3 weights per call, got {len(weights)}")
    m = x.shape[0]
    outs = [jax.ShapeDtypeStruct((m, w.shape[0]), jnp.float32) for w, _ in weights]
    args = [x.astype(jnp.float32)]
    for w, s in weights:
        args += [w, s.astype(jnp.float32)]
    res = jax.ffi.ffi_call(_MATMUL, outs)(*args)
    return list(res)


def argmax(x):
    """``jnp.argmax(x, axis=-1)`` as int32 for float32 ``x [..., V]`` by the kernel: the first
    index of each row's maximum, the first NaN where a row has one. Under ``vmap`` the kernel
    takes the batch axis as more rows."""
    if x.dtype != jnp.float32:
        raise ValueError(f"argmax: float32 logits, got {x.dtype}")
    return jax.ffi.ffi_call(_ARGMAX, jax.ShapeDtypeStruct(x.shape[:-1], jnp.int32),
                            vmap_method="broadcast_all")(x)


def _rows(query_start, seq_lens, num_seqs):
    """The step's row metadata as the kernels take it (they derive each token's row and
    position from it, by ``reference.token_metadata``'s rule)."""
    n = seq_lens.shape[0] if num_seqs is None else num_seqs
    return (query_start.astype(jnp.int32), seq_lens.astype(jnp.int32),
            jnp.asarray(n, jnp.int32).reshape(1))


def _limit(kv_limit):
    """The visibility limits as the kernel takes them: ``[T]``, or empty for causal."""
    return (jnp.zeros((0,), jnp.int32) if kv_limit is None
            else jnp.asarray(kv_limit).astype(jnp.int32))


def _attrs(sm_scale, sliding_window, soft_cap) -> dict:
    return dict(sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
                window=np.int64(sliding_window or 0))


def paged_attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, num_seqs=None, *,
                    sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, kv_limit=None):
    """``reference.ragged_paged_attention`` (float32 or bfloat16 pages, no KV scales) by the
    C++ kernel: each token of the step (``q [T, Hq, D]``) against its row's pages up to its
    position (or its ``kv_limit``, reference.py). Bfloat16 pages are read as they are (no float32 copy of the pool)."""
    out = jax.ffi.ffi_call(_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k_pages, v_pages, block_tables.astype(jnp.int32),
        *_rows(query_start, seq_lens, num_seqs), _limit(kv_limit),
        **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype)


def write_and_attend(q, k, v, k_pages, v_pages, slot_mapping, query_start, seq_lens,
                     block_tables, num_seqs=None, *, sm_scale: float,
                     sliding_window: int | None = None, soft_cap: float | None = None,
                     kv_limit=None):
    """``reference.write_kv`` then :func:`paged_attention` in one kernel call: the new
    ``k, v [T, Hkv, D]`` go into the float32 or bfloat16 pages in place (rounded to nearest
    even for bfloat16; the returned pages alias the given ones; donate them) ->
    ``(out [T, Hq, D], k_pages, v_pages)``. The XLA scatter it replaces costs two small
    multi-threaded ops per layer, more than the write itself."""
    out, k_pages, v_pages = jax.ffi.ffi_call(
        _WRITE_ATTENTION,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32),
         jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
         jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        input_output_aliases={3: 1, 4: 2})(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), k_pages, v_pages,
        slot_mapping.astype(jnp.int32), block_tables.astype(jnp.int32),
        *_rows(query_start, seq_lens, num_seqs), _limit(kv_limit),
        **_attrs(sm_scale, sliding_window, soft_cap))
    return out.astype(q.dtype), k_pages, v_pages

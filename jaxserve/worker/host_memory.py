"""Host memory on the CPU backend: the KV budget, pages resident only once written, and the
process's memory by part.

* Budget: on a CPU the pool holds every ``max_num_seqs`` sequence at ``max_model_len``
  (``kv_cache_config.kv_cache_config``), capped by :func:`cpu_kv_cache_bytes`: ``$JAXSERVE_CPU_KVCACHE_SPACE``
  GiB when set (vLLM's ``VLLM_CPU_KVCACHE_SPACE``), else 1/32 of the machine's physical memory
  (so a 16 GiB laptop reserves 512 MiB).
* Residency: :func:`release_pages` hands a freshly zeroed pool's memory back to the kernel
  (``madvise(MADV_DONTNEED)``); a private anonymous page reads as zeros afterwards and becomes
  resident again only when written. A step writes only the pages of its sequences (and the
  trash page), so the process's RSS grows with the pages in use, not with the pool.
* Report: :func:`memory_report` splits the resident set into weights, KV pages (reserved and
  resident), and the rest (the runtime, compiled programs, Python).

Only Linux has ``/proc`` and ``madvise`` here; elsewhere every function is a no-op or returns
``None`` for what it cannot measure.
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)

KV_SPACE_ENV = "JAXSERVE_CPU_KVCACHE_SPACE"
RAM_FRACTION = 1 / 32  # of physical memory, the CPU pool's cap when the variable is unset
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_cache_bytes() -> int:
    """The cap of the CPU KV pool: ``$JAXSERVE_CPU_KVCACHE_SPACE`` GiB, else
    :data:`RAM_FRACTION` of physical memory (1 GiB where that is unknown)."""
    env = os.environ.get(KV_SPACE_ENV)
    if env:
        try:
            gib = float(env)
        except ValueError:
            raise ValueError(f"{KV_SPACE_ENV} must be a number of GiB, got {env!r}") from None
        if gib <= 0:
            raise ValueError(f"{KV_SPACE_ENV} must be > 0 GiB, got {env!r}")
        return int(gib * (1 << 30))
    ram = physical_memory_bytes()
    return int(ram * RAM_FRACTION) if ram else 1 << 30


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _interior(ptr: int, nbytes: int) -> tuple[int, int]:
    """The whole OS pages inside ``[ptr, ptr + nbytes)``: (start, length)."""
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    return start, max(end - start, 0)


def _cpu_buffers(arrays):
    """(pointer, bytes) of each single-device CPU array among ``arrays`` (pytree leaves)."""
    import jax

    for x in jax.tree_util.tree_leaves(arrays):
        if not isinstance(x, jax.Array):
            continue
        try:  # another thread may donate it meanwhile (warm-up runs beside serving)
            if x.is_deleted() or len(x.devices()) != 1:
                continue
            if next(iter(x.devices())).platform != "cpu":
                continue
            yield x.unsafe_buffer_pointer(), x.nbytes
        except Exception:  # noqa: BLE001 - a donated or deleted buffer: nothing to do
            continue


def release_pages(arrays) -> int:
    """Give the whole OS pages of zero-filled CPU arrays back to the kernel; they read as zeros
    and become resident again when written. Only for arrays that hold zeros and nothing else
    aliases (a fresh pool). Returns the bytes released (0 off Linux or off the CPU)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "madvise"):
        return 0
    done = 0
    for ptr, nbytes in _cpu_buffers(arrays):
        start, length = _interior(ptr, nbytes)
        if length and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length),
                                   _MADV_DONTNEED) == 0:
            done += length
    return done


def resident_bytes(arrays) -> int | None:
    """Bytes of the CPU arrays' memory that is resident (``mincore``), None off Linux."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mincore"):
        return None
    total = 0
    for ptr, nbytes in _cpu_buffers(arrays):
        start, length = _interior(ptr, nbytes)
        if not length:
            continue
        vec = np.zeros(length // _PAGE, np.uint8)
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length),
                        vec.ctypes.data_as(ctypes.c_void_p)) != 0:
            return None
        total += int(np.count_nonzero(vec & 1)) * _PAGE
    return total


def rss_bytes() -> int | None:
    """This process's resident set (``VmRSS``), None where ``/proc`` is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def trim() -> None:
    """Return the C heap's free memory to the kernel (glibc ``malloc_trim``); a no-op
    elsewhere. Start-up's loads and compiles leave megabytes free in the heap."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


CORE_MALLOC_ARENAS = 2  # C-heap arenas of the engine core (glibc's default: 8 per core)
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def limit_malloc_arenas(n: int = CORE_MALLOC_ARENAS) -> bool:
    """At most ``n`` glibc malloc arenas in this process, unless ``$MALLOC_ARENA_MAX`` says how
    many (glibc read it at start). Each thread that allocates (XLA's compile and run threads)
    otherwise takes an arena of its own, up to 8 per core, and a temporary freed in one stays
    there; the compile threads' temporaries left tens of MiB in arenas that trimming after
    warm-up did not return. Call before the threads start. True when the limit was set."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, int(n)))


def memory_report(weight_bytes: int, kv_pages) -> dict:
    """The process's memory by part, in bytes: ``rss``, ``weights``, ``kv_reserved`` (the
    pool), ``kv_resident`` (its pages written so far) and ``rest`` (rss - weights -
    kv_resident: the runtime, compiled programs, Python). None for what cannot be measured."""
    import jax

    reserved = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(kv_pages))
    rss = rss_bytes()
    resident = resident_bytes(kv_pages)
    kv_in_rss = reserved if resident is None else resident
    rest = None if rss is None else rss - weight_bytes - kv_in_rss
    return dict(rss=rss, weights=weight_bytes, kv_reserved=reserved, kv_resident=resident,
                rest=rest)


def _nbytes(x) -> int:
    """An array's size in bytes, from its shape and dtype (readable after donation too)."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    return 0 if shape is None or dtype is None else int(np.prod(shape)) * np.dtype(dtype).itemsize


def format_report(report: dict) -> str:
    def mib(v):
        return "?" if v is None else f"{v / 2**20:.0f} MiB"

    return (f"RSS {mib(report['rss'])} = weights {mib(report['weights'])} + KV pages "
            f"{mib(report['kv_resident'])} resident (of {mib(report['kv_reserved'])} reserved)"
            f" + the rest (runtime, compiled programs, Python) {mib(report['rest'])}")


# the last memory report of this process, by part, in bytes
LAST_REPORT: dict = {}
_REPORT_AT = [float("-inf")]
REPORT_MAX_AGE_S = 5.0  # /metrics and the stats log see a report at most this old


def memory_by_part(runner) -> dict:
    """:func:`memory_report` of ``runner`` for the engine's stats, measured at most every
    :data:`REPORT_MAX_AGE_S` seconds (``mincore`` over the pool costs milliseconds; stats are
    read every step). Off the CPU ``rss`` is the host process's, and weights and KV are device
    bytes."""
    import time

    now = time.monotonic()
    if now - _REPORT_AT[0] >= REPORT_MAX_AGE_S or not LAST_REPORT:
        try:
            _measure(runner)
        except Exception:  # noqa: BLE001 - stats never stop the engine; the next call retries
            logger.debug("memory report skipped", exc_info=True)
        _REPORT_AT[0] = now
    return {k: v for k, v in LAST_REPORT.items() if v is not None}


def _measure(runner) -> None:
    """One report into :data:`LAST_REPORT`. Runs beside a warm-up that may donate the pool:
    it reads shapes, and skips buffers deleted meanwhile."""
    import jax

    weights = sum(_nbytes(x) for x in runner.weight_leaves())
    if jax.default_backend() == "cpu":
        report = memory_report(weights, runner.kv_pages)
    else:
        reserved = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(runner.kv_pages))
        report = dict(rss=rss_bytes(), weights=weights, kv_reserved=reserved, kv_resident=None,
                      rest=None)
    LAST_REPORT.clear()
    LAST_REPORT.update(report)


def log_memory(runner, when: str = "after warm-up") -> dict | None:
    """On the CPU backend: trim the C heap, then log :func:`memory_report` of ``runner``
    (its parameters and KV pages) and keep it in :data:`LAST_REPORT`. A no-op elsewhere
    (device memory is not the process's RSS)."""
    import jax

    if jax.default_backend() != "cpu":
        return None
    trim()
    weights = sum(x.nbytes for x in runner.weight_leaves() if hasattr(x, "nbytes"))
    report = memory_report(weights, runner.kv_pages)
    LAST_REPORT.clear()
    LAST_REPORT.update(report)
    logger.info("memory %s: %s", when, format_report(report))
    return report

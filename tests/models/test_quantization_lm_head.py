"""LM head quantized on request with fp8 (``lm_head_quantized``, vLLM's name): the head's table
becomes int8 with one scale per vocabulary row; a tied embedding table is quantized once and
serves both the embedding gather and the logits; an untied ``lm_head`` is quantized alone. Tiny random checkpoints; SmolLM2 numbers are in
test_quantization.py (``smol_runs``)."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.loaders.model_loader import load_model
from jaxserve.models import quantization as Q

pytest.importorskip("torch")
from tests.models.test_quantization import (  # noqa: E402
    _flat, _float_model_with, _logits, _write_fp8_checkpoint)


def _dequantized_reference(src, flat):
    """The float model of ``src`` with every quantized tensor of ``flat`` replaced by its
    dequantization ``weight * weight_scale[:, None]``."""
    return _float_model_with(src, {
        name[:-len("_scale")]: np.asarray(flat[name[:-len("_scale")]]).astype(np.float32)
        * np.asarray(scale)[:, None]
        for name, scale in flat.items() if name.endswith(".weight_scale")})


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_lm_head_equals_float_model_with_dequantized_table(tiny_model_factory, tied):
    """The table is int8 with one scale per vocabulary entry, equal to the host per-row
    quantization of the checkpoint's table; the gathered embeddings and the logits equal a
    float model carrying the dequantized weights (so the same scales serve gather and head)."""
    from safetensors.numpy import load_file

    src = tiny_model_factory("llama", tie_embeddings=tied)
    model, cfg, _ = load_model(str(src), dtype="float32", quantization="fp8",
                               lm_head_quantized=True)
    flat = _flat(model)
    table = "model.embed_tokens" if tied else "lm_head"
    assert flat[table + ".weight"].dtype == jnp.int8
    assert flat["model.layers.0.mlp.up_proj.weight"].dtype == jnp.float8_e4m3fn
    assert flat[table + ".weight_scale"].shape == (cfg.vocab_size,)
    if tied:
        assert "lm_head.weight" not in flat  # one table, quantized once
    else:  # only the head was asked for
        assert flat["model.embed_tokens.weight"].dtype == jnp.float32
    q, s = Q.quantize_int8_per_row(load_file(str(src / "model.safetensors"))[table + ".weight"])
    np.testing.assert_array_equal(np.asarray(flat[table + ".weight"]), q)
    np.testing.assert_allclose(np.asarray(flat[table + ".weight_scale"]), s, rtol=1e-7)

    ref = _dequantized_reference(src, flat)
    ids = np.random.default_rng(0).integers(5, cfg.vocab_size, 24).astype(np.int32)
    np.testing.assert_allclose(np.asarray(model.model.embed_tokens(jnp.asarray(ids))),
                               np.asarray(ref.model.embed_tokens(jnp.asarray(ids))),
                               rtol=1e-6, atol=1e-7)
    a, b = _logits(model, cfg, ids), _logits(ref, cfg, ids)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))


def test_lm_head_dummy_weights_quantize_on_device(tiny_model_factory):
    """``load_format="dummy"``: the random float table quantized on device equals the host
    per-row quantization of the same table."""
    src = tiny_model_factory("llama", tie_embeddings=True)
    model, _, _ = load_model(str(src), dtype="float32", load_format="dummy")
    w = np.asarray(model.model.embed_tokens.weight.get_value())
    model = Q.quantize_model_fp8(model, Q.QuantPlan("fp8", prequantized=False, lm_head=True))
    emb = model.model.embed_tokens
    q, s = Q.quantize_int8_per_row(w)
    np.testing.assert_allclose(np.asarray(emb.weight_scale.get_value()), s, rtol=1e-6)
    got = np.asarray(emb.weight.get_value())
    assert got.dtype == np.int8  # a value exactly between two steps may round either way
    assert np.abs(got.astype(int) - q).max() <= 1 and np.mean(got == q) > 0.999


def test_int8_table_rounds_finer_than_fp8(tiny_model_factory):
    """Why the head is int8: at the same bytes, per-row int8 has a smaller rounding error than
    per-row fp8 e4m3 on an embedding table (uniform steps against 3 mantissa bits)."""
    from safetensors.numpy import load_file

    w = load_file(str(tiny_model_factory("llama", tie_embeddings=True) / "model.safetensors"))[
        "model.embed_tokens.weight"].astype(np.float32)
    q8, s8 = Q.quantize_int8_per_row(w)
    f8, sf = Q.quantize_fp8_per_channel(w)
    err = [np.sqrt(np.mean((x.astype(np.float32) * s[:, None] - w) ** 2)) for x, s in
           ((q8, s8), (f8, sf))]
    assert err[0] < 0.6 * err[1]


def test_fp8_checkpoint_head_is_quantized_at_load(tiny_llama_dir, tmp_path):
    """An fp8 checkpoint keeps its LM head float (compressed-tensors ``ignore: [lm_head]``);
    asked for, the head is quantized at load: the same tensors as quantizing the float
    checkpoint with the flag. A head stored in fp8 with its scale is dequantized first."""
    ct = _write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ct", style="compressed-tensors")
    a = _flat(load_model(str(ct), dtype="float32", lm_head_quantized=True)[0])
    b = _flat(load_model(str(tiny_llama_dir), dtype="float32", quantization="fp8",
                         lm_head_quantized=True)[0])
    assert sorted(a) == sorted(b) and a["lm_head.weight"].dtype == jnp.int8
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32))

    import torch
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(ct / "model.safetensors"))
    q8, s8 = Q.quantize_fp8_per_channel(tensors["lm_head.weight"].float().numpy())
    tensors["lm_head.weight"] = torch.from_numpy(q8.view(np.uint8).copy()).view(
        torch.float8_e4m3fn)
    tensors["lm_head.weight_scale"] = torch.from_numpy(s8)
    save_file(tensors, str(ct / "model.safetensors"))
    c = _flat(load_model(str(ct), dtype="float32", lm_head_quantized=True)[0])
    want, scale = Q.quantize_int8_per_row(q8.astype(np.float32) * s8[:, None])
    np.testing.assert_array_equal(np.asarray(c["lm_head.weight"]), want)
    np.testing.assert_allclose(np.asarray(c["lm_head.weight_scale"]), scale, rtol=1e-7)


def test_lm_head_quantized_errors_name_the_field(tiny_llama_dir, tmp_path):
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.testing.int4_checkpoint import write_int4_checkpoint

    with pytest.raises(ValueError, match="lm_head_quantized must be true or false"):
        LLM(str(tiny_llama_dir), quantization="fp8", lm_head_quantized="yes")
    with pytest.raises(ValueError, match="lm_head_quantized needs quantization 'fp8'"):
        EngineConfig(quantization="awq", lm_head_quantized=True)
    with pytest.raises(ValueError, match=r"lm_head_quantized needs quantization 'fp8' or 'int8' \(got None"):
        load_model(str(tiny_llama_dir), lm_head_quantized=True)  # a float checkpoint, no method
    gptq = tmp_path / "gptq"
    write_int4_checkpoint(tiny_llama_dir, gptq, "gptq", group_size=32)
    with pytest.raises(ValueError, match="lm_head_quantized needs quantization 'fp8'"):
        load_model(str(gptq), lm_head_quantized=True)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"]["lm_head"] = True
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized LM head"):
        load_model(str(gptq))

    args = build_parser().parse_args(["serve", "demo-random", "-q", "fp8", "--lm-head-quantized"])
    assert engine_config_from_args(args).lm_head_quantized is True
    assert engine_config_from_args(build_parser().parse_args(["serve"])).lm_head_quantized is False

"""GGUF files of the families beyond Llama (gemma2, gemma3, qwen3moe, Mixtral as ``llama`` with
experts, phi3), written the way llama.cpp's converter writes them from a tiny random HF
checkpoint (``jaxserve.testing.hf_to_gguf``), loaded by our GGUF loader and checked against HF
running the original checkpoint: logits of a prompt longer than the sliding window (and past
Phi-3's LongRoPE switch) close, greedy decoding equal (tie-aware). A Q8_0 file checks that each
expert's rows are dequantized from its own slice of the stacked tensor.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM  # noqa: E402

from jaxserve.testing.hf_to_gguf import hf_to_gguf  # noqa: E402

BLOCK = 8
PROMPT = 40  # > the window of 16 (Gemma), > Phi-3's original 32 positions (long factors)
NEW = 8
ATOL = 1e-4
TIE = 1e-4
# family -> config fields GGUF cannot carry, set to what llama.cpp assumes
GGUF_ASSUMES = {
    "gemma2": lambda c: {"query_pre_attn_scalar": c["head_dim"]},
    "gemma3": lambda c: {"query_pre_attn_scalar": c["head_dim"]},
    "qwen3_moe": lambda c: {"norm_topk_prob": True},
}
# qwen2_moe: a shared expert, and a dense layer (a layer without a router)
FAMILIES = ["gemma2", "gemma3", "qwen3_moe", "mixtral", "phi3", "qwen2_moe"]
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "qwen3_moe": "qwen3moe",
             "mixtral": "llama", "phi3": "phi3", "qwen2_moe": "qwen2moe"}


@functools.lru_cache(maxsize=None)
def _step_fn():
    import jax
    from flax import nnx

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, state, token_ids, positions, kv, md):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(token_ids, positions, kv, md)
        return model.compute_logits(hidden), kv

    return step


def _ours(path, prompt, new):
    """Our model from ``path``: logits of the prompt, then ``new`` greedy tokens, one step each."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.loaders.model_loader import load_model
    from jaxserve.testing.paged import metadata, step_inputs
    from jaxserve.worker.kv_cache import allocate_kv_pages

    model, cfg, _ = load_model(str(path), dtype="float32")
    graphdef, state = nnx.split(model)
    n_pages = (len(prompt) + new) // BLOCK + 2
    kv = allocate_kv_pages(cfg, n_pages + 1, BLOCK, jnp.float32)
    pages = list(range(n_pages, 0, -1))  # not in order: the block table matters
    ladder = (64,)  # one bucket: one compile per model
    step = _step_fn()

    def run(ids, start):
        nonlocal kv
        plan = step_inputs([(ids, start, pages)], block_size=BLOCK, max_pages=n_pages,
                           ladder=ladder, max_num_seqs=1)
        md = metadata(plan)
        logits, kv = step(graphdef, state, jnp.asarray(plan.token_ids),
                          jnp.asarray(plan.positions), kv, md)
        return np.asarray(logits)[:len(ids)]

    first = run(prompt, 0)
    out = [int(first[-1].argmax())]
    while len(out) < new:
        out.append(int(run(out[-1:], len(prompt) + len(out) - 1)[-1].argmax()))
    return cfg, first, out


@pytest.fixture(scope="module")
def converted(tiny_model_factory, tmp_path_factory):
    """family -> (HF dir with llama.cpp's assumptions, GGUF path)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}

    def make(family, qtype="F32"):
        key = (family, qtype)
        if key not in out:
            import shutil

            src = tiny_model_factory(family, **({"norm_topk_prob": True}
                                                if family == "qwen3_moe" else {}))
            d = root / f"{family}-hf"
            if not d.exists():
                shutil.copytree(src, d)
                cfg = json.loads((d / "config.json").read_text())
                cfg.update(GGUF_ASSUMES.get(family, lambda c: {})(cfg))
                (d / "config.json").write_text(json.dumps(cfg))
            out[key] = d, hf_to_gguf(d, root / f"{family}-{qtype}.gguf", qtype)
        return out[key]

    return make


@pytest.mark.slow  # ~50 s for the five families (a compile and an HF model each)
@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_family_matches_hf(converted, family):
    hf_dir, path = converted(family)
    reader = gguf.GGUFReader(path)
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == GGUF_ARCH[family]
    vocab = 512
    prompt = np.random.default_rng(7).integers(5, vocab, PROMPT).astype(np.int32)
    cfg, logits, toks = _ours(path, prompt, NEW)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert cfg.architecture == hf.config.architectures[0]
    if family.startswith("gemma"):
        assert cfg.layer_types == tuple(hf.config.layer_types)
        assert cfg.sliding_window == hf.config.sliding_window == 16
    full = np.concatenate([prompt, np.asarray(toks[:-1], np.int32)])
    with torch.no_grad():
        ref = hf(torch.tensor(full[None]).long()).logits[0].numpy()
    np.testing.assert_allclose(logits, ref[:PROMPT], atol=ATOL, rtol=0)
    # greedy, tie-aware: each of our tokens is HF's argmax or within TIE of it on the same prefix
    for i, t in enumerate(toks):
        row = ref[PROMPT - 1 + i]
        assert row[t] >= row.max() - TIE, f"token {i}: {t} vs HF's {int(row.argmax())}"


def test_quantized_experts_dequantize_their_own_slice(converted):
    """Q8_0 Mixtral: each per-expert tensor equals the matching rows of the whole stacked
    tensor dequantized by gguf-py; Q/K still un-permuted; the router stays float32."""
    from jaxserve.loaders.gguf import load_gguf

    hf_dir, path = converted("mixtral", "Q8_0")
    cfg, tensors = load_gguf(path)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    t = by_name["blk.1.ffn_down_exps.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    whole = gguf.quants.dequantize(t.data, t.tensor_type).reshape(8, 64, -1)
    for e in (0, 5, 7):
        got = tensors[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]()
        np.testing.assert_array_equal(got, whole[e])
    from safetensors.numpy import load_file

    orig = load_file(str(hf_dir / "model.safetensors"))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]()
    np.testing.assert_allclose(q, orig["model.layers.0.self_attn.q_proj.weight"], atol=2e-3)
    gate = tensors["model.layers.0.block_sparse_moe.gate.weight"]()
    np.testing.assert_array_equal(gate, orig["model.layers.0.block_sparse_moe.gate.weight"])


def test_gemma_norms_are_stored_plus_one(converted):
    from safetensors.numpy import load_file

    from jaxserve.loaders.gguf import load_gguf

    hf_dir, path = converted("gemma3")
    reader = gguf.GGUFReader(path)
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    orig = load_file(str(hf_dir / "model.safetensors"))
    np.testing.assert_allclose(stored["blk.0.attn_q_norm.weight"],
                               orig["model.layers.0.self_attn.q_norm.weight"] + 1, atol=1e-6)
    _, tensors = load_gguf(path)
    for name in ("model.norm.weight", "model.layers.2.self_attn.k_norm.weight",
                 "model.layers.2.post_feedforward_layernorm.weight"):
        np.testing.assert_allclose(tensors[name](), orig[name], atol=1e-6)


def test_gemma_sliding_window_pattern_metadata(converted, tmp_path):
    """A file that names its local layers (``attention.sliding_window_pattern``, one bool per
    layer) gets exactly those; an all-local Gemma is then windowed in every layer (its pages
    out of the window can be freed)."""
    from jaxserve.config import ModelConfig
    from jaxserve.loaders.gguf import load_gguf

    _, path = converted("gemma3")
    default = ModelConfig.from_hf_config(load_gguf(path)[0])
    assert default.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert default.attention_window() is None
    src = gguf.GGUFReader(path)
    out = tmp_path / "all-local.gguf"
    w = gguf.GGUFWriter(str(out), "gemma3")
    for key, f in src.fields.items():
        if key.startswith("gemma3."):
            v = f.contents()
            getattr(w, {int: "add_uint32", float: "add_float32"}[type(v)])(key, v)
    w.add_array("gemma3.attention.sliding_window_pattern", [True] * 6)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    local = ModelConfig.from_hf_config(load_gguf(out)[0])
    assert local.layer_types == ("sliding_attention",) * 6 and local.attention_window() == 16

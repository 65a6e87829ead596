"""GGUF files of Gemma 4 (``gemma4``) and Qwen 3.5 / 3.6 (``qwen35``, ``qwen35moe``), written
from tiny random HF checkpoints the way llama.cpp's converter writes them
(``jaxserve.testing.hf_to_gguf``), loaded by our GGUF loader and checked against HF running
the original checkpoint: prompt logits close and greedy tokens equal. Also: every tensor name
is one llama.cpp's arch table lists, the stored layouts are llama.cpp's (not HF's), a quantized
file dequantizes each stacked tensor whole, and variants we cannot serve fail naming what.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

from jaxserve.loaders.gguf import load_gguf  # noqa: E402
from jaxserve.testing.hf_to_gguf import hf_to_gguf  # noqa: E402

ARCH = {"gemma4-dense": "gemma4", "gemma4-moe": "gemma4", "qwen35-dense": "qwen35",
        "qwen35-moe": "qwen35moe"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (HF dir, GGUF path); made once per (kind, qtype)."""
    root = tmp_path_factory.mktemp("gguf_hybrid")
    made: dict = {}

    def get(kind: str, qtype: str = "F32"):
        if kind not in made:
            family, variant = kind.split("-")
            if family == "gemma4":
                from jaxserve.testing.tiny_gemma4 import make_tiny_gemma4

                made[kind] = make_tiny_gemma4(root / kind, moe=variant == "moe")
            else:
                from jaxserve.testing.qwen3_5 import make_tiny_qwen3_5

                made[kind] = make_tiny_qwen3_5(root / kind, moe=variant == "moe")
        key = (kind, qtype)
        if key not in made:
            made[key] = hf_to_gguf(made[kind], root / f"{kind}-{qtype}.gguf", qtype)
        return made[kind], made[key]

    return get


def _stored(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data) for t in r.tensors}


# ---------------------------------------------------------------- names, layouts, round trip

@pytest.mark.parametrize("kind", list(ARCH))
def test_names_are_llama_cpps_and_tensors_round_trip(converted, kind):
    """Every tensor is one of the arch's names in gguf-py's tables (llama.cpp's), and the
    loader gives back exactly the HF checkpoint's tensors under HF's names and shapes."""
    from safetensors.numpy import load_file

    hf_dir, path = converted(kind)
    reader = gguf.GGUFReader(path)
    arch = ARCH[kind]
    assert reader.fields["general.architecture"].contents() == arch
    a = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    n = reader.fields[f"{arch}.block_count"].contents()
    allowed = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[a]
               for i in range(n)}
    for t in reader.tensors:
        assert t.name.rsplit(".", 1)[0] in allowed or t.name in allowed, t.name
    cfg, tensors = load_gguf(path)
    orig = load_file(str(hf_dir / "model.safetensors"))
    # the writer stores no MTP head (a llama.cpp file's appended nextn block is skipped on load)
    orig = {k: v for k, v in orig.items() if not k.startswith(("mtp.", "model.mtp."))}
    assert set(tensors) == set(orig)
    for name, load in tensors.items():
        np.testing.assert_allclose(load(), orig[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_gemma4_metadata_and_layouts(converted):
    """Global/local head dims and KV heads, KV sharing, PLE width, the local layers, k_eq_v
    as a global layer without attn_v, proportional rope as rope_freqs; norms stored as they
    are (Gemma 4 scales by w); experts one fused tensor, the router scales as ``.scale``."""
    from safetensors.numpy import load_file

    hf_dir, path = converted("gemma4-moe")
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert (f["gemma4.attention.key_length"], f["gemma4.attention.key_length_swa"]) == (32, 16)
    assert f["gemma4.attention.head_count_kv"] == [2, 2, 1, 2, 2, 1]
    assert f["gemma4.attention.sliding_window_pattern"] == [True, True, False] * 2
    assert f["gemma4.attention.shared_kv_layers"] == 2
    assert f["gemma4.embedding_length_per_layer_input"] == 8
    stored = _stored(path)
    assert "blk.2.attn_k.weight" in stored and "blk.2.attn_v.weight" not in stored
    assert "blk.5.attn_k.weight" not in stored  # a KV-sharing layer
    np.testing.assert_array_equal(stored["rope_freqs.weight"],
                                  np.float32([1.0] * 4 + [1e30] * 12))
    orig = load_file(str(hf_dir / "model.safetensors"))
    np.testing.assert_array_equal(stored["blk.0.attn_q_norm.weight"],
                                  orig["model.layers.0.self_attn.q_norm.weight"])
    assert stored["blk.0.ffn_gate_up_exps.weight"].shape == (4, 64, 64)
    np.testing.assert_array_equal(stored["blk.0.ffn_down_exps.scale"],
                                  orig["model.layers.0.router.per_expert_scale"])
    cfg, _ = load_gguf(path)
    assert cfg["attention_k_eq_v"] and cfg["num_global_key_value_heads"] == 1
    assert cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    assert cfg["num_kv_shared_layers"] == 2 and cfg["top_k_experts"] == 2


def test_qwen35_layouts_are_llama_cpps(converted):
    """``-exp(A_log)``, the squeezed conv kernel, ``1 + w`` zero-centred norms (not the gated
    norm), and V heads tiled (K heads 2 < V heads 4) in qkv, z, a, b, conv and out."""
    from safetensors.numpy import load_file

    hf_dir, path = converted("qwen35-dense")
    stored = _stored(path)
    orig = load_file(str(hf_dir / "model.safetensors"))
    p = "model.layers.0."
    a_log = orig[p + "linear_attn.A_log"]
    tiled = [0, 2, 1, 3]  # V heads k0v0 k0v1 k1v0 k1v1 -> k0v0 k1v0 k0v1 k1v1
    np.testing.assert_allclose(stored["blk.0.ssm_a"], -np.exp(a_log)[tiled], rtol=1e-6)
    np.testing.assert_array_equal(stored["blk.0.ssm_dt.bias"],
                                  orig[p + "linear_attn.dt_bias"][tiled])
    np.testing.assert_array_equal(stored["blk.0.ssm_beta.weight"],
                                  orig[p + "linear_attn.in_proj_b.weight"][tiled])
    z = orig[p + "linear_attn.in_proj_z.weight"].reshape(4, 16, 64)[tiled].reshape(64, 64)
    np.testing.assert_array_equal(stored["blk.0.attn_gate.weight"], z)
    conv = orig[p + "linear_attn.conv1d.weight"]
    assert stored["blk.0.ssm_conv1d.weight"].shape == (128, 4)
    np.testing.assert_array_equal(stored["blk.0.ssm_conv1d.weight"][:64], conv[:64, 0])
    np.testing.assert_allclose(stored["blk.0.attn_norm.weight"],
                               orig[p + "input_layernorm.weight"] + 1, rtol=1e-6)
    np.testing.assert_array_equal(stored["blk.0.ssm_norm.weight"],
                                  orig[p + "linear_attn.norm.weight"])
    cfg, _ = load_gguf(path)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"],
            cfg["linear_value_head_dim"]) == (2, 4, 16)


def test_quantized_stacked_experts_dequantize_whole(converted):
    """Q8_0 Gemma 4 MoE: the fused [E, 2I, H] expert tensor comes back at its shape, close to
    the original; the router stays float32."""
    from safetensors.numpy import load_file

    hf_dir, path = converted("gemma4-moe", "Q8_0")
    r = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert r["blk.1.ffn_gate_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    _, tensors = load_gguf(path)
    orig = load_file(str(hf_dir / "model.safetensors"))
    name = "model.layers.1.experts.gate_up_proj"
    got = tensors[name]()
    assert got.shape == orig[name].shape
    np.testing.assert_allclose(got, orig[name], atol=0.01 * np.abs(orig[name]).max())
    np.testing.assert_array_equal(tensors["model.layers.1.router.proj.weight"](),
                                  orig["model.layers.1.router.proj.weight"])


# ---------------------------------------------------------------- our model on the GGUF vs HF

@pytest.mark.parametrize("kind", ["gemma4-dense", pytest.param("gemma4-moe",
                                                               marks=pytest.mark.slow)])
def test_gemma4_gguf_logits_and_greedy_match_hf(converted, kind):
    from tests.models.test_gemma4 import ATOL, NEW_TOKENS, PROMPT_LEN, Driver, hf_greedy, \
        hf_logits, hf_model

    from jaxserve.testing.tiny_gemma4 import prompt as make_prompt

    hf_dir, path = converted(kind)
    hf = hf_model(hf_dir)
    prompt = make_prompt(PROMPT_LEN, seed=1)  # past the sliding window (16)
    logits, tokens = Driver(path, seed=2).prefill_then_greedy(prompt, NEW_TOKENS)
    np.testing.assert_allclose(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["qwen35-dense", pytest.param("qwen35-moe",
                                                               marks=pytest.mark.slow)])
def test_qwen35_gguf_logits_and_greedy_match_hf(converted, kind):
    """Logits in one step and with the recurrent state carried over three; greedy tokens of the
    engine (chunked prefill) equal HF ``generate``."""
    from tests.models.test_qwen3_5 import ATOL, _engine, _forward_steps, _greedy, _hf, \
        _hf_greedy, _prompts

    hf_dir, path = converted(kind)
    prompt, = _prompts([100])
    with torch.no_grad():
        ref = _hf(hf_dir)(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(_forward_steps(path, prompt, [100]), ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_forward_steps(path, prompt, [70, 71, 100]), ref, atol=ATOL,
                               rtol=0)
    prompts = _prompts([40, 75], seed=3)
    ours = _greedy(_engine(path, tokenizer=str(hf_dir)), prompts, 8)
    assert ours == _hf_greedy(hf_dir, prompts, 8)


# ---------------------------------------------------------------- variants we cannot serve

def _rewrite(src, dst, *, arch=None, fields=None, tensors=None):
    """A copy of ``src`` with the architecture renamed, some fields replaced (value, or
    (value, GGUFValueType) for a new key) and some tensors replaced (None drops one)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    arch = arch or old
    w = gguf.GGUFWriter(str(dst), arch)
    V = gguf.GGUFValueType
    fields = dict(fields or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        new_key = arch + key[len(old):] if key.startswith(old + ".") else key
        val = fields.pop(new_key, f.contents())
        if f.types[0] == V.ARRAY:
            w.add_array(new_key, val)
        else:
            w.add_key_value(new_key, val, f.types[0])
    for key, (val, vtype) in fields.items():
        w.add_key_value(key, val, vtype)
    tensors = dict(tensors or {})
    for t in r.tensors:
        data = tensors.pop(t.name, np.asarray(t.data))
        if data is not None:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, data in tensors.items():  # new ones, float32
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("case,expect", [
    ("qwen3next", "'qwen3next' is not supported"),
    ("gemma4_assistant", "'gemma4_assistant' is not supported"),
    ("gemma4-partial-local-rope", "rope.dimension_count_swa"),
    ("gemma4-rope-freqs", "rope_freqs is not proportional"),
    ("gemma4-unfused-experts", "ffn_gate_exps"),
])
def test_unservable_variants_are_named(converted, tmp_path, case, expect):
    dst = tmp_path / f"{case}.gguf"
    if case == "qwen3next":
        _rewrite(converted("qwen35-moe")[1], dst, arch="qwen3next")
    elif case == "gemma4_assistant":
        _rewrite(converted("gemma4-dense")[1], dst, arch="gemma4_assistant")
    elif case == "gemma4-partial-local-rope":
        _rewrite(converted("gemma4-dense")[1], dst,
                 fields={"gemma4.rope.dimension_count_swa": 8})
    elif case == "gemma4-rope-freqs":
        _rewrite(converted("gemma4-dense")[1], dst,
                 tensors={"rope_freqs.weight": np.linspace(1, 4, 16).astype(np.float32)})
    else:  # gate and up experts as two tensors (llama.cpp's loader takes them; we do not)
        src = converted("gemma4-moe")[1]
        gu = _stored(src)["blk.0.ffn_gate_up_exps.weight"]
        _rewrite(src, dst, tensors={"blk.0.ffn_gate_up_exps.weight": None,
                                    "blk.0.ffn_gate_exps.weight": gu[:, :32].copy()})
    with pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(".", r"\.")):
        load_gguf(dst)


def test_qwen35_nextn_blocks_are_skipped(converted, tmp_path):
    """A file with a multi-token-prediction block appended (``nextn_predict_layers``, the block
    counted in ``block_count``) loads as the model without it."""
    V = gguf.GGUFValueType
    dst = _rewrite(converted("qwen35-dense")[1], tmp_path / "mtp.gguf",
                   fields={"qwen35.block_count": 5, "qwen35.nextn_predict_layers": (1, V.UINT32)},
                   tensors={"blk.4.attn_norm.weight": np.ones(64, np.float32),
                            "blk.4.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)})
    cfg, tensors = load_gguf(dst)
    assert cfg["num_hidden_layers"] == 4 and len(cfg["layer_types"]) == 4
    assert not [n for n in tensors if n.startswith("model.layers.4.")]

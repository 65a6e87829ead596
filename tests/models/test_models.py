"""The paged Flax forward against HF transformers on tiny random checkpoints (float32, CPU)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM  # noqa: E402

from jaxserve.worker.kv_cache import allocate_kv_pages, page_bytes  # noqa: E402
from jaxserve.loaders.model_loader import load_model  # noqa: E402
from jaxserve.core.step_plan import token_ladder  # noqa: E402
from jaxserve.testing.paged import metadata, step_inputs  # noqa: E402

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
BLOCK = 8
NUM_PAGES = 64
MAX_PAGES = 12
LADDER = token_ladder(128, min_bucket=8)
ATOL = 1e-4


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, token_ids, positions, kv, md):
    model = nnx.merge(graphdef, state)
    hidden, kv = model(token_ids, positions, kv, md)
    return model.compute_logits(hidden), kv


class PagedRunner:
    """Test-only driver: owns a KV pool, hands out randomly scattered pages, runs plans."""

    def __init__(self, path, seed=0, dtype="float32", **load_kw):
        self.model, self.cfg, _ = load_model(str(path), dtype=dtype, **load_kw)
        self.graphdef, self.state = nnx.split(self.model)
        self.kv = allocate_kv_pages(self.cfg, NUM_PAGES, BLOCK, jnp.dtype(dtype))
        # Pages in a random order, never page 0 (trash): sequences' pages are scattered.
        self.free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES)))
        self.pages: dict[int, list[int]] = {}

    def _pages_for(self, sid, length):
        pages = self.pages.setdefault(sid, [])
        while len(pages) * BLOCK < length:
            pages.append(int(self.free.pop()))
        return pages

    def run(self, rows):
        """rows: (seq_id, new_token_ids, start_pos) -> per-row logits of every new token."""
        plan = step_inputs([(ids, start, self._pages_for(sid, start + len(ids)))
                            for sid, ids, start in rows], block_size=BLOCK,
                           max_pages=MAX_PAGES, ladder=LADDER, max_num_seqs=8)
        md = metadata(plan)
        logits, self.kv = _step(self.graphdef, self.state, jnp.asarray(plan.token_ids),
                                jnp.asarray(plan.positions), self.kv, md)
        logits = np.asarray(logits)
        qs = plan.query_start
        return [logits[qs[i]:qs[i + 1]] for i in range(len(rows))]


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(ids))[None]).logits[0].numpy()


def _prompt(n, vocab, seed=0):
    return np.random.default_rng(seed).integers(5, vocab, n).astype(np.int32)


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prompt_matches_hf(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    runner = PagedRunner(path)
    ids = _prompt(40, runner.cfg.vocab_size)  # > mistral's sliding window of 16
    if arch == "mistral":
        assert runner.cfg.sliding_window is not None and runner.cfg.sliding_window < len(ids)
    (ours,) = runner.run([(0, ids, 0)])
    ref = _hf_logits(_hf(path), ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
    assert np.array_equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_then_decode_equal_one_pass(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    ids = _prompt(44, 512, seed=1)
    (one_pass,) = PagedRunner(path, seed=1).run([(0, ids, 0)])
    runner = PagedRunner(path, seed=2)
    got, pos = [], 0
    for n in (13, 11, 9):  # prefill chunks, then one token per step
        (lg,) = runner.run([(0, ids[pos:pos + n], pos)])
        got.append(lg)
        pos += n
    while pos < len(ids):
        (lg,) = runner.run([(0, ids[pos:pos + 1], pos)])
        got.append(lg)
        pos += 1
    np.testing.assert_allclose(np.concatenate(got), one_pass, atol=ATOL, rtol=0)
    np.testing.assert_allclose(one_pass, _hf_logits(_hf(path), ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_ragged_batch_of_five_matches_single_sequences(tiny_model_factory, arch):
    """One plan mixing first prefill chunks, later chunks and single decode tokens."""
    path = tiny_model_factory(arch)
    hf = _hf(path)
    lengths = [5, 23, 1, 37, 12]
    seqs = [_prompt(n, 512, seed=10 + i) for i, n in enumerate(lengths)]
    runner = PagedRunner(path, seed=3)
    # Sequences 1 and 3 had earlier chunks computed in a previous step; 4 is decoding.
    done = {1: 17, 3: 20, 4: 11}
    runner.run([(sid, seqs[sid][:n], 0) for sid, n in done.items()])
    rows = [(sid, s[done.get(sid, 0):], done.get(sid, 0)) for sid, s in enumerate(seqs)]
    outs = runner.run(rows)
    for sid, (s, out) in enumerate(zip(seqs, outs)):
        ref = _hf_logits(hf, s)[done.get(sid, 0):]
        assert out.shape == ref.shape, sid
        np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0, err_msg=f"sequence {sid}")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_matches_hf_generate(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    hf = _hf(path)
    hf.generation_config.eos_token_id = None
    prompt = _prompt(9, 512, seed=4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt)[None].long(), max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ref = ref[0, len(prompt):].tolist()
    assert len(ref) == 32

    runner = PagedRunner(path, seed=5)
    (lg,) = runner.run([(0, prompt, 0)])
    out = [int(lg[-1].argmax())]
    while len(out) < 32:
        (lg,) = runner.run([(0, np.array(out[-1:], np.int32), len(prompt) + len(out) - 1)])
        out.append(int(lg[-1].argmax()))
    assert out == ref


@pytest.mark.parametrize("overrides", [
    dict(rope_scaling="llama3", tie_embeddings=True),
    dict(rope_scaling="linear"),
    dict(rope_scaling="yarn"),
    dict(rope_scaling="dynamic", max_position=32),  # prompt longer than max_position: scaled
    dict(kv_heads=1, rope_theta=500000.0),  # MQA
    dict(kv_heads=4),  # MHA
], ids=["llama3-tied", "linear", "yarn", "dynamic", "mqa", "mha"])
def test_rope_scaling_and_head_layouts_match_hf(tiny_model_factory, overrides):
    path = tiny_model_factory("llama", **overrides)
    runner = PagedRunner(path)
    if overrides.get("tie_embeddings"):
        assert runner.model.lm_head is None and runner.cfg.tie_word_embeddings
    ids = _prompt(70, 512, seed=6)  # past llama3/yarn original_max_position_embeddings (64)
    (ours,) = runner.run([(0, ids, 0)])
    np.testing.assert_allclose(ours, _hf_logits(_hf(path), ids), atol=ATOL, rtol=0)


def test_qwen3_tied_gqa_decode_matches_hf(tiny_model_factory):
    path = tiny_model_factory("qwen3", tie_embeddings=True, heads=8, kv_heads=2)
    ids = _prompt(20, 512, seed=7)
    runner = PagedRunner(path, seed=8)
    (a,) = runner.run([(0, ids[:15], 0)])
    rest = [runner.run([(0, ids[i:i + 1], i)])[0] for i in range(15, 20)]
    np.testing.assert_allclose(np.concatenate([a, *rest]), _hf_logits(_hf(path), ids),
                               atol=ATOL, rtol=0)


def test_padded_tokens_write_only_the_trash_page(tiny_model_factory):
    # qwen2: the k bias makes the pad token's K non-zero even though its embedding row is zero.
    runner = PagedRunner(tiny_model_factory("qwen2"))
    before = [np.asarray(k).copy() for k, _ in runner.kv]
    runner.run([(0, _prompt(3, 512), 0)])  # 3 tokens in an 8-token bucket: 5 pads
    own = runner.pages[0]
    for layer, (k, _) in enumerate(runner.kv):
        k = np.asarray(k)
        changed = {int(p) for p in np.nonzero(np.any(k != before[layer], axis=(0, 2, 3)))[0]}
        assert changed <= set(own) | {0}, changed
        assert 0 in changed  # padding went to the trash page


def test_bfloat16_forward_is_close_to_float32(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    ids = _prompt(24, 512, seed=9)
    (f32,) = PagedRunner(path).run([(0, ids, 0)])
    runner = PagedRunner(path, dtype="bfloat16")
    assert runner.model.model.layers[0].self_attn.q_proj.weight[...].dtype == jnp.bfloat16
    (bf16,) = runner.run([(0, ids, 0)])
    assert bf16.dtype == np.float32 and runner.kv[0][0].dtype == jnp.bfloat16
    assert np.abs(bf16 - f32).max() < 0.05 * np.abs(f32).max()


def test_pool_sharding_is_stable_across_steps(tiny_model_factory):
    """A step returns its pages with the sharding they came in with (else: a recompile)."""
    runner = PagedRunner(tiny_model_factory("llama"))
    before = runner.kv[0][0].sharding
    runner.run([(0, _prompt(5, 512), 0)])
    assert runner.kv[0][0].sharding == before
    size = _step._cache_size()
    runner.run([(1, _prompt(5, 512, seed=3), 0)])  # same shapes: no new compile
    assert _step._cache_size() == size


def test_page_bytes_matches_allocation(tiny_model_factory):
    _, cfg, _ = load_model(str(tiny_model_factory("qwen3")), dtype="float32")
    kv = allocate_kv_pages(cfg, 5, BLOCK, jnp.bfloat16)
    total = sum(k.nbytes + v.nbytes for k, v in kv)
    assert total == 5 * page_bytes(cfg, BLOCK, jnp.bfloat16)
    assert kv[0][0].shape == (cfg.num_kv_heads, 5, BLOCK, cfg.head_dim)
    with pytest.raises(ValueError, match="num_pages"):
        allocate_kv_pages(cfg, 1, BLOCK, jnp.float32)


def _backend_steps(path, backend):
    ids = _prompt(30, 512, seed=11)
    runner = PagedRunner(path, seed=12, attention_backend=backend)
    assert runner.model.attention_backend == backend
    a = runner.run([(0, ids[:25], 0)])[0]  # prefill past the sliding window of 16
    b = runner.run([(0, ids[25:26], 25), (1, ids[:9], 0)])  # a decode and a prefill together
    return np.concatenate([a, *b])


@pytest.mark.slow
def test_xla_attention_backend_is_drop_in(tiny_model_factory):
    path = tiny_model_factory("mistral", layers=1)
    np.testing.assert_allclose(_backend_steps(path, "xla"), _backend_steps(path, "reference"),
                               atol=ATOL, rtol=0)


@pytest.mark.gpu
def test_pallas_attention_backend_is_drop_in_on_gpu(tiny_model_factory):
    """Native Pallas kernel inside the model vs the jnp reference, both on the GPU."""
    path = tiny_model_factory("mistral", head_dim=64)
    np.testing.assert_allclose(_backend_steps(path, "pallas"), _backend_steps(path, "reference"),
                               atol=2e-3, rtol=0)


@pytest.mark.gpu
def test_triton_attention_backend_is_drop_in_on_gpu(tiny_model_factory):
    """The jax_triton kernels inside the model vs the jnp reference, both on the GPU."""
    pytest.importorskip("jax_triton")
    path = tiny_model_factory("mistral", head_dim=64)
    np.testing.assert_allclose(_backend_steps(path, "triton"), _backend_steps(path, "reference"),
                               atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_pallas_forward_matches_hf_cpu(tiny_model_factory, arch):
    """float32 on the GPU through the Pallas kernel vs HF on the CPU (TF32-level tolerance)."""
    path = tiny_model_factory(arch, head_dim=64)
    ids = _prompt(40, 512, seed=13)
    runner = PagedRunner(path, seed=14, attention_backend="pallas")
    got = [runner.run([(0, ids[:33], 0)])[0]]
    got += [runner.run([(0, ids[i:i + 1], i)])[0] for i in range(33, 40)]
    np.testing.assert_allclose(np.concatenate(got), _hf_logits(_hf(path), ids), atol=5e-3,
                               rtol=0)


def test_unknown_attention_backend_is_rejected(tiny_model_factory):
    with pytest.raises(ValueError, match="cudnn"):
        load_model(str(tiny_model_factory("llama")), attention_backend="cudnn")

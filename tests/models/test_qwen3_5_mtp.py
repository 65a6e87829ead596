"""Speculative decoding with Qwen 3.5 / 3.6's own multi-token-prediction head (method ``mtp``).

Tiny random ``qwen3_5`` checkpoints carry a random MTP head under the released names
(``mtp.*``); transformers ignores it, so HF ``generate`` on the same directory is the reference.
Shown here: the head's logits equal a torch reference built from HF's own decoder layer; greedy
output with MTP (k = 1, 3) equals greedy without it and HF, with prompts longer than the token
budget and four concurrent requests; drafts that are always wrong, or right for a prefix only,
still give exactly those tokens (the Gated DeltaNet state rolls back to the last accepted
token: without the rollback they do not); acceptance counters; the state pool all free after;
no compile after warm-up; start-up errors naming the field.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.models.test_qwen3_5 import _assert_pools_free
from tests.models.test_qwen3_5 import _greedy as _greedy_tokens

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
ATOL = 2e-4
NEW_TOKENS = 12
PROMPT_LENS = [90, 70, 81, 75]  # all longer than the 32-token budget: chunked prefill


def _prompts(lengths=PROMPT_LENS, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 500, n).tolist() for n in lengths]


def _hf(path: Path):
    import transformers as tf

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(qwen35):
    cache: dict = {}

    def get(variant: str, prompts, n: int = NEW_TOKENS):
        key = (variant, json.dumps(prompts), n)
        if key not in cache:
            hf = _hf(qwen35(variant))
            with torch.no_grad():
                cache[key] = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                              for p in prompts]
        return cache[key]

    return get


def _engine(path: Path, spec: dict | None = None, **kw):
    from jaxserve.entrypoints.llm import LLM

    args = dict(dtype="float32", max_num_batched_tokens=32, min_token_bucket=32,
                max_num_seqs=4, max_model_len=256, enforce_eager=True, block_size=8)
    args.update(kw)
    return LLM(str(path), speculative_config=spec, **args)


# greedy token ids of llm for each prompt: NEW_TOKENS new tokens unless n is given
_greedy = functools.partial(_greedy_tokens, n=NEW_TOKENS)


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


# -- the head itself ------------------------------------------------------------------------------

def _torch_mtp_logits(path: Path, prompt: list[int]) -> np.ndarray:
    from jaxserve.testing.qwen3_5 import TorchMtpHead

    return TorchMtpHead(path).logits(prompt)




def _our_mtp_logits(path: Path, prompt: list[int], pages: bool = False):
    """Our model's hidden states, then ``mtp_forward`` over the same positions with its own
    pages (its K/V written and attended like any attention layer). ``pages``: return the
    head's keys ``[Hkv, L-1, D]`` of positions ``0 .. L-2`` instead."""
    import jax.numpy as jnp

    from jaxserve.core.kv_cache_spec import group_layers
    from jaxserve.loaders.model_loader import load_model
    from jaxserve.models.layers import AttentionMetadata
    from jaxserve.worker.kv_cache import allocate_hybrid_caches

    model, cfg, _ = load_model(str(path), dtype="float32", load_mtp=True)
    block, n = 8, len(prompt)
    n_pages = n // block + 2
    groups = group_layers(model.cache_specs("float32"))
    caches = allocate_hybrid_caches(cfg, groups, n_pages, 2, block, jnp.float32)
    assert len(caches) == cfg.num_layers + 1  # the head's pages: one more attention layer
    table = jnp.arange(1, n_pages, dtype=jnp.int32)[None, :]

    def md(length):
        pos = np.arange(length)
        return AttentionMetadata(
            slot_mapping=jnp.asarray(table[0, pos // block] * block + pos % block),
            query_start=jnp.asarray([0, length], jnp.int32),
            seq_lens=jnp.asarray([length], jnp.int32), block_tables=table,
            num_seqs=jnp.int32(1), state_slots=jnp.asarray([1], jnp.int32))

    hidden, caches = model(jnp.asarray(prompt, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                           caches, md(n))
    h, kv = model.mtp_forward(jnp.asarray(prompt[1:], jnp.int32),
                              jnp.arange(n - 1, dtype=jnp.int32), hidden[:-1], caches[-1],
                              md(n - 1))
    if pages:
        pos = np.arange(n - 1)
        return np.asarray(kv[0])[:, np.asarray(table[0])[pos // block], pos % block]
    return np.asarray(model.compute_logits(h))


def test_mtp_head_logits_match_a_torch_reference_of_hf_layers(qwen35):
    path = qwen35("dense")
    prompt, = _prompts([40], seed=7)
    np.testing.assert_allclose(_our_mtp_logits(path, prompt), _torch_mtp_logits(path, prompt),
                               atol=ATOL, rtol=0)


# -- the engine -----------------------------------------------------------------------------------

def test_engine_drafts_are_the_heads_chain_of_the_torch_reference(qwen35):
    """k = 3, two requests whose prompts cross many 8-token chunks: the head's keys of every
    prompt position equal one pass of the head over the whole prompt (each chunk's last token
    read the next prompt token), and each of their first proposals (after the prompt, then
    after verify steps) equals the torch head's chain on the same tokens (verify rows feed the
    token emitted at the last accepted position; the draft steps read their own K/V)."""
    path = qwen35("dense")
    prompts = _prompts([90, 70], seed=6)
    llm = _engine(path, _mtp(3), max_num_batched_tokens=8, min_token_bucket=8)
    seen: list[tuple[list[int], list[int]]] = []

    def record(req, drafts):
        if len(req.all_token_ids) == len(req.prompt_token_ids) + 1:  # right after the prompt
            # the head's keys of every prompt position, written chunk by chunk
            k_pages = np.asarray(llm.llm_engine.runner.kv_pages[-1][0])
            pos = np.arange(len(req.prompt_token_ids))
            pages = np.asarray(req.block_ids)[pos // 8]
            keys[tuple(req.all_token_ids)] = k_pages[:, pages, pos % 8]
        seen.append((list(req.all_token_ids), list(drafts)))
        return drafts

    keys: dict[tuple, np.ndarray] = {}
    llm.llm_engine.proposer.override = record
    _greedy(llm, prompts, n=8)
    assert len(keys) == len(prompts)
    for tokens, k in keys.items():
        np.testing.assert_allclose(k, _our_mtp_logits(path, list(tokens), pages=True),
                                   atol=ATOL, rtol=0)
    from jaxserve.testing.qwen3_5 import TorchMtpHead

    ref = TorchMtpHead(path)
    checked = 0
    for p in prompts:
        mine = [(t, d) for t, d in seen if t[:len(p)] == p][:3]
        assert len(mine) == 3
        for tokens, drafts in mine:
            assert drafts == ref.drafts(tokens, len(drafts)), len(tokens)
            checked += len(drafts) == 3
    assert checked >= 4  # most with all three drafts (the chain)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_equals_greedy_without_and_hf(qwen35, hf_greedy, k):
    """Four requests, prompts of 70-90 tokens through a 32-token budget: every step runs the
    head over its tokens (prefill chunks too), so its pages cover the whole context."""
    path = qwen35("dense")
    prompts = _prompts()
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(k))
    eng = llm.llm_engine
    assert eng.runner.snapshots == (4, k)  # 4 requests' slots, then k scratch slots per row
    assert _greedy(llm, prompts) == ref
    s = eng.spec_stats.as_dict()
    assert s["spec_decode_num_drafts"] >= len(prompts)
    assert s["spec_decode_num_draft_tokens"] >= s["spec_decode_num_drafts"]
    assert len(s["spec_decode_num_accepted_tokens_per_pos"]) == k
    _assert_pools_free(llm)
    assert _greedy(_engine(path), prompts) == ref  # and without speculation


def _scripted(llm, ref: list[list[int]], prompts, wrong_at):
    """Replace the head's drafts by the reference continuation with the draft at index
    ``wrong_at(i)`` made wrong (i = the request's proposals so far; None: all right)."""
    by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}
    calls: dict[str, int] = {}

    def override(req, drafts):
        want = by_prompt[tuple(req.prompt_token_ids)]
        n = req.num_output_tokens
        out = [want[n + j] if n + j < len(want) else 0 for j in range(len(drafts))]
        i = calls[req.request_id] = calls.get(req.request_id, -1) + 1
        bad = wrong_at(i)
        if bad is not None and bad < len(out):
            out[bad] = (out[bad] + 1) % 512
        return out

    llm.llm_engine.proposer.override = override


def test_always_wrong_drafts_give_the_same_tokens_and_need_the_rollback(qwen35, hf_greedy):
    """Every draft wrong: each verify step keeps only the target's own token, so the GDN state
    must come back to the one after the first token of the row (its snapshot). The same run
    with the rollback switched off diverges from HF."""
    path = qwen35("dense")
    prompts = _prompts()
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(3))
    _scripted(llm, ref, prompts, lambda i: 0)
    assert _greedy(llm, prompts) == ref
    s = llm.llm_engine.spec_stats
    assert s.num_draft_tokens > 3 * len(prompts) and s.num_accepted_tokens == 0
    _assert_pools_free(llm)

    broken = _engine(path, _mtp(3))
    broken.llm_engine.runner._rollback = None  # rejected drafts stay in the state
    _scripted(broken, ref, prompts, lambda i: 0)
    assert _greedy(broken, prompts) != ref


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafts_right_for_a_prefix_commit_the_state_at_the_accepted_token(qwen35, hf_greedy,
                                                                          async_scheduling):
    """Drafts right up to a position that cycles (draft 1, 2, 3 or none wrong) from one
    proposal to the next: every rollback depth of k = 3 happens, and the tokens stay HF's,
    with the overlapped loop and without it."""
    path = qwen35("dense")
    prompts = _prompts()
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(3), async_scheduling=async_scheduling)
    _scripted(llm, ref, prompts, lambda i: [0, 1, 2, None][i % 4])
    assert _greedy(llm, prompts) == ref
    s = llm.llm_engine.spec_stats
    acc = s.accepted_per_pos
    assert acc[0] > acc[1] > acc[2] > 0  # some accepted at each depth, fewer further on
    assert s.num_accepted_tokens < s.num_draft_tokens  # and some rejected
    _assert_pools_free(llm)


def test_a_stop_token_inside_an_accepted_run_and_n_2(qwen35, hf_greedy):
    """Drafts always right (k = 3): a stop token in the middle of an accepted run ends the
    request there (nothing after it is kept); n = 2 children each draft from their own slot;
    every slot and page is free afterwards."""
    from jaxserve.core.sampling_params import SamplingParams

    path = qwen35("dense")
    prompts = _prompts([60, 45], seed=9)
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(3))
    _scripted(llm, ref, prompts, lambda i: None)
    stop = ref[0][6]
    cut = ref[0].index(stop) + 1
    res = llm.generate([{"prompt_token_ids": prompts[0]}],
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                      stop_token_ids=[stop]), use_tqdm=False)
    assert list(res[0].outputs[0].token_ids) == ref[0][:cut]
    res = llm.generate([{"prompt_token_ids": prompts[1]}],
                       SamplingParams(n=2, temperature=0.0, max_tokens=NEW_TOKENS,
                                      ignore_eos=True), use_tqdm=False)
    assert [list(c.token_ids) for c in res[0].outputs] == [ref[1], ref[1]]
    s = llm.llm_engine.spec_stats
    assert s.num_accepted_tokens == s.num_draft_tokens > 0  # every draft right
    _assert_pools_free(llm)


@pytest.mark.parametrize("mode", ["recompute", pytest.param("swap", marks=pytest.mark.slow)])
def test_mtp_under_preemption_beside_requests_that_do_not_speculate(qwen35, hf_greedy, mode):
    """A pool of 20 pages of 8 tokens for four ~80-token requests (they preempt each other;
    recompute rebuilds the head's pages with the rest, swap moves them with the rest), one of
    them opted out of speculation and one with a seed at temperature 0: greedy tokens still
    equal HF, every slot and page is free."""
    from jaxserve.core.sampling_params import SamplingParams

    path = qwen35("dense")
    prompts = _prompts()
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(2), num_gpu_blocks_override=20, preemption_mode=mode)
    base = dict(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    params = [SamplingParams(**base), SamplingParams(**base, disable_speculative_decoding=True),
              SamplingParams(**base, seed=3), SamplingParams(**base)]
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(r.outputs[0].token_ids) for r in res] == ref
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert eng.scheduler.num_swap_outs_total > 0
        assert not eng._swapped and not eng._swapped_state
    assert eng.spec_stats.num_drafts > 0
    _assert_pools_free(llm)


def test_ngram_on_a_state_model_rolls_back_too(qwen35, hf_greedy):
    """The same snapshots serve n-gram drafts on a Gated DeltaNet model (allowed now)."""
    path = qwen35("dense")
    prompts = [p + p[:30] for p in _prompts([40, 50], seed=3)]  # repeats for lookups to hit
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, {"method": "ngram", "num_speculative_tokens": 3,
                         "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert _greedy(llm, prompts) == ref
    assert llm.llm_engine.spec_stats.num_drafts > 0
    _assert_pools_free(llm)


def test_draft_model_on_a_state_model_rolls_back_too(qwen35, hf_greedy, tmp_path):
    """An attention-only draft model proposes; the target's GDN state rolls back the same way.
    A draft with LinearState layers of its own is a start-up error naming the field."""
    from jaxserve.errors import InvalidRequestError
    from jaxserve.testing.tiny_model import make_tiny_model

    path = qwen35("dense")
    prompts = _prompts([60, 45], seed=8)
    ref = hf_greedy("dense", prompts)
    draft = make_tiny_model("llama", tmp_path / "draft", layers=1, hidden=32, heads=2,
                            kv_heads=1, vocab=512)
    llm = _engine(path, {"method": "draft_model", "model": str(draft),
                         "num_speculative_tokens": 2})
    assert _greedy(llm, prompts) == ref
    assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    _assert_pools_free(llm)
    with pytest.raises(InvalidRequestError, match="draft model with LinearState") as e:
        _engine(path, {"method": "draft_model", "model": str(path),
                       "num_speculative_tokens": 2})
    assert e.value.param == "speculative_config"


@pytest.mark.slow  # warm-up compiles every graph ahead of time
def test_nothing_compiles_after_warm_up(qwen35, hf_greedy):
    path = qwen35("dense")
    prompts = _prompts()
    ref = hf_greedy("dense", prompts)
    llm = _engine(path, _mtp(2), enforce_eager=False, min_token_bucket=8)  # buckets 8, 16, 32
    runner = llm.llm_engine.runner
    warm = runner.num_compiles
    assert _greedy(llm, prompts) == ref
    assert runner.num_compiles == warm
    _assert_pools_free(llm)


@pytest.mark.slow
def test_moe_greedy_with_mtp_equals_hf(qwen35, hf_greedy):
    """Qwen 3.5 MoE in the vision-language layout: the head's layer is a sparse MoE block
    whose per-expert ``mtp.layers.0.mlp.experts.*`` tensors are stacked like the model's."""
    path = qwen35("moe-vl")
    prompts = _prompts()
    ref = hf_greedy("moe-vl", prompts)
    llm = _engine(path, _mtp(2))
    assert _greedy(llm, prompts) == ref
    assert llm.llm_engine.spec_stats.num_drafts > 0
    _assert_pools_free(llm)


@pytest.mark.slow  # fp8 quantization at start-up
def test_fp8_kv_cache_with_calculated_scales_and_mtp(qwen35, hf_greedy):
    """``--kv-cache-dtype fp8 --calculate-kv-scales``: the head's layer is one more cache layer
    (its scale 1.0: the calibration pass runs the model, not the head), its pages float8; the
    greedy tokens equal the same engine's without speculation."""
    import jax.numpy as jnp

    path = qwen35("dense")
    prompts = _prompts([50, 40], seed=5)
    kw = dict(kv_cache_dtype="fp8", calculate_kv_scales=True)
    want = _greedy(_engine(path, **kw), prompts)
    llm = _engine(path, _mtp(2), **kw)
    assert _greedy(llm, prompts) == want
    model = llm.llm_engine.model
    assert model.mtp.layers[0].self_attn.kv_scale == ((1.0, 1.0),) * 2
    assert model.model.layers[3].self_attn.kv_scale != ((1.0, 1.0),) * 2
    assert llm.llm_engine.runner.kv_pages[-1][0].dtype == jnp.float8_e4m3fn
    _assert_pools_free(llm)


# -- configuration errors -------------------------------------------------------------------------

def test_mtp_without_a_head_is_a_start_up_error_naming_the_field(qwen35, tmp_path):
    from jaxserve.errors import InvalidRequestError
    from jaxserve.testing.tiny_model import make_tiny_model

    with pytest.raises(InvalidRequestError, match="mtp") as e:
        _engine(qwen35("no_mtp"), _mtp(2))
    assert e.value.param == "speculative_config"
    llama = make_tiny_model("llama", tmp_path / "llama", layers=1, hidden=32, heads=2,
                            kv_heads=1, vocab=512)
    with pytest.raises(InvalidRequestError, match="multi-token-prediction") as e:
        _engine(llama, _mtp(2))
    assert e.value.param == "speculative_config"


def test_cli_speculative_config_mtp_parses_and_bad_values_name_the_field(capsys):
    from jaxserve.entrypoints.cli import build_parser, engine_config_from_args, main

    def config(*argv):
        return engine_config_from_args(build_parser().parse_args(["serve", "m", *argv]))

    c = config("--speculative-config", '{"method":"mtp","num_speculative_tokens":2}').speculative
    assert (c.method, c.num_speculative_tokens, c.model) == ("mtp", 2, None)
    for bad, field in (('{"method": "mtpp", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "mtp", "num_speculative_tokens": 0}',
                        "num_speculative_tokens"),
                       ('{"method": "mtp", "num_speculative_tokens": "2"}',
                        "num_speculative_tokens"),
                       ('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "model"),
                       ('{"method": "mtp", "num_speculative_tokens": 2, '
                        '"prompt_lookup_max": 3}', "prompt_lookup_max")):
        with pytest.raises(ValueError, match=f"speculative_config.{field}"):
            config("--speculative-config", bad)
    assert main(["serve", "m", "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": -1}']) == 2
    err = capsys.readouterr().err
    assert "num_speculative_tokens" in err and "Traceback" not in err


@pytest.mark.slow  # the head's training takes about a minute
def test_a_trained_head_gets_its_drafts_accepted(tmp_path):
    """The tiny head distilled on the model's own greedy text (tools/make_tiny_model.py
    --distill-mtp): with k = 3 the head's own drafts, draft steps included, are accepted
    often enough to shorten decoding, and the tokens stay HF's."""
    import subprocess as sp

    out = tmp_path / "trained"
    sp.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch", "qwen3_5",
            "--out", str(out), "--distill-mtp", "60"], check=True, capture_output=True,
           env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    prompts = _prompts()
    hf = _hf(out)
    with torch.no_grad():
        ref = [hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
               for p in prompts]
    llm = _engine(out, _mtp(3))
    assert _greedy(llm, prompts, n=32) == ref
    s = llm.llm_engine.spec_stats
    assert s.mean_acceptance_length > 1.5
    assert s.accepted_per_pos[2] > 0  # the third draft (two draft steps deep) is right too
    _assert_pools_free(llm)


@pytest.mark.slow  # a server process
def test_served_with_mtp(qwen35, tmp_path):
    """`jaxserve serve --speculative-config '{"method": "mtp", ...}'`: the engine core loads the
    head and speculates; the completion equals the offline greedy one and /metrics counts the
    drafts."""
    import httpx
    from server_process import free_port, stop, wait_healthy

    path = qwen35("dense")
    prompt, = _prompts([50], seed=5)
    want = _engine(path).generate([{"prompt_token_ids": prompt}], _greedy_params(),
                                  use_tqdm=False)[0].outputs[0].text
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("JAXSERVE_API_KEY", None)
    port = free_port()
    log = tmp_path / "log.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(path), "--port",
         str(port), "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--min-token-bucket", "32", "--block-size", "8",
         "--uvicorn-log-level", "warning",
         "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, [proc], [log], timeout=600)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        [drafts] = [float(ln.split()[-1]) for ln in metrics.splitlines()
                    if ln.startswith("jaxserve:spec_decode_num_drafts_total")]
        assert drafts > 0
    finally:
        stop(proc, timeout=60)


def _greedy_params():
    from jaxserve.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _tp2_child(path: str, prompts, ref) -> dict:
    llm = _engine(Path(path), _mtp(3), tensor_parallel_size=2)
    _scripted(llm, ref, prompts, lambda i: [0, 1, 2, None][i % 4])
    got = _greedy(llm, prompts)
    _assert_pools_free(llm)
    return dict(tokens=got, accepted=llm.llm_engine.spec_stats.accepted_per_pos)


@pytest.mark.slow  # a child process with 2 CPU devices
def test_tp2_with_mtp_and_rollback_equals_hf(qwen35, hf_greedy):
    """Tensor parallel 2: the head's attention split over heads like the model's, the state
    pool (snapshots included) replicated; prefix-right drafts roll back at every depth."""
    path = qwen35("dense")
    prompts = _prompts([70, 40], seed=4)
    ref = hf_greedy("dense", prompts)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, json.dumps([str(path), prompts, ref])],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == ref
    assert min(got["accepted"]) > 0


if __name__ == "__main__":
    print(json.dumps(_tp2_child(*json.loads(sys.argv[1]))))

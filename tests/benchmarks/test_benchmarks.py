"""Benchmarks: the roofline math, the request/statistics helpers, and each script end to end on
a tiny model on CPU (JSON fields consistent with each other, a PNG written)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import baselines as B  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# One token bucket (min bucket == budget): two compiles at warm-up, so CPU tests stay short.
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--min-token-bucket",
                "16", "--disable-tqdm"]


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 1000


# ---------------------------------------------------------------------------------------------
# roofline
# ---------------------------------------------------------------------------------------------
def test_decode_roofline_reads_weights_once_and_kv_per_sequence():
    w, kv, ctx, bw = 2.2e9, 22528, 576.0, 3.0e12
    for batch in (1, 8, 256):
        r = B.decode_roofline(w, kv, batch, ctx, bw)
        step_bytes = w + batch * ctx * kv
        assert r["bytes_per_step"] == pytest.approx(step_bytes, rel=1e-9)
        assert r["step_ms"] == pytest.approx(1e3 * step_bytes / bw)
        assert r["output_tokens_per_s"] == pytest.approx(batch * bw / step_bytes)
    rates = [B.decode_roofline(w, kv, b, ctx, bw)["output_tokens_per_s"] for b in
             (1, 2, 4, 64, 4096, 10**7)]
    assert all(a < b for a, b in zip(rates, rates[1:]))  # batching amortises the weights
    assert rates[-1] < bw / (ctx * kv)  # ... up to the KV-bound limit
    assert rates[-1] == pytest.approx(bw / (ctx * kv), rel=1e-2)
    with pytest.raises(ValueError):
        B.decode_roofline(w, kv, 0, ctx, bw)
    with pytest.raises(ValueError):
        B.decode_roofline(w, kv, 4, ctx, 0.0)


@pytest.mark.parametrize("preset", ["tinyllama-1.1b", "llama3-8b"])
def test_preset_byte_counts_match_hf_and_jaxserve(preset):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    from jaxserve.config import ModelConfig
    from jaxserve.worker.kv_cache import page_bytes
    from jaxserve.testing.presets import param_count, preset_config

    cfg = preset_config(preset)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    n = sum(p.numel() for p in model.parameters())
    assert param_count(cfg) == n
    embed = model.get_input_embeddings().weight.numel()
    assert B.weight_bytes(cfg, 2) == 2 * (n - embed)  # the embedding is gathered, not read
    mc = ModelConfig.from_hf_config(cfg)
    import jax.numpy as jnp
    assert B.kv_bytes_per_token(cfg, 2) * 16 == page_bytes(mc, 16, jnp.bfloat16)
    r = B.roofline_for_run(cfg, "bfloat16", 256, 512, 128, 3e12)
    assert r["avg_context"] == 512 + 64
    assert r["weight_bytes"] == B.weight_bytes(cfg, 2)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def test_percentiles_and_summary_match_numpy():
    rng = random.Random(1)
    xs = [rng.expovariate(3.0) for _ in range(101)]
    for q in (0, 10, 50, 90, 99, 100):
        assert B.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = B.summarize(xs, "ttft_ms", (50, 99), scale=1e3)
    assert s["mean_ttft_ms"] == pytest.approx(1e3 * np.mean(xs))
    assert s["std_ttft_ms"] == pytest.approx(1e3 * np.std(xs))
    assert s["median_ttft_ms"] == pytest.approx(1e3 * np.median(xs))
    assert s["p99_ttft_ms"] == pytest.approx(1e3 * np.percentile(xs, 99))


def test_random_requests_fixed_and_ranged_lengths():
    fixed = B.random_requests(20, 30, 7, vocab_size=100, seed=3)
    assert [r.prompt_len for r in fixed] == [30] * 20
    assert [r.output_len for r in fixed] == [7] * 20
    assert all(0 <= t < 100 for r in fixed for t in r.prompt_token_ids)
    ranged = B.random_requests(200, 100, 50, vocab_size=100, range_ratio=0.5, seed=3)
    lens = [r.prompt_len for r in ranged]
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert B.random_requests(5, 9, 3, 50, seed=7)[0].prompt_token_ids == \
        B.random_requests(5, 9, 3, 50, seed=7)[0].prompt_token_ids
    with pytest.raises(ValueError):
        B.random_requests(5, 9, 3, 50, range_ratio=1.0)


def test_sharegpt_requests(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    data = [{"conversations": [{"from": "human", "value": f"tell me about the number {i} " * 3},
                               {"from": "gpt", "value": "it is a number " * (i + 1)}]}
            for i in range(10)]
    data.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: dropped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = B.sharegpt_requests(str(path), 6, tok, vocab_size=512)
    assert len(reqs) == 6
    for r in reqs:
        i = next(i for i in range(10) if r.output_len == len(tok.encode("it is a number " * (
            i + 1))))
        assert r.prompt_token_ids == tok.encode(f"tell me about the number {i} " * 3)
    fixed = B.sharegpt_requests(str(path), 3, tok, vocab_size=512, output_len=5)
    assert [r.output_len for r in fixed] == [5, 5, 5]


def test_serving_metrics_and_goodput():
    from benchmarks import serving as S

    assert S.parse_goodput(["ttft:30", "tpot:8"]) == {"ttft": 30.0, "tpot": 8.0}
    for bad in (["ttft"], ["foo:3"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            S.parse_goodput(bad)
    gaps = S.arrival_gaps(4000, rate=20.0, burstiness=1.0, seed=0)
    assert np.mean(gaps) == pytest.approx(1 / 20.0, rel=0.08)
    assert S.arrival_gaps(5, float("inf"), 1.0, 0) == [0.0] * 5

    def res(ttft, latency, n, ok=True):
        r = S.RequestResult(prompt_len=10, output_len_requested=n, success=ok, ttft=ttft,
                            latency=latency, output_tokens=n if ok else 0)
        r.itl = [(latency - ttft) / (n - 1)] * (n - 1) if ok else []
        return r

    results = [res(0.010, 0.110, 11), res(0.050, 0.150, 11), res(0.020, 0.520, 11),
               res(0, 0, 4, ok=False)]
    m = S.compute_metrics(results, duration=2.0, slos={"ttft": 30, "tpot": 20},
                          percentiles=[50, 99])
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_output_tokens"] == 33
    assert m["output_throughput"] == pytest.approx(33 / 2.0)
    tpots = [0.010, 0.010, 0.050]
    assert m["mean_tpot_ms"] == pytest.approx(1e3 * np.mean(tpots))
    assert m["median_ttft_ms"] == pytest.approx(20.0)
    # only the first request meets ttft <= 30 ms and tpot <= 20 ms
    assert m["request_goodput"] == pytest.approx(1 / 2.0)


def test_presets_write_config_and_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from jaxserve.config import ModelConfig
    from jaxserve.testing.presets import PRESETS, write_preset

    for name in PRESETS:
        out = write_preset(name, str(tmp_path / name))
        cfg = json.loads(Path(out, "config.json").read_text())
        assert cfg == PRESETS[name]
        gen = json.loads(Path(out, "generation_config.json").read_text())
        assert gen["eos_token_id"] == cfg["eos_token_id"]
        assert not list(Path(out).glob("*.safetensors"))
        tok = AutoTokenizer.from_pretrained(out)
        ids = tok.encode("hello world")
        assert ids and max(ids) < cfg["vocab_size"]
        # the whole vocabulary decodes: a dummy model's sampled ids stream text
        assert len(tok) == cfg["vocab_size"]
        high = list(range(cfg["vocab_size"] - 50, cfg["vocab_size"]))
        assert all(tok.decode([i]).strip() for i in high)
        assert len(set(tok.convert_ids_to_tokens(high))) == len(high)
        mc = ModelConfig.from_hf_config(cfg)
        assert mc.num_layers == cfg["num_hidden_layers"]
        assert mc.num_kv_heads == cfg["num_key_value_heads"]
    with pytest.raises(ValueError, match="unknown preset"):
        write_preset("gpt-5", str(tmp_path / "x"))
    l3 = ModelConfig.from_hf_config(PRESETS["llama3-8b"])
    assert l3.rope_scaling["rope_type"] == "llama3" and l3.rope_theta == 500000.0


def test_gpu_run_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_run.sh")], check=True)


# ---------------------------------------------------------------------------------------------
# end to end on a tiny model
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_throughput_end_to_end_with_baselines(tmp_path, tiny_llama_dir):
    from benchmarks import throughput

    n, out_len = 6, 5
    out = throughput.main([
        "--model", str(tiny_llama_dir), "--num-prompts", str(n), "--input-len", "12",
        "--output-len", str(out_len), *ENGINE_FLAGS, "--num-warmup-prompts", "1",
        "--hf-baseline", "--hf-batch-sizes", "2,4", "--hf-cb-baseline",
        "--hf-cb-attn-impls", "sdpa,no_such_attention", "--roofline",
        "--compare-async-scheduling", "--profile-dir", str(tmp_path / "trace"),
        "--result-dir", str(tmp_path)])
    files = list(tmp_path.glob("throughput-*.json"))
    assert len(files) == 1
    d = json.loads(files[0].read_text())
    for key in ("device", "versions", "date", "git_commit", "config"):
        assert d[key], key
    r = d["jaxserve"]
    assert r["num_requests"] == n and r["num_output_tokens"] == n * out_len
    assert r["num_requests_wrong_length"] == 0
    assert r["elapsed_time"] > 0
    assert r["output_throughput"] == pytest.approx(r["num_output_tokens"] / r["elapsed_time"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["num_prompt_tokens"] + r["num_output_tokens"]) / r["elapsed_time"])
    assert r["num_prompt_tokens"] == n * 12
    assert r["num_steps"] >= out_len and r["device_ms_per_step"] > 0
    assert r["host_ms_per_step"] > 0
    wall = r["step_ms_per_step"] * r["num_steps"]
    dev = r["device_ms_per_step"] * r["num_steps"]
    assert r["host_overhead_fraction"] == pytest.approx((wall - dev) / dev, rel=0.05)
    prof = r["profile"]  # the traced run: the device's (here the CPU client's) time per op
    assert prof["num_prompts"] == 4 and {"jit_forward", "jit_sample"} <= set(
        prof["module_time_ms"])
    assert sum(prof["module_time_ms"].values()) == pytest.approx(prof["op_time_ms"])
    ops = prof["top_ops"]
    assert ops and all(a["total_ms"] >= b["total_ms"] for a, b in zip(ops, ops[1:]))
    assert sum(op["fraction"] for op in ops) <= 1 + 1e-9
    assert ops[0]["total_ms"] == pytest.approx(ops[0]["fraction"] * prof["op_time_ms"])
    from benchmarks import profile_summary
    again = profile_summary.main([str(tmp_path / "trace"), "--output-json",
                                  str(tmp_path / "prof.json")])
    assert again["op_time_ms"] == pytest.approx(prof["op_time_ms"])
    parts = r["host_breakdown_ms_per_step"]  # the phases add up to the host's time
    assert set(parts) == {"schedule", "rows", "plan", "dispatch", "update", "output", "other"}
    assert sum(parts.values()) == pytest.approx(r["host_ms_per_step"], rel=1e-6)
    assert min(v for k, v in parts.items() if k != "other") > 0
    assert parts["plan"] == pytest.approx(r["plan_ms_per_step"])
    sync = d["jaxserve_sync"]
    assert r["async_scheduling"] is True and sync["async_scheduling"] is False
    assert sync["num_output_tokens"] == r["num_output_tokens"]
    assert d["host_overhead_fraction_sync"] == sync["host_overhead_fraction"]
    assert r["decode_batch"] == 4 and r["decode_step_throughput"] > 0
    assert isinstance(r["compiles_after_warmup"], int) and r["compiles_after_warmup"] >= 0
    # baselines measured the same requests
    hf, cb = d["baselines"]["hf"], d["baselines"]["hf_cb"]
    assert "error" not in hf, hf.get("error")
    assert [run["batch_size"] for run in hf["runs"]] == [2, 4]
    for run in hf["runs"]:
        assert run["output_tokens"] == run["num_requests"] * out_len
        assert run["output_throughput"] == pytest.approx(run["output_tokens"] / run["elapsed_s"])
    assert hf["output_throughput"] == max(run["output_throughput"] for run in hf["runs"])
    impls = {run["attn_implementation"]: run for run in cb["runs"]}
    assert impls["sdpa"]["output_tokens"] == n * out_len
    assert "error" in impls["no_such_attention"]
    assert cb["best"]["attn_implementation"] == "sdpa"
    assert d["output_throughput_vs_hf"] == pytest.approx(r["output_throughput"] /
                                                         hf["output_throughput"])
    assert d["output_throughput_vs_hf_cb"] == pytest.approx(r["output_throughput"] /
                                                            cb["output_throughput"])
    roof = d["roofline"]
    assert roof["batch"] == min(n, 4) and roof["bandwidth_gbps"] > 0
    assert d["output_throughput_of_roofline"] == pytest.approx(
        r["output_throughput"] / roof["output_tokens_per_s"])
    assert _is_png(d["plot"])
    table = B.summary_table(str(tmp_path))
    assert files[0].name in table and "output_throughput_vs_hf" in table
    assert out["output_throughput"] == r["output_throughput"]


def test_step_plan_benchmark(tmp_path):
    from benchmarks import step_plan

    out = step_plan.main(["--iters", "2", "--context", "64", "--output-json",
                          str(tmp_path / "sp.json")])
    steps = out["ms_per_step"]
    assert list(steps) == ["prepare_inputs", "build_step_plan"]
    for cases in steps.values():
        assert list(cases) == ["decode 64", "decode 128", "decode 256",
                               "192 decode + 4 x 256 prefill"]
        assert all(0 < v < 1000 for v in cases.values())
    assert out["ratio"] == {k: steps["prepare_inputs"][k] / steps["build_step_plan"][k]
                            for k in steps["prepare_inputs"]}
    assert json.loads((tmp_path / "sp.json").read_text())["ms_per_step"] == steps
    assert _is_png(out["plot"])


def test_dummy_init_benchmark(tmp_path):
    from benchmarks import dummy_init

    out = dummy_init.main(["--hybrid-shape", "cpu", "--output-json", str(tmp_path / "d.json")])
    load, jit = out["dummy_load"], out["one_jit"]
    assert load["total_s"] > 0 and jit["compile_s"] > 0 and jit["lower_s"] > 0
    assert load["param_bytes"] > 0
    assert out["one_jit_compile_over_dummy_load"] == pytest.approx(jit["total_s"]
                                                                   / load["total_s"])
    saved = json.loads((tmp_path / "d.json").read_text())
    assert saved["dummy_load"] == load and saved["one_jit"] == jit
    assert _is_png(out["plot"])
    with pytest.raises(SystemExit):  # a flag that would do nothing is an error
        dummy_init.main(["--preset", "tinyllama-1.1b", "--num-layers", "4"])


def test_host_cpu_measures_each_tree_in_its_own_process(tmp_path, tiny_llama_dir):
    """The same tree twice: per-pass numbers from the child, medians and the ratio of them."""
    from pathlib import Path

    from benchmarks import host_cpu

    root = str(Path(__file__).resolve().parents[2])
    out = host_cpu.main([f"a={root}", f"b={root}", "--model", str(tiny_llama_dir),
                         "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                         "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                         "--max-model-len", "64", "--passes", "2", "--rounds", "1",
                         "--output-json", str(tmp_path / "h.json")])
    for name in ("a", "b"):
        st = out["sets"][name]
        assert len(st["passes"]) == 2 and all(p["steps"] >= 4 for p in st["passes"])
        assert 0 < st["host_cpu_ms_per_step"] < 1000
        assert st["host_cpu_ms_per_step"] == pytest.approx(  # the median of two passes
            sum(p["host_cpu_ms_per_step"] for p in st["passes"]) / 2)
    assert out["host_cpu_ratio"] == pytest.approx(out["sets"]["b"]["host_cpu_ms_per_step"]
                                                  / out["sets"]["a"]["host_cpu_ms_per_step"])
    assert json.loads((tmp_path / "h.json").read_text())["sets"]["a"]["passes"] == \
        out["sets"]["a"]["passes"]
    assert _is_png(out["plot"])


def test_host_phases_takes_medians_of_each_set(tmp_path):
    from benchmarks import host_phases

    def write(directory, i, host, phases, tput):
        res = dict(output_throughput=tput, host_ms_per_step=host, device_ms_per_step=1.0,
                   step_ms_per_step=host, host_overhead_fraction=host - 1.0,
                   host_breakdown_ms_per_step=phases)
        d = tmp_path / directory
        d.mkdir(exist_ok=True)
        (d / f"throughput-x-{i}.json").write_text(json.dumps(
            dict(device="cpu: cpu x1", git_commit=directory, jaxserve=res)))

    for i, (host, sched) in enumerate([(9.0, 3.0), (8.0, 2.0), (20.0, 10.0)]):
        write("a", i, host, {"schedule": sched, "plan": 1.0}, 100.0 + i)
    for i, (host, sched) in enumerate([(4.0, 1.0), (6.0, 0.5)]):
        write("b", i, host, {"schedule": sched, "plan": 2.0}, 200.0 + i)
    out = host_phases.main([f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "--output-json",
                            str(tmp_path / "cmp.json")])
    a, b = out["sets"]["a"], out["sets"]["b"]
    assert a["num_runs"] == 3 and a["host_ms_per_step"] == 9.0  # the median, not the mean
    assert a["host_breakdown_ms_per_step"] == {"schedule": 3.0, "plan": 1.0}
    assert b["host_ms_per_step"] == 5.0 and b["host_breakdown_ms_per_step"]["schedule"] == 0.75
    assert a["git_commits"] == ["a"] and len(b["files"]) == 2
    assert out["host_ms_ratio"] == pytest.approx(5.0 / 9.0)
    assert out["output_throughput_ratio"] == pytest.approx(200.5 / 101.0)
    assert json.loads((tmp_path / "cmp.json").read_text())["host_ms_ratio"] == out["host_ms_ratio"]
    assert _is_png(out["plot"])
    with pytest.raises(SystemExit):
        host_phases.main([f"a={tmp_path}/nothing", "--output-json", str(tmp_path / "x.json")])


@pytest.mark.slow
def test_latency_end_to_end(tmp_path, tiny_llama_dir):
    from benchmarks import latency

    latency.main(["--model", str(tiny_llama_dir), "--batch-size", "3", "--input-len", "8",
                  "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "4",
                  *ENGINE_FLAGS, "--roofline", "--result-dir", str(tmp_path)])
    (f,) = tmp_path.glob("latency-*.json")
    d = json.loads(f.read_text())
    r = d["jaxserve"]
    assert len(r["latencies"]) == 4 and min(r["latencies"]) > 0
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 4)
    ps = [r["percentiles"][str(q)] for q in latency.PERCENTILES]
    assert ps == sorted(ps) and min(r["latencies"]) <= ps[0] and ps[-1] <= max(r["latencies"])
    assert r["output_tokens_per_s"] == pytest.approx(3 * 4 / r["avg_latency"])
    assert r["compiles_during_timed_iters"] == 0
    assert 0 < d["latency_of_roofline"] == pytest.approx(
        d["roofline"]["latency_s"] / r["median_latency_s"])
    assert _is_png(d["plot"])


@pytest.mark.slow
def test_serving_against_launched_server(tmp_path, tiny_llama_dir):
    httpx = pytest.importorskip("httpx")
    from benchmarks import serving

    n, out_len = 5, 4
    # budget 2 tokens: a ladder of two buckets keeps the server's warm-up short on CPU
    serving.main(["--launch", "--model", str(tiny_llama_dir), "--num-prompts", str(n),
                  "--input-len", "6", "--output-len", str(out_len), "--max-num-seqs", "2",
                  "--max-num-batched-tokens", "2", "--request-rates", "inf,0.5x",
                  "--goodput", "ttft:60000", "tpot:60000", "--disable-tqdm",
                  "--launch-timeout", "600", "--result-dir", str(tmp_path)])
    (f,) = tmp_path.glob("serving-*.json")
    d = json.loads(f.read_text())
    assert len(d["runs"]) == 2
    peak = d["runs"][0]
    assert d["runs"][1]["request_rate"] == pytest.approx(0.5 * peak["request_throughput"])
    for m in d["runs"]:
        assert m["completed"] == n and m["failed"] == 0, m.get("errors")
        assert m["total_output_tokens"] == n * out_len and m["num_wrong_length"] == 0
        assert m["total_input_tokens"] == n * 6
        assert 0 < m["median_ttft_ms"] <= m["median_e2el_ms"]
        assert m["mean_tpot_ms"] > 0
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration"])
        # generous SLOs: every request is good
        assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert _is_png(d["plot"])
    with pytest.raises(httpx.TransportError):  # the launched server was stopped
        httpx.get(d["config"]["base_url"] + "/health", timeout=5)


def test_make_tiny_model_preset_flag(tmp_path):
    from jaxserve.testing.presets import PRESETS

    out = tmp_path / "tl"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--preset",
                    "tinyllama-1.1b", "--out", str(out)], check=True, capture_output=True)
    assert json.loads((out / "config.json").read_text()) == PRESETS["tinyllama-1.1b"]
    assert (out / "tokenizer.json").exists() and not list(out.glob("*.safetensors"))
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--preset",
                          "tinyllama-1.1b", "--arch", "llama", "--out", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "exclude" in bad.stderr


@pytest.mark.slow
def test_moe_decode_against_its_dense_twin(tmp_path):
    """benchmarks/moe_decode.py on a tiny Mixtral shape: both models decode every batch, the
    ratio is the two measured rates, the dense twin has the MoE model's active weights (all but
    the router), and the expected experts per layer go from top_k at batch 1 towards all."""
    from benchmarks import moe_decode as M
    from jaxserve.testing.presets import dense_twin, preset_config

    out = tmp_path / "moe.json"
    res = M.main(["--overrides", json.dumps(dict(hidden_size=64, intermediate_size=96,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 vocab_size=256)),
                  "--num-layers", "2", "--batch-sizes", "1,4", "--input-len", "8",
                  "--output-len", "4", "--max-num-batched-tokens", "32", "--min-token-bucket",
                  "32", "--output-json", str(out)])
    saved = json.loads(out.read_text())
    assert _is_png(str(out)[:-5] + ".png")
    moe, dense = saved["models"]["moe"], saved["models"]["dense"]
    for b, m, d in zip((1, 4), moe["rows"], dense["rows"]):
        assert m["batch"] == d["batch"] == b and m["decode_tok_s"] > 0 and d["decode_tok_s"] > 0
        assert saved["moe_vs_dense"][str(b)] == pytest.approx(m["decode_tok_s"] / d["decode_tok_s"])
    assert res["moe_vs_dense"] == saved["moe_vs_dense"]
    cfg = saved["configs"]["moe"]
    h, e, nb = cfg["hidden_size"], cfg["num_local_experts"], np.dtype(moe["dtype"]).itemsize
    router = cfg["num_hidden_layers"] * h * e * nb
    assert moe["active_weight_bytes"] - dense["total_weight_bytes"] == router
    assert moe["total_weight_bytes"] > moe["active_weight_bytes"]
    twin = dense_twin(preset_config("mixtral-8x7b"))
    assert twin["model_type"] == "llama" and twin["intermediate_size"] == 2 * 14336
    assert "num_local_experts" not in twin
    assert M.experts_touched(cfg, 1) == pytest.approx(2.0)
    assert 2.0 < M.experts_touched(cfg, 4) < M.experts_touched(cfg, 64) <= e


def test_hybrid_shape_directory_with_an_mtp_head(tmp_path):
    """benchmarks.hybrid_decode.write_shape: the gpu_run mtp stage's model, a Qwen3.6-shaped
    hybrid (3 Gated DeltaNet layers to 1 attention layer) with a one-layer MTP head."""
    from jaxserve.config import ModelConfig
    from benchmarks.hybrid_decode import SHAPES, write_shape

    out = write_shape("cpu", mtp=True, out_dir=str(tmp_path / "m"))
    cfg = json.loads(Path(out, "config.json").read_text())
    n = SHAPES["cpu"]["num_hidden_layers"]
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * (n // 4)
    assert cfg["mtp_num_hidden_layers"] == 1
    assert "mtp_num_hidden_layers" not in json.loads(
        Path(write_shape("cpu", out_dir=str(tmp_path / "plain")), "config.json").read_text())
    assert ModelConfig.from_hf_config(cfg).num_layers == n

"""benchmarks/kernels.py runs end to end on CPU (tiny shapes, interpret mode) and its numbers hold."""
from __future__ import annotations

import glob
import json
import os

import pytest

kernels = pytest.importorskip("benchmarks.kernels")


def test_kernel_benchmark_tiny(tmp_path, capsys):
    rc = kernels.main(["--tiny", "--ctx", "64", "--iters", "1", "--result-dir", str(tmp_path),
                       "--disable-tqdm"])
    assert rc == 0
    (path,) = glob.glob(str(tmp_path / "kernels-tiny-*.json"))
    assert os.path.exists(path[:-5] + ".png")
    res = json.load(open(path))
    assert res["meta"]["git_commit"] and res["meta"]["versions"]["jax"]
    assert res["copy_bandwidth"]["bandwidth_bytes_per_s"] > 0
    kinds = {c["kind"]: c for c in res["cases"]}
    assert set(kinds) == {"decode", "mixed"}
    for case in res["cases"]:
        assert case["check"]["ok"] and case["check"]["rel_err"] <= 2e-2
        assert case["ours"]["median_s"] > 0 and case["ours"]["frac_copy_bw"] > 0
    dec = kinds["decode"]
    # JAX's own paged attention (and the dense decode op) agree with ours on the same batch.
    assert dec["jax_paged_attention"]["rel_err_vs_ours"] <= 2e-2
    assert dec["jax_decode_attention_dense"]["rel_err_vs_ours"] <= 2e-2
    assert kinds["mixed"]["bound"]["bound_s"] > 0
    # Backends side by side (only pallas runs on CPU) and the measured choice is recorded.
    assert set(dec["backends"]) == {"pallas"}
    assert dec["backends"]["pallas"]["median_s"] == dec["ours"]["median_s"]
    assert res["default_backend"]["backend"] == "pallas"
    assert "decode_ctx64" in capsys.readouterr().out


def test_kernel_benchmark_fp8_pages(tmp_path):
    """--kv-cache-dtype: float8 pages with per-head scales, checked against the reference on
    the same pages; a perfect kernel reads half the bytes of bf16 pages."""
    base = ["--tiny", "--cases", "decode", "--ctx", "64", "--iters", "1", "--no-plot",
            "--disable-tqdm"]
    res = {}
    for kv in ("auto", "fp8_e5m2"):
        out = tmp_path / kv
        assert kernels.main(base + ["--kv-cache-dtype", kv, "--result-dir", str(out)]) == 0
        (path,) = glob.glob(str(out / "kernels-tiny-*.json"))
        res[kv] = json.load(open(path))
    (dec,) = res["fp8_e5m2"]["cases"]
    assert res["fp8_e5m2"]["config"]["kv_cache_dtype"] == "fp8_e5m2"
    assert dec["check"]["ok"] and dec["check"]["rel_err"] <= 2e-2
    assert dec["kv_bytes"] * 2 == res["auto"]["cases"][0]["kv_bytes"]
    assert "skipped" in dec["jax_paged_attention"]


def test_flop_count_matches_brute_force():
    class A:
        num_q_heads, head_dim = 3, 8

    q_lens, ctx = [4, 1], [10, 7]
    keys = sum(c - ql + i + 1 for ql, c in zip(q_lens, ctx) for i in range(ql))
    assert kernels.attention_flops(q_lens, ctx, A) == 4 * keys * 3 * 8


@pytest.mark.slow
def test_gdn_lora_benchmark_tiny(tmp_path, capsys):
    """--cases gdn,lora: both kernels checked against the reference, timed beside their XLA
    path and their bound / base, written to JSON + PNG."""
    rc = kernels.main(["--tiny", "--cases", "gdn,lora", "--iters", "1", "--result-dir",
                       str(tmp_path), "--disable-tqdm"])
    assert rc == 0
    (path,) = glob.glob(str(tmp_path / "kernels-tiny-*.json"))
    assert os.path.exists(path[:-5] + "-gdn-lora.png")
    res = json.load(open(path))
    assert res["cases"] == [] and len(res["gdn"]) == 3 and len(res["lora"]) == 3
    for case in res["gdn"]:
        for backend in ("pallas", "xla"):
            assert case[f"check_{backend}"]["ok"] and case[f"check_{backend}"]["rel_err"] <= 2e-2
            assert case[backend]["median_s"] > 0
        bw = res["copy_bandwidth"]["bandwidth_bytes_per_s"]
        assert 0 < case["bound_s"] == pytest.approx((case["state_bytes"] + case["io_bytes"]) / bw)
    kinds = {c["case"].split("_")[1]: c for c in res["lora"]}
    assert set(kinds) == {"decode", "prefill", "mixed"}
    assert kinds["prefill"]["runs"] == 2 and kinds["decode"]["runs"] > 2
    for case in res["lora"]:
        assert case["check_pallas"]["ok"] and case["check_xla"]["ok"]
        assert case["pallas"]["throughput_vs_base"] > 0
    assert "gdn_decode_B4" in capsys.readouterr().out

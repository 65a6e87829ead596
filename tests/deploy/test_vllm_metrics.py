"""``--metrics-prefix vllm`` against a real server (the vLLM entry point on the tiny model): every
name that jaxserve's dashboard and rules read is exported under vLLM's prefix, the gauges vLLM's
guide uses exist, and the guide's three alert rules (deploy/prometheus/vllm-alerts.yaml) pass a
promtool unit test whose input series are the series this server exports, labels included."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server_process import free_port, stop, wait_healthy
from test_deploy import METRIC_RE, PROM, adapter_names, dashboard_exprs, promtool, run

ROOT = Path(__file__).resolve().parents[2]
MODEL = "demo-random"
TINY = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--min-token-bucket", "32", "--num-gpu-blocks-override", "32",
        # speculation on, so the spec-decode counters the dashboard reads exist
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
# What the vLLM guide's dashboards and alerts read.
GUIDE_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc", "vllm:cpu_cache_usage_perc",
    "vllm:avg_prompt_throughput_toks_per_s", "vllm:avg_generation_throughput_toks_per_s",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_success_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
}
SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? ", re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p),
               JAX_COMPILATION_CACHE_DIR=str(tmp / "xla"))
    env.pop("JAXSERVE_API_KEY", None)
    env.pop("VLLM_API_KEY", None)
    log_path = tmp / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.openai.api_server",
                                 "--model", MODEL, *TINY, "--port", str(port),
                                 "--metrics-prefix", "vllm", "--uvicorn-log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(port, [proc], [log_path], timeout=300)
        base = f"http://127.0.0.1:{port}"
        httpx.get(f"{base}/metrics", timeout=10)  # the throughput meter's first reading
        for i in range(3):
            r = httpx.post(f"{base}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 8,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
        time.sleep(1.1)  # past the throughput meter's minimum interval
        yield base
    finally:
        stop(proc, timeout=60)


def samples(base: str) -> list[tuple[str, dict[str, str], float]]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out.append((m.group(1), labels, float(line.rsplit(" ", 1)[1])))
    return out


@pytest.mark.slow
def test_every_metric_is_published_under_vllms_names(server):
    got = samples(server)
    names = {n for n, _, _ in got}
    assert not {n for n in names if n.startswith("jaxserve:")}, "a jaxserve: name leaked"
    assert GUIDE_NAMES <= names, sorted(GUIDE_NAMES - names)
    # everything jaxserve's own dashboard, rules and autoscaler read, under vLLM's prefix
    recorded = {r["record"] for g in yaml.safe_load((PROM / "jaxserve-rules.yaml").read_text())
                ["groups"] for r in g["rules"] if "record" in r}
    used = {n for text in [*dashboard_exprs(), *adapter_names()] for n in METRIC_RE.findall(text)}
    wanted = {"vllm:" + n.split(":", 1)[1] for n in used if n not in recorded}
    assert wanted and wanted <= names, sorted(wanted - names)
    value = {n: v for n, labels, v in got if labels.get("model_name") == MODEL}
    assert value["vllm:generation_tokens_total"] >= 24
    assert value["vllm:avg_generation_throughput_toks_per_s"] > 0
    assert value["vllm:gpu_cache_usage_perc"] == value["vllm:kv_cache_usage_perc"]
    assert value["vllm:request_success_total"] >= 3


def _series(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


@pytest.mark.slow
def test_guide_alert_rules_fire_on_the_exported_series(server, tmp_path):
    tool = promtool()
    got = samples(server)
    # the real series of each metric the alerts read (instance is added by the scrape)
    gauge_labels = {n: dict(labels, instance="a") for n, labels, _ in got
                    if n in ("vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting")}
    buckets = {labels["le"]: dict(labels, instance="a") for n, labels, _ in got
               if n == "vllm:e2e_request_latency_seconds_bucket"}
    assert set(gauge_labels) == {"vllm:gpu_cache_usage_perc", "vllm:num_requests_waiting"}
    assert {"30.0", "40.0", "+Inf"} <= set(buckets)
    model = gauge_labels["vllm:num_requests_waiting"]["model_name"]
    series = [
        {"series": _series("vllm:gpu_cache_usage_perc", gauge_labels["vllm:gpu_cache_usage_perc"]),
         "values": "0.97x10"},
        {"series": _series("vllm:num_requests_waiting", gauge_labels["vllm:num_requests_waiting"]),
         "values": "150x10"},
    ]
    # every request takes between 30 and 40 s: p99 is in (30, 40]
    for le, labels in buckets.items():
        per_min = 0 if float(le) < 40.0 else 10
        series.append({"series": _series("vllm:e2e_request_latency_seconds_bucket", labels),
                       "values": f"0+{per_min}x10"})
    a = gauge_labels["vllm:gpu_cache_usage_perc"]
    test = {
        "rule_files": [str(PROM / "vllm-alerts.yaml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "8m", "alertname": "VLLMKVCacheHigh",
                 "exp_alerts": [{"exp_labels": dict(a, instance="a", severity="warning"),
                                 "exp_annotations": {
                                     "summary": "KV cache usage above 95 % on a"}}]},
                {"eval_time": "8m", "alertname": "VLLMQueueDepthHigh",
                 "exp_alerts": [{"exp_labels": dict(gauge_labels["vllm:num_requests_waiting"],
                                                    severity="warning"),
                                 "exp_annotations": {"summary": "150 requests waiting on a"}}]},
                {"eval_time": "10m", "alertname": "VLLMHighLatencyP99",
                 "exp_alerts": [{"exp_labels": {"model_name": model, "severity": "warning"},
                                 "exp_annotations": {
                                     "summary": f"p99 end-to-end latency above 30 s for {model}"}}]},
                # before "for: 5m" has passed nothing fires
                {"eval_time": "3m", "alertname": "VLLMKVCacheHigh", "exp_alerts": []},
            ],
        }],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = run([tool, "check", "rules", str(PROM / "vllm-alerts.yaml")], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    out = run([tool, "test", "rules", "t.yaml"], tmp_path)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    # the same test fails when the rule reads a name the server does not export
    broken = (PROM / "vllm-alerts.yaml").read_text().replace(
        "vllm:num_requests_waiting", "vllm:num_requests_queued")
    (tmp_path / "broken.yaml").write_text(broken)
    test["rule_files"] = [str(tmp_path / "broken.yaml")]
    (tmp_path / "t2.yaml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = run([tool, "test", "rules", "t2.yaml"], tmp_path)
    assert out.returncode != 0 and "VLLMQueueDepthHigh" in out.stdout + out.stderr

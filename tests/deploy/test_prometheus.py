"""deploy/ against a running ``jaxserve serve --model demo-random`` (one server for the module):
every metric name that the dashboard, the rules and the autoscaler's adapter use is exported by
``/metrics``; and, where Prometheus is installed, the real Prometheus scrapes the server with
deploy/prometheus/'s jobs and rules, and its HTTP API answers every dashboard query, the recorded
series and the health job."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from server_process import free_port, stop, wait_healthy
from test_deploy import (METRIC_RE, PROM, adapter_names, dashboard_exprs,
                         static_scrape_config)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--min-token-bucket", "32", "--num-gpu-blocks-override", "32",
        # speculation on, so the dashboard's spec-decode panel has series to read
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
MODEL = "demo-random"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(port, base_url)`` of a running server; its log is shown if it fails to start."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p),
               JAX_COMPILATION_CACHE_DIR=str(tmp / "xla"))
    env.pop("JAXSERVE_API_KEY", None)
    log_path = tmp / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxserve.entrypoints.cli", "serve",
                                 "--model", MODEL, *TINY, "--port", str(port),
                                 "--uvicorn-log-level", "warning"],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        # (the server answers while its warm-up still compiles in the background: the alerts
        # must stay quiet through it)
        wait_healthy(port, [proc], [log_path], timeout=300)
        yield port, f"http://127.0.0.1:{port}"
    finally:
        stop(proc, timeout=60)


def send_requests(base: str, n: int = 3) -> None:
    for i in range(n):
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": f"hello {i}", "max_tokens": 4,
                             "ignore_eos": True, "stream": i == 0})
        assert r.status_code == 200, r.text


def exported_names(base: str) -> set[str]:
    """Sample names in the exposition (``x_bucket``, ``x_total``, ...), not family names."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M)}


def rules() -> tuple[list[str], set[str]]:
    """(every rule expression, the recorded series names)."""
    groups = yaml.safe_load((PROM / "jaxserve-rules.yaml").read_text())["groups"]
    items = [r for g in groups for r in g["rules"]]
    return [r["expr"] for r in items], {r["record"] for r in items if "record" in r}


@pytest.mark.slow
def test_every_queried_metric_is_exported(server):
    _, base = server
    send_requests(base)  # request_success_total{finished_reason} appears with the first finish
    deadline = time.time() + 300  # num_compiles_at_warmup appears when the warm-up ends
    while "jaxserve:num_compiles_at_warmup" not in (names := exported_names(base)):
        assert time.time() < deadline, "no num_compiles_at_warmup: the warm-up never ended"
        time.sleep(0.5)
    exprs, recorded = rules()
    used = {}
    for where, texts in (("dashboard", dashboard_exprs()), ("rules", exprs),
                         ("adapter", list(adapter_names()))):
        for text in texts:
            for name in METRIC_RE.findall(text):
                used.setdefault(name, where)
    assert used, "no jaxserve: metric found in the queries"
    missing = {n: w for n, w in used.items() if n not in names and n not in recorded}
    assert not missing, f"queried but not exported by /metrics: {missing}"
    # and the check can fail: a name /metrics does not export is not among the names
    assert "jaxserve:no_such_metric_total" not in names
    # the health job's contract: /health is an empty 200 while the engine runs
    r = httpx.get(f"{base}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""


# ---- the real Prometheus --------------------------------------------------------------------
def prom_query(api: str, expr: str) -> list[dict]:
    r = httpx.get(f"{api}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def wait_for(api: str, expr: str, ok, timeout: float = 60) -> list[dict]:
    deadline = time.time() + timeout
    while True:
        result = prom_query(api, expr)
        if ok(result):
            return result
        assert time.time() < deadline, f"{expr}: {result}"
        time.sleep(0.5)


def dashboard_query(expr: str) -> str:
    """The dashboard's variables as Grafana would expand them with 'All' selected."""
    return (expr.replace("$model_name", ".*").replace("$instance", ".*")
            .replace("$__rate_interval", "1m").replace("$__range", "5m"))


@pytest.mark.slow
def test_prometheus_scrapes_records_and_answers_the_dashboard(server, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    port, base = server
    shutil.copy(PROM / "jaxserve-rules.yaml", tmp_path)
    cfg = static_scrape_config(f"127.0.0.1:{port}", interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    # the rules at a 1 s interval instead of the global one
    groups = yaml.safe_load((tmp_path / "jaxserve-rules.yaml").read_text())
    for g in groups["groups"]:
        g["interval"] = "1s"
    (tmp_path / "jaxserve-rules.yaml").write_text(yaml.safe_dump(groups))
    web = free_port()
    api = f"http://127.0.0.1:{web}"
    log_path = tmp_path / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{api}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        # both jobs scrape: /metrics and the /health probe
        up = wait_for(api, "up", lambda r: len(r) == 2 and all(s["value"][1] == "1" for s in r))
        assert {s["metric"]["job"] for s in up} == {"jaxserve", "jaxserve-health"}
        before = float(wait_for(api, "sum(jaxserve:generation_tokens_total)",
                                lambda r: len(r) == 1)[0]["value"][1])
        send_requests(base, n=3)
        after = wait_for(api, "sum(jaxserve:generation_tokens_total)",
                         lambda r: r and float(r[0]["value"][1]) >= before + 12)
        assert float(after[0]["value"][1]) == before + 12  # 3 requests x 4 tokens
        # the recording rules produce numbers from the real histograms and counters
        rate = wait_for(api, "jaxserve:generation_tokens:rate5m",
                        lambda r: r and float(r[0]["value"][1]) > 0)
        assert rate[0]["metric"]["model_name"] == MODEL
        p99 = wait_for(api, "jaxserve:time_to_first_token_seconds:p99_5m",
                       lambda r: r and r[0]["value"][1] not in ("NaN", "0"))
        assert 0 < float(p99[0]["value"][1]) <= 2560
        # every dashboard query returns series (a missing name or bad PromQL would not)
        for expr in dashboard_exprs():
            q = dashboard_query(expr)
            assert wait_for(api, q, bool, timeout=30), q
        # and the alerts, evaluated on the live data, are all quiet
        alerts = httpx.get(f"{api}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        assert alerts == [], alerts
        rule_groups = httpx.get(f"{api}/api/v1/rules", timeout=10).json()["data"]["groups"]
        health = {r["name"]: r["health"] for g in rule_groups for r in g["rules"]}
        exprs, _ = rules()
        assert len(health) == len(exprs) and set(health.values()) == {"ok"}, health
    finally:
        stop(proc, timeout=30)

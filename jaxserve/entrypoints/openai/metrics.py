"""Prometheus metrics with vLLM's names under the ``jaxserve:`` prefix (``vllm:`` with
``--metrics-prefix vllm``, so alert rules and dashboards written for vLLM read them unchanged).

Two sources: engine-wide state (running/waiting requests, KV pool usage, prefix-cache and token
counters, preemptions, compiles) is read from ``engine.stats()`` at scrape time by a collector,
so it can never drift from the engine; per-request latencies (TTFT, inter-token, end-to-end) are
observed by the server as outputs stream out. Each app gets its own ``CollectorRegistry`` so
several servers can live in one process (tests).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.core.outputs import RequestOutput

logger = logging.getLogger(__name__)

PREFIXES = ("jaxserve", "vllm")
# vLLM's logger averages throughput over its log interval; scrapes closer than this reuse the
# last figure so a fast scraper does not read noise
THROUGHPUT_MIN_INTERVAL_S = 1.0
# vLLM labels every metric with the model and the engine (core) index; one core serves here
LABELS = ["model_name", "engine"]
ENGINE = "0"

# vLLM's buckets (seconds / tokens), so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class EngineStatsCollector:
    """Gauges and counters read from ``engine.stats()`` on every scrape."""

    def __init__(self, stats: Callable[[], dict], model_name: str, prefix: str = "jaxserve"):
        self._stats = stats
        self._model_name = model_name
        self._prefix = prefix + ":"
        self._throughput = ThroughputMeter()

    def collect(self):
        s = self._stats()
        label = [self._model_name, ENGINE]
        prefix = self._prefix

        def gauge(name, doc, value):
            g = GaugeMetricFamily(prefix + name, doc, labels=LABELS)
            g.add_metric(label, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(prefix + name, doc, labels=LABELS)
            c.add_metric(label, float(value))
            return c

        prompt_tps, generation_tps = self._throughput.update(
            time.monotonic(), s.get("prompt_tokens_total", 0), s.get("generation_tokens_total", 0))

        usage = float(s.get("kv_cache_usage", 0.0))
        queries = s.get("prefix_cache_queries", 0)
        hits = s.get("prefix_cache_hits", 0)
        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    s.get("num_running", 0))
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    s.get("num_waiting", 0))
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge("gpu_cache_usage_perc",
                    "KV-cache usage (vLLM's older name). 1 means 100 percent usage.", usage)
        yield gauge("cpu_cache_usage_perc",
                    "Swap space in use for preempted requests' KV pages. 1 means 100 percent.",
                    s.get("cpu_cache_usage_perc", 0.0))
        yield gauge("avg_prompt_throughput_toks_per_s",
                    "Average prefill throughput in tokens/s since the previous scrape.",
                    prompt_tps)
        yield gauge("avg_generation_throughput_toks_per_s",
                    "Average generation throughput in tokens/s since the previous scrape.",
                    generation_tps)
        yield gauge("gpu_prefix_cache_hit_rate", "Prefix cache hit rate over the server's life.",
                    hits / queries if queries else 0.0)
        yield gauge("num_kv_pages", "KV pages in the pool (page 0, the trash page, included).",
                    s.get("num_pages", 0))
        yield gauge("num_free_kv_pages", "KV pages free or held only by the prefix cache.",
                    s.get("num_free_pages", 0))
        yield gauge("num_compiles",
                    "XLA compilations of the step so far (warm-up included; must not grow).",
                    s.get("num_compiles", 0))
        if "num_compiles_at_warmup" in s:  # absent while the warm-up still compiles
            yield gauge("num_compiles_at_warmup",
                        "num_compiles when warm-up ended: any above it is a step shape the "
                        "bucket ladder missed.", s["num_compiles_at_warmup"])
        yield counter("prefix_cache_queries", "Prefix cache queries, in tokens.", queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in tokens.", hits)
        if "external_prefix_cache_queries" in s:  # the host-memory tier (--kv-offloading-size)
            yield counter("external_prefix_cache_queries",
                          "Prefix cache queries past the device pool (host tier), in tokens.",
                          s["external_prefix_cache_queries"])
            yield counter("external_prefix_cache_hits",
                          "Prefix cache hits served from the host tier, in tokens.",
                          s.get("external_prefix_cache_hits", 0))
            yield gauge("kv_offload_usage_perc",
                        "Host KV tier usage (blocks held). 1 means 100 percent.",
                        s.get("kv_offload_usage_perc", 0.0))
        yield counter("prompt_tokens", "Number of prefill tokens processed.",
                      s.get("prompt_tokens_total", 0))
        yield counter("generation_tokens", "Number of generation tokens processed.",
                      s.get("generation_tokens_total", 0))
        yield counter("num_preemptions", "Cumulative number of preemptions.",
                      s.get("num_preemptions", 0))
        memory = s.get("memory_bytes") or {}
        if memory:
            g = GaugeMetricFamily(
                prefix + "process_memory_bytes",
                "The engine core's memory by part: rss (resident set), weights, kv_reserved "
                "(the page pool), kv_resident (its pages written so far, CPU) and rest (rss "
                "less weights and resident KV: runtime, compiled programs, Python).",
                labels=LABELS + ["part"])
            for part, value in memory.items():
                g.add_metric(label + [part], float(value))
            yield g
        if "max_lora" in s:  # LoRA on: vLLM's info gauge (labels carry the state)
            g = GaugeMetricFamily(prefix + "lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters",
                                          "running_lora_adapters"])
            g.add_metric([str(s["max_lora"]), s.get("waiting_lora_adapters", ""),
                          s.get("running_lora_adapters", "")], time.time())
            yield g
        if "spec_decode_num_drafts" in s:  # speculative decoding on
            yield counter("spec_decode_num_drafts", "Number of spec decoding drafts (verify"
                          " steps of one request).", s["spec_decode_num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Number of draft tokens.",
                          s["spec_decode_num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          s["spec_decode_num_accepted_tokens"])
            c = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.",
                                    labels=LABELS + ["position"])
            for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
                c.add_metric(label + [str(pos)], float(n))
            yield c


class ThroughputMeter:
    """Token rates between two readings of the engine's cumulative counters."""

    def __init__(self):
        self._last: tuple[float, float, float] | None = None
        self._rates = (0.0, 0.0)

    def update(self, now: float, prompt_total: float, generation_total: float
               ) -> tuple[float, float]:
        if self._last is None:
            self._last = (now, prompt_total, generation_total)
            return self._rates
        t0, p0, g0 = self._last
        if now - t0 >= THROUGHPUT_MIN_INTERVAL_S:
            dt = now - t0
            self._rates = ((prompt_total - p0) / dt, (generation_total - g0) / dt)
            self._last = (now, prompt_total, generation_total)
        return self._rates


class ServerMetrics:
    """The registry of one app: the engine collector plus the request histograms.
    ``prefix``: ``jaxserve`` or ``vllm`` (every name then reads as vLLM's own)."""

    def __init__(self, stats: Callable[[], dict], model_name: str, prefix: str = "jaxserve"):
        if prefix not in PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.first_request_logged = False  # the start-up log reports the first request's speed
        self.model_name = model_name
        self.prefix = prefix
        self.registry.register(EngineStatsCollector(stats, model_name, prefix))
        def hist(name, doc, buckets):
            return Histogram(f"{prefix}:{name}", doc, LABELS, buckets=buckets,
                             registry=self.registry).labels(model_name, ENGINE)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency.",
                        ITL_BUCKETS)
        # vLLM's meanings: the gap before each output token (time_per_output_token_seconds is
        # its older name for the same), and each request's mean over its decode phase
        self.tpot = hist("time_per_output_token_seconds",
                         "Histogram of time per output token (deprecated alias of "
                         "inter_token_latency_seconds).", ITL_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Histogram of the mean time per output token of each request.",
                                 ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "Histogram of end-to-end request latency.", E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Histogram of time spent waiting before the first step.",
                               E2E_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens",
                                  "Number of prefill tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Number of generation tokens per request.", TOKEN_BUCKETS)
        self.success = Counter(f"{prefix}:request_success", "Count of finished requests.",
                               [*LABELS, "finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observer(self) -> "RequestObserver":
        return RequestObserver(self)


class RequestObserver:
    """Follows one engine request's cumulative outputs and records its latencies once."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self._last: dict[int, tuple[float, int]] = {}  # choice index -> (time, tokens so far)
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        for c in out.outputs:
            n = len(c.token_ids)
            last_t, last_n = self._last.get(c.index, (None, 0))
            if n <= last_n:
                continue
            if self.first_token is None:
                self.first_token = now
            if last_t is not None:  # spread the gap over the tokens that arrived together
                gap = (now - last_t) / (n - last_n)
                for _ in range(n - last_n):
                    self.m.itl.observe(gap)
                    self.m.tpot.observe(gap)
            self._last[c.index] = (now, n)

    def on_finish(self, out: RequestOutput | None, finish_reasons: list[str | None]) -> None:
        if self._done:
            return
        self._done = True
        now = time.monotonic()
        for reason in finish_reasons:
            self.m.success.labels(self.m.model_name, ENGINE, reason or "abort").inc()
        if out is None:
            return
        gen_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.m.prompt_tokens.observe(len(out.prompt_token_ids))
        self.m.generation_tokens.observe(gen_tokens)
        # Prefer the engine's own timestamps (they exclude HTTP and tokenization time).
        em = out.metrics
        if em is not None and em.first_token_time is not None:
            ttft = em.first_token_time - em.arrival_time
            end = em.finished_time or em.last_token_time or em.first_token_time
            e2e = end - em.arrival_time
            decode = end - em.first_token_time
            if em.first_scheduled_time is not None:
                self.m.queue_time.observe(max(0.0, em.first_scheduled_time - em.arrival_time))
        elif self.first_token is not None:
            ttft = self.first_token - self.arrival
            e2e = now - self.arrival
            decode = now - self.first_token
        else:
            return
        self.m.ttft.observe(max(0.0, ttft))
        self.m.e2e.observe(max(0.0, e2e))
        per_seq = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
        if per_seq > 1:
            self.m.request_tpot.observe(max(0.0, decode) / (per_seq - 1))
            if not self.m.first_request_logged:
                self.m.first_request_logged = True
                logger.info("first request: %d prompt tokens, time to first token %.2f s, "
                            "decode %.1f tokens/s", len(out.prompt_token_ids), ttft,
                            (per_seq - 1) / max(decode, 1e-9))

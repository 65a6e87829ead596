"""Data parallelism: independent engine replicas behind one ``AsyncLLM``-shaped front.

``data_parallel_size`` replicas each own ``pipeline_parallel_size x tensor_parallel_size``
devices (disjoint subsets, in ``jax.devices()`` order), their own KV pool, scheduler and engine thread. Nothing is shared
between them on the device, so a replica is exactly a single-replica engine. Each new request
goes to the replica with the fewest unfinished requests (ties: the lowest index), which keeps
batch sizes even under mixed lengths without any cross-replica traffic.
"""
from __future__ import annotations

import logging
from typing import AsyncIterator

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.config import EngineConfig
from jaxserve.engine.builder import build_engine
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# stats() fields that add up over replicas; the rest are averaged (kv_cache_usage)
_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
           "num_preemptions", "num_compiles", "prompt_tokens_total", "generation_tokens_total",
           "num_free_pages", "num_pages", "external_prefix_cache_queries",
           "external_prefix_cache_hits")


def replica_devices(data_parallel_size: int, tensor_parallel_size: int, devices=None,
                    pipeline_parallel_size: int = 1) -> list:
    """The device subset of each replica: ``pp x tp`` consecutive devices per replica (a
    replica's pipeline stages are ``tp`` consecutive devices each)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    t = tensor_parallel_size * pipeline_parallel_size
    need = data_parallel_size * t
    if need > len(devices):
        pp = (f" x pipeline_parallel_size={pipeline_parallel_size}"
              if pipeline_parallel_size > 1 else "")
        raise InvalidRequestError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size="
            f"{tensor_parallel_size}{pp} needs {need} devices; {len(devices)} available",
            param="data_parallel_size")
    return [devices[i * t:(i + 1) * t] for i in range(data_parallel_size)]


def replica_device_names(engine) -> list[str]:
    """The devices a replica's engine runs on (every stage's under pipelining)."""
    import jax

    stages = getattr(engine.runner, "stages", None)  # a pooling runner has none
    mesh = stages.pipeline_mesh if stages is not None else engine.mesh
    return [str(d) for d in (mesh.devices.flat if mesh is not None else jax.devices()[:1])]


class DataParallelAsyncLLM:
    """The ``AsyncLLM`` interface over ``data_parallel_size`` replicas."""

    def __init__(self, config: EngineConfig, devices=None):
        p = config.parallel
        self.replicas = [AsyncLLM(config, engine=build_engine(config, devices=d))
                         for d in replica_devices(p.data_parallel_size,
                                                  p.tensor_parallel_size, devices,
                                                  p.pipeline_parallel_size)]
        first = self.replicas[0]
        self.config = first.config  # resolved for the platform
        self.engine = first.engine  # dtype, tokenizer, ... are the same in every replica
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.default_sampling = first.default_sampling
        self.served_model_name = first.served_model_name
        self.takes_images = first.takes_images  # every replica has its own encoder step
        self.chat_template = None
        self._inflight = [0] * len(self.replicas)  # unfinished requests routed to each
        self.requests_per_replica = [0] * len(self.replicas)  # all routed so far
        self._replica_of: dict[str, int] = {}
        logger.info("data parallel: %d replicas on devices %s", len(self.replicas),
                    [replica_device_names(r.engine) for r in self.replicas])

    def _pick(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: (self._inflight[i], i))

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str, *, priority: int = 0, lora_request=None
                       ) -> AsyncIterator[RequestOutput]:
        self.check_health()
        if request_id in self._replica_of:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        i = self._pick()
        self._inflight[i] += 1
        self.requests_per_replica[i] += 1
        self._replica_of[request_id] = i
        try:
            async for out in self.replicas[i].generate(prompt, sampling_params, request_id,
                                                       priority=priority,
                                                       lora_request=lora_request):
                yield out
        finally:
            self._inflight[i] -= 1
            self._replica_of.pop(request_id, None)

    async def add_lora(self, lora_request) -> bool:
        """Every replica loads the adapter (any may serve its requests)."""
        for r in self.replicas:
            await r.add_lora(lora_request)
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        found = [await r.remove_lora(lora_int_id) for r in self.replicas]
        return any(found)

    async def abort(self, request_id: str) -> None:
        i = self._replica_of.get(request_id)
        if i is not None:
            await self.replicas[i].abort(request_id)

    def check_health(self) -> None:
        for r in self.replicas:
            r.check_health()

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    def stats(self) -> dict:
        per = [r.stats() for r in self.replicas]
        out = {k: sum(s.get(k, 0) for s in per) for k in _SUMMED if k in per[0]}
        out["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in per) / len(per)
        if all("num_compiles_at_warmup" in s for s in per):  # once every warm-up has ended
            out["num_compiles_at_warmup"] = sum(s["num_compiles_at_warmup"] for s in per)
        if all("memory_bytes" in s for s in per):  # each replica is its own process
            out["memory_bytes"] = {k: sum(s["memory_bytes"].get(k, 0) for s in per)
                                   for k in per[0]["memory_bytes"]}
        if "spec_decode_num_drafts" in per[0]:
            for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                      "spec_decode_num_accepted_tokens"):
                out[k] = sum(s[k] for s in per)
            out["spec_decode_num_accepted_tokens_per_pos"] = [
                sum(col) for col in zip(*(s["spec_decode_num_accepted_tokens_per_pos"]
                                          for s in per))]
        return out

    def startup_progress(self) -> tuple[bool, int, int]:
        """Ready when every replica is; buckets counted over all of them."""
        per = [r.startup_progress() for r in self.replicas]
        return all(p[0] for p in per), sum(p[1] for p in per), sum(p[2] for p in per)

    async def reset_prefix_cache(self) -> bool:
        results = [await r.reset_prefix_cache() for r in self.replicas]
        return all(results)

    async def shutdown(self) -> None:
        for r in self.replicas:
            await r.shutdown()


def make_async_llm(config: EngineConfig, background_warmup: bool = False):
    """``AsyncLLM`` for one replica, ``DataParallelAsyncLLM`` for ``data_parallel_size > 1``,
    the multi-host leader's engine for ``num_hosts > 1`` (``jaxserve.engine.multihost_engine``).
    ``background_warmup`` (one replica only): return before the buckets are compiled."""
    if config.parallel.num_hosts > 1:
        from jaxserve.engine.multihost_engine import make_leader_async_llm

        return make_leader_async_llm(config)
    if config.parallel.data_parallel_size > 1:
        return DataParallelAsyncLLM(config)
    return AsyncLLM(config, background_warmup=background_warmup)

"""Data parallel: two engine replicas on two (fake CPU) devices serve concurrent requests.

Runs in a child process with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (set before
jax is imported); the child prints JSON and the assertions are made here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The capital of France is", "Hello world, my name", "one two three four",
           "The capital of France is", "a b c d e f", "Hello world, my name"]


def _child(model: str) -> dict:
    import asyncio

    from jaxserve.engine.data_parallel import DataParallelAsyncLLM
    from jaxserve.entrypoints.llm import engine_config_from_kwargs
    from jaxserve.errors import InvalidRequestError
    from jaxserve.core.sampling_params import SamplingParams

    cfg = engine_config_from_kwargs(model, data_parallel_size=2, max_num_batched_tokens=32,
                                    min_token_bucket=32, max_num_seqs=4, max_model_len=128)
    llm = DataParallelAsyncLLM(cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def one(i, prompt):
        last = None
        async for out in llm.generate(prompt, sp, f"req-{i}"):
            last = out
        return list(last.outputs[0].token_ids), last.finished

    async def main():
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        for _ in range(100):  # replicas refresh their stats snapshot right after a step
            stats = llm.stats()
            if stats["generation_tokens_total"] == 8 * len(PROMPTS):
                break
            await asyncio.sleep(0.05)
        await llm.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    try:
        engine_config_from_kwargs(model, data_parallel_size=3)
        from jaxserve.engine.data_parallel import replica_devices
        replica_devices(3, 1)
        err = None
    except InvalidRequestError as e:
        err = e.param
    return dict(
        tokens=[r[0] for r in results], finished=[r[1] for r in results],
        requests_per_replica=llm.requests_per_replica,
        generated_per_replica=[r.engine.generation_tokens_total for r in llm.replicas],
        devices=[sorted(str(d) for d in r.engine.mesh.devices.flat) for r in llm.replicas],
        param_devices=[sorted(str(d) for d in
                              r.engine.model.model.norm.weight.get_value().sharding.device_set)
                       for r in llm.replicas],
        stats=stats, too_many_error_param=err)


def test_two_replicas_serve_concurrent_requests(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, model], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["finished"]) and all(len(t) == 8 for t in r["tokens"])
    # both replicas got work, on disjoint devices
    assert sorted(r["requests_per_replica"]) == [3, 3]
    assert all(g > 0 for g in r["generated_per_replica"])
    assert sum(r["generated_per_replica"]) == 8 * len(PROMPTS)
    assert r["devices"][0] != r["devices"][1] and r["param_devices"] == r["devices"]
    # the same greedy prompt gives the same tokens whichever replica served it
    assert r["tokens"][0] == r["tokens"][3] and r["tokens"][1] == r["tokens"][5]
    assert r["stats"]["generation_tokens_total"] == 8 * len(PROMPTS)
    assert r["too_many_error_param"] == "data_parallel_size"


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))

"""Start-up with the buckets compiled in the background.

* ``CompilePool`` runs jobs in order on its threads, a waiter moves a queued job to the front,
  ``cancel`` (at exit) drops queued jobs and lets the running one finish,
  and a failed job fails its waiter.
* An engine with ``background_warmup`` serves at once: its steps pick compiled buckets or wait
  for the one they need, and never compile in the stepping thread (the thread-local trace count
  of the test's thread stays put), also for prompt logprobs; the results equal a blocking
  warm-up's engine, and the pool compiled every graph exactly once.
* With ``enforce_eager`` nothing compiles ahead of time: the engine is ready at once, a step
  compiles the buckets it uses (only those, once each) and no compile-after-warm-up warning
  is logged.
* While only the smallest bucket is compiled, steps are kept within it (long prompts go in
  chunks of that size) and every request completes with the tokens of a warmed-up engine.
* ``/health`` of a server whose engine is compiling answers 503 with the progress, then 200
  once the smallest bucket is compiled, and requests sent before that complete; shutting the
  engine down drops the compiles still queued (no thread keeps tracing after it).
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from jaxserve.worker.compile_pool import CompilePool


def test_compile_pool_order_bump_and_errors():
    gate = threading.Event()
    order = []

    def job(k):
        def run():
            if k == "a":
                gate.wait(10)
            if k == "bad":
                raise ValueError("boom")
            order.append(k)
        return run

    keys = ["a", "b", "c", "d", "bad"]
    pool = CompilePool([(k, job(k)) for k in keys], workers=1).start()
    time.sleep(0.1)  # the worker holds "a"
    waiter = threading.Thread(target=pool.wait, args=("d",))
    waiter.start()
    time.sleep(0.1)
    gate.set()
    waiter.join(10)
    assert pool.is_done("d")
    with pytest.raises(RuntimeError, match="bad"):
        pool.wait("bad")
    with pytest.raises(RuntimeError):
        pool.wait_all()
    assert order == ["a", "d", "b", "c"]  # "d" jumped the queue when waited for
    assert not pool.is_done("bad")
    with pytest.raises(KeyError):
        pool.wait("nope")


def _engine_config(model_dir):
    from jaxserve.config import EngineConfig, SchedulerConfig, CacheConfig

    return EngineConfig(model=str(model_dir), dtype="float32",
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                                  min_token_bucket=4, max_model_len=128),
                        cache=CacheConfig(num_gpu_blocks_override=64))


def _engine(model_dir, background: bool):
    from jaxserve.engine.builder import build_engine

    return build_engine(_engine_config(model_dir), background_warmup=background)


def _run_all(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def test_background_warmup_never_compiles_in_the_step(tiny_model_factory):
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker import step_functions as step_fns

    # shapes no other test uses (vocab, MLP width): the jitted graphs, shared by engines of
    # one model shape, are compiled here for the first time whatever ran before
    model_dir = tiny_model_factory("llama", vocab=520, intermediate=136)
    prompts = [[5 + i] * n for i, n in enumerate((3, 9, 17, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)

    # first: engines of one model share their jitted graphs, so the second compiles nothing
    eng = _engine(model_dir, background=True)
    runner = eng.runner
    ready, k, n = eng.startup_progress()
    assert n == len(runner.ladder) == 4 and k < n  # ladder 4, 8, 16, 32: still compiling
    traces = step_fns.TRACES.n  # this thread's traces: the steps run here
    outs = _run_all(eng, prompts, params)
    assert step_fns.TRACES.n == traces  # no step compiled: they waited for the pool
    runner._compiles.wait_all()
    assert runner.warmed_up and eng.startup_progress() == (True, n, n)
    assert runner.num_compiles == runner.num_graphs  # every graph once, all in the pool
    ref = _run_all(_engine(model_dir, background=False), prompts, params)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [None if d is None else sorted(d) for d in a.prompt_logprobs] == \
            [None if d is None else sorted(d) for d in b.prompt_logprobs]


def test_warmup_freezes_the_startup_heap_and_requests_stay_collectable(tiny_model_factory):
    """After warm-up the start-up objects sit outside the collector (gc.freeze); what a request
    leaves behind is still collected."""
    import dataclasses
    import gc
    import weakref

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.builder import build_engine

    gc.unfreeze()
    eng = _engine(tiny_model_factory("llama"), background=False)
    assert gc.get_freeze_count() > 10_000
    gc.unfreeze()
    build_engine(dataclasses.replace(_engine_config(tiny_model_factory("llama")),
                                     enforce_eager=True))
    assert gc.get_freeze_count() > 10_000  # no warm-up: frozen once loaded
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = _run_all(eng, [[5, 6, 7]], params)[0]
    ref = weakref.ref(out)
    cycle = [out]
    cycle.append(cycle)  # a reference cycle only the collector frees
    del out, cycle
    gc.collect()
    assert ref() is None


def test_enforce_eager_compiles_each_bucket_on_first_use(tiny_model_factory, caplog):
    """--enforce-eager: no warm-up, ready at once; the steps compile the buckets they use (and
    only those), without the compile-after-warm-up warning; a second round compiles nothing."""
    import dataclasses
    import logging

    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.engine.builder import build_engine

    caplog.set_level(logging.INFO, logger="jaxserve")
    model_dir = tiny_model_factory("llama", vocab=524, intermediate=140)  # graphs not yet built
    cfg = dataclasses.replace(_engine_config(model_dir), enforce_eager=True)
    eng = build_engine(cfg, background_warmup=True)
    runner = eng.runner
    n = len(runner.ladder)
    assert runner.num_compiles == 0 and eng.startup_progress() == (True, 0, n)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _run_all(eng, [[7, 8, 9]], params)  # prefill and decodes: the smallest buckets only
    first = runner.num_compiles
    assert 0 < first < runner.num_graphs
    _run_all(eng, [[7, 8, 10]], params)
    assert runner.num_compiles == first
    msgs = [r.getMessage() for r in caplog.records]
    assert any("enforce_eager: no ahead-of-time warm-up" in m for m in msgs)
    assert not any("this is a bug" in m for m in msgs)


def test_steps_fit_the_compiled_buckets_while_others_compile(tiny_model_factory, monkeypatch):
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker.warmup import BucketWarmup

    gate = threading.Event()
    original = BucketWarmup._compile_bucket

    def held(self, t):  # every bucket but the smallest waits for the test's go
        if t != self.ladder[0]:
            assert gate.wait(300)
        return original(self, t)

    model_dir = tiny_model_factory("llama")
    prompts = [[7 + i] * n for i, n in enumerate((2, 11, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    monkeypatch.setattr(BucketWarmup, "_compile_bucket", held)
    eng = _engine(model_dir, background=True)
    buckets = []
    build = eng.input_batch.prepare_inputs

    def recording(diff, **kwargs):
        plan = build(diff, **kwargs)
        buckets.append(plan.token_bucket)
        return plan

    eng.input_batch.prepare_inputs = recording
    try:
        deadline = time.time() + 300
        while not eng.startup_progress()[0]:
            assert time.time() < deadline
            time.sleep(0.05)
        assert eng.startup_progress() == (True, 1, 4)
        assert eng.runner.step_token_limit() == 4
        outs = _run_all(eng, prompts, params)
        assert set(buckets) == {4}  # 30 prompt tokens went in chunks of 4; nothing waited
        assert eng.startup_progress() == (True, 1, 4)
    finally:
        gate.set()
    eng.runner._compiles.wait_all()
    assert eng.runner.step_token_limit() is None
    monkeypatch.undo()
    ref = _run_all(_engine(model_dir, background=False), prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_health_reports_starting_then_ready(tiny_model_factory, monkeypatch):
    import asyncio

    import openai

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.app import build_app
    from jaxserve.worker.warmup import BucketWarmup
    from tests.server_process import ServerThread

    gate = threading.Event()
    original = BucketWarmup._compile_bucket

    def held(self, t):  # compiles wait for the test's go
        assert gate.wait(120)
        return original(self, t)

    monkeypatch.setattr(BucketWarmup, "_compile_bucket", held)
    eng = _engine(tiny_model_factory("llama"), background=True)
    engine = AsyncLLM(eng.config, engine=eng)
    try:
        with ServerThread(build_app(engine, served_model_names=["tiny"])) as srv:
            r = httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10)
            assert r.status_code == 503
            assert r.json() == {"status": "starting", "buckets_ready": 0, "of": 4}
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="x",
                                   max_retries=0, timeout=120)
            result = {}
            early = threading.Thread(target=lambda: result.update(c=client.completions.create(
                model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0.0)))
            early.start()  # sent while nothing is compiled: waits, then completes
            time.sleep(0.3)
            assert "c" not in result
            gate.set()
            deadline = time.time() + 120
            while httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10).status_code != 200:
                assert time.time() < deadline
                time.sleep(0.1)
            ready, k, n = eng.startup_progress()
            assert ready and k >= 1 and n == 4
            early.join(120)
            assert result["c"].usage.completion_tokens == 3
    finally:
        gate.set()
        asyncio.run(engine.shutdown())
    # the buckets still queued were dropped at shutdown and no compile thread is left running
    assert not any(t.is_alive() for t in eng.runner._compiles._threads)


def test_compile_pool_cancel_drops_queued_jobs():
    gate = threading.Event()
    ran = []
    pool = CompilePool([("a", lambda: (gate.wait(10), ran.append("a"))),
                        ("b", lambda: ran.append("b"))], workers=1).start()
    time.sleep(0.1)  # "a" is running
    pool.cancel()
    with pytest.raises(RuntimeError, match="'b'"):
        pool.wait("b")  # dropped: its waiter is told, never left hanging
    gate.set()
    pool.join(10)
    assert ran == ["a"]  # the running job finished; the queued one never ran


def test_first_answer_needs_no_full_sampler_layout_and_penalties_wait(tiny_model_factory,
                                                                       monkeypatch):
    """The full sampler layout (penalties, wide tables) compiles in jobs of its own after the
    token buckets: greedy requests complete while those jobs are held; a request with a
    penalty then waits for them (its step compiles nothing) and matches a warmed-up engine."""
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.worker import step_functions as step_fns
    from jaxserve.worker.warmup import BucketWarmup

    gate = threading.Event()
    original = BucketWarmup._compile_full_sampler
    held_jobs = []

    def held(self, s):
        held_jobs.append(s)
        assert gate.wait(300)
        return original(self, s)

    model_dir = tiny_model_factory("llama", vocab=528, intermediate=144)  # graphs not built yet
    monkeypatch.setattr(BucketWarmup, "_compile_full_sampler", held)
    eng = _engine(model_dir, background=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    penalty = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5)
    try:
        deadline = time.time() + 300
        while not held_jobs:  # every token bucket compiled: the pool reached the full layout
            assert time.time() < deadline
            time.sleep(0.05)
        out = _run_all(eng, [[7, 8, 9]], greedy)
        assert len(held_jobs) == 1 and not eng.runner.warmed_up  # still held
    finally:
        gate.set()
    traces = step_fns.TRACES.n
    pen = _run_all(eng, [[7, 8, 9, 7, 8]], penalty)
    assert step_fns.TRACES.n == traces  # the step waited for the pool's full layout
    eng.runner._compiles.wait_all()
    assert eng.runner.num_compiles == eng.runner.num_graphs
    monkeypatch.undo()
    ref = _engine(model_dir, background=False)
    assert out[0].outputs[0].token_ids == _run_all(ref, [[7, 8, 9]], greedy)[0].outputs[0].token_ids
    assert pen[0].outputs[0].token_ids == \
        _run_all(ref, [[7, 8, 9, 7, 8]], penalty)[0].outputs[0].token_ids

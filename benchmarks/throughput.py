"""Offline throughput, like vLLM's ``benchmarks/benchmark_throughput.py``.

N requests (random or fixed lengths, or ShareGPT) go through ``LLM.generate`` at once, greedy
with ``ignore_eos`` so every request generates exactly its output length. Reports requests/s,
total and output tokens/s, the host and device time per engine step (host = scheduling + plan
building + output processing, device = the step call until its sampled ids are on the host) and
the compiles after warm-up; with ``--hf-baseline / --hf-cb-baseline / --roofline`` the same run
measures HF transformers ``generate``, HF ``generate_batch`` and the decode roofline on the same
shapes and prompts and adds ``*_vs_hf``, ``*_vs_hf_cb`` and ``*_of_roofline``.

    python benchmarks/throughput.py --preset tinyllama-1.1b --num-prompts 1024 \\
        --input-len 512 --output-len 128 --hf-baseline --hf-cb-baseline --roofline
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import baselines as B  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    B.add_model_args(p)
    B.add_request_args(p, input_len=512, output_len=128, num_prompts=1000)
    p.add_argument("--disable-detokenize", action="store_true",
                   help="skip detokenization (vLLM's flag); HF baselines never detokenize")
    p.add_argument("--num-warmup-prompts", type=int, default=8,
                   help="requests run (4 output tokens each) before the timed run")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine's async scheduling (vLLM's flag)")
    p.add_argument("--compare-async-scheduling", action="store_true",
                   help="also run the engine with async scheduling off, same requests, and "
                        "report both (jaxserve_sync)")
    p.add_argument("--profile-dir", default=None,
                   help="after the timed run, trace a decode-heavy generate (jax.profiler) "
                        "into this directory and put the device's time per op in the JSON "
                        "(profile)")
    p.add_argument("--profile-num-prompts", type=int, default=None,
                   help="requests of the traced run (default: max_num_seqs of them, 16 "
                        "output tokens each)")
    B.add_baseline_args(p)
    B.add_output_args(p)
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    return args


class StepTimer:
    """Times every engine step and keeps each dispatched plan, so the device time of the same
    steps can be measured afterwards with nothing else running (``replay_device_time``).

    ``host_overhead_fraction`` = (wall time of the steps - device busy time) / device busy
    time: 0 when the host never keeps the device waiting. ``host_ms_per_step`` is the host's own
    work per step (the step's wall time minus the time it waited for the device's ids).
    """

    def __init__(self, engine):
        self.engine, self.runner = engine, engine.runner
        self.records: list[dict] = []
        self.plans: list[tuple] = []
        self._cur: dict | None = None
        self.batch = engine.input_batch
        self._orig = (engine.step, self.runner.dispatch, self.runner.fetch,
                      self.batch.prepare_inputs)
        engine.step, self.runner.dispatch, self.runner.fetch = self._step, self._dispatch, self._fetch
        self.batch.prepare_inputs = self._prepare_inputs
        # where the host's time goes: each phase of a step, timed around the engine's own calls
        self._phases = {"schedule_s": (engine.scheduler, "schedule"),
                        "execute_s": (engine, "_execute"), "update_s": (engine, "_update"),
                        "output_s": (engine.output_processor, "process")}
        for key, (obj, name) in self._phases.items():
            setattr(obj, name, self._timed(key, getattr(obj, name)))
        self.enabled = False

    def _timed(self, key: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self._cur is not None:
                    self._cur[key] = self._cur.get(key, 0.0) + time.perf_counter() - t0
        return timed

    def _step(self):
        if not self.enabled:
            return self._orig[0]()
        self._cur = {"fetch_s": 0.0, "plan_s": 0.0, "dispatch_s": 0.0, "rows": 0, "tokens": 0}
        t0 = time.perf_counter()
        out = self._orig[0]()
        self._cur["step_s"] = time.perf_counter() - t0
        self.records.append(self._cur)
        self._cur = None
        return out

    def _dispatch(self, plan, *args, **kwargs):
        t0 = time.perf_counter()
        h = self._orig[1](plan, *args, **kwargs)
        if self._cur is not None:
            self.plans.append((plan, args, kwargs))
            self._cur["dispatch_s"] += time.perf_counter() - t0
        return h

    def _fetch(self, handle):
        t0 = time.perf_counter()
        out = self._orig[2](handle)
        if self._cur is not None:
            self._cur["fetch_s"] += time.perf_counter() - t0
        return out

    def _prepare_inputs(self, diff, *args, **kwargs):
        t0 = time.perf_counter()
        plan = self._orig[3](diff, *args, **kwargs)
        if self._cur is not None:
            self._cur["plan_s"] += time.perf_counter() - t0
            self._cur["rows"] = plan.num_seqs
            self._cur["tokens"] = plan.num_tokens
        return plan

    def restore(self) -> None:
        self.engine.step, self.runner.dispatch, self.runner.fetch = self._orig[:3]
        del self.batch.prepare_inputs  # the instance attribute hid the class's method
        for obj, name in self._phases.values():
            delattr(obj, name)  # the instance attribute hid the class's method

    def host_breakdown(self, recs: list[dict]) -> dict:
        """Mean ms per step of each host phase: scheduling; the plan rows and bookkeeping
        around the plan (``execute`` less plan and dispatch); building the plan; the jitted
        call's dispatch (argument transfer, launch); reading ids into the requests (``update``
        less the wait for them); the output processor; and what is left of the step."""
        def ms(key):
            return 1e3 * sum(r.get(key, 0.0) for r in recs) / len(recs)
        parts = dict(schedule=ms("schedule_s"),
                     rows=ms("execute_s") - ms("plan_s") - ms("dispatch_s"),
                     plan=ms("plan_s"), dispatch=ms("dispatch_s"),
                     update=ms("update_s") - ms("fetch_s"), output=ms("output_s"))
        parts["other"] = ms("step_s") - ms("fetch_s") - sum(parts.values())
        return parts

    def replay_device_time(self) -> list[float]:
        """Each recorded plan run again, alone, waiting for its ids: the device busy time of
        that step (dispatch included). The pages it writes are garbage afterwards, so the prefix
        cache is reset."""
        import jax

        times = []
        for plan, args, kwargs in self.plans:
            t0 = time.perf_counter()
            h = self._orig[1](plan, *args, **kwargs)
            jax.block_until_ready(h.sampled.token_ids)
            times.append(time.perf_counter() - t0)
        self.engine.block_manager.reset_prefix_cache()
        return times

    def summary(self, max_num_seqs: int) -> dict:
        recs = [r for r in self.records if r["rows"] > 0]
        if not recs:
            return {"num_steps": 0}
        dev = self.replay_device_time()
        wall = sum(r["step_s"] for r in self.records)
        host = [r["step_s"] - r["fetch_s"] for r in recs]
        out = dict(num_steps=len(recs),
                   step_ms_per_step=1e3 * wall / len(recs),
                   host_ms_per_step=1e3 * sum(host) / len(recs),
                   device_ms_per_step=1e3 * sum(dev) / len(dev),
                   plan_ms_per_step=1e3 * sum(r["plan_s"] for r in recs) / len(recs),
                   host_breakdown_ms_per_step=self.host_breakdown(recs),
                   host_overhead_fraction=(wall - sum(dev)) / max(sum(dev), 1e-12),
                   mean_rows_per_step=sum(r["rows"] for r in recs) / len(recs),
                   mean_tokens_per_step=sum(r["tokens"] for r in recs) / len(recs))
        # Pure decode steps at the largest batch seen (256 running on a GPU by default).
        decode = [(r, d) for r, d in zip(recs, dev) if r["tokens"] == r["rows"]]
        if decode:
            top = max(r["rows"] for r, _ in decode)
            full = [(r, d) for r, d in decode if r["rows"] == top]
            s = B.percentile([r["step_s"] for r, _ in full], 50)
            d = B.percentile([d for _, d in full], 50)
            out.update(decode_batch=top, decode_batch_is_max_num_seqs=top == max_num_seqs,
                       num_decode_steps_at_batch=len(full),
                       decode_step_ms=1e3 * s, decode_device_ms_per_step=1e3 * d,
                       decode_host_overhead_fraction=(s - d) / max(d, 1e-12),
                       decode_step_throughput=top / max(s, 1e-12))
        return out


def run_jaxserve(args, model_dir: str, requests: list[B.BenchRequest], log=print,
                 async_scheduling: bool | None = None) -> dict:
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    kwargs = B.llm_kwargs(args, requests)
    if async_scheduling is not None:
        kwargs["async_scheduling"] = async_scheduling
    t0 = time.perf_counter()
    llm = LLM(model_dir, **kwargs)
    init_s = time.perf_counter() - t0
    engine = llm.llm_engine
    compiles_init = engine.runner.num_compiles
    log(f"engine up in {init_s:.1f} s, {compiles_init} compiles at warm-up")

    detok = not args.disable_detokenize

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True,
                              detokenize=detok)

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    if args.num_warmup_prompts > 0:
        k = min(args.num_warmup_prompts, len(requests))
        llm.generate(prompts[:k], [params(min(4, r.output_len)) for r in requests[:k]],
                     use_tqdm=False)
    timer = StepTimer(engine)
    timer.enabled = True
    sps = [params(r.output_len) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    timer.enabled = False
    timer.restore()

    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    short = [i for i, (o, r) in enumerate(zip(outs, requests))
             if len(o.outputs[0].token_ids) != r.output_len]
    stats = engine.stats()
    sched = engine.config.scheduler
    res = dict(
        elapsed_time=elapsed, num_requests=len(outs), total_num_tokens=n_prompt + n_out,
        num_prompt_tokens=n_prompt, num_output_tokens=n_out,
        requests_per_second=len(outs) / elapsed, tokens_per_second=(n_prompt + n_out) / elapsed,
        output_tokens_per_second=n_out / elapsed,
        request_throughput=len(outs) / elapsed, total_token_throughput=(n_prompt + n_out) / elapsed,
        output_throughput=n_out / elapsed,
        num_requests_wrong_length=len(short),
        engine_init_s=init_s, num_compiles_warmup=compiles_init,
        compiles_after_warmup=engine.runner.num_compiles - compiles_init,
        num_preemptions=stats.get("num_preemptions"), num_kv_pages=stats.get("num_pages"),
        max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=engine.max_model_len, attention_backend=engine.attention_backend,
        async_scheduling=engine.async_scheduling,
        dtype=B.resolved_dtype_name(args.dtype),
        token_buckets=[int(t) for t in getattr(engine.runner, "ladder", [])],
    )
    res.update(timer.summary(sched.max_num_seqs))
    if args.profile_dir:  # after every figure above: the traced run is not one of them
        from benchmarks import profile_summary

        k = args.profile_num_prompts or min(sched.max_num_seqs, len(prompts))
        xplane = profile_summary.trace_generate(
            llm, prompts[:k], [params(min(16, r.output_len)) for r in requests[:k]],
            args.profile_dir)
        res["profile"] = dict(num_prompts=k, output_len=16, **profile_summary.summarize(xplane))
    res["_step_records"] = timer.records
    if short:
        log(f"WARNING: {len(short)} requests did not generate exactly their output length")
    return res


def plot(path: str, result: dict, baselines: dict, roofline: dict | None, steps: list) -> str:
    plt = B.plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, vals = ["jaxserve"], [result["output_throughput"]]
    if "output_throughput" in baselines.get("hf", {}):
        bs = baselines["hf"].get("best", {}).get("batch_size", "?")
        names.append(f"HF generate\n(bs {bs})")
        vals.append(baselines["hf"]["output_throughput"])
    if "output_throughput" in baselines.get("hf_cb", {}):
        impl = baselines["hf_cb"].get("best", {}).get("attn_implementation", "?")
        names.append(f"HF generate_batch\n({impl})")
        vals.append(baselines["hf_cb"]["output_throughput"])
    if roofline:
        names.append(f"decode roofline\n(bs {roofline['batch']})")
        vals.append(roofline["output_tokens_per_s"])
    bars = ax1.bar(names, vals, color=["tab:blue", "tab:orange", "tab:green", "tab:gray"][
        :len(vals)])
    for b, v in zip(bars, vals):
        ax1.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title(f"{result['num_requests']} requests, in {result['_input_len']}, out "
                  f"{result['_output_len']}")
    if steps:
        xs = range(len(steps))
        ax2.plot(xs, [1e3 * s["step_s"] for s in steps], label="engine step (wall)", lw=0.8)
        ax2.plot(xs, [1e3 * (s["step_s"] - s["fetch_s"]) for s in steps],
                 label="host work (not waiting for ids)", lw=0.8)
        ax2.set_xlabel("engine step")
        ax2.set_ylabel("ms")
        ax2.set_title("time per step")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    model_dir = B.resolve_model(args.model, args.preset)
    cfg = B.load_hf_config(model_dir)
    requests = B.make_requests(args, model_dir, cfg["vocab_size"])
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    print(f"{len(requests)} requests; mean prompt {mean_in:.0f}, mean output {mean_out:.0f} tokens")
    path = B.result_path("throughput", args)
    baselines = B.run_baselines(args, model_dir, requests)  # before XLA takes the device
    if baselines:  # kept if the jaxserve run below dies or is timed out
        B.write_result(path, dict(benchmark="throughput", partial=True, config=vars(args),
                                  baselines=baselines))
    bandwidth = B.measure_copy_bandwidth() if args.roofline else None

    res_sync = None
    if args.compare_async_scheduling:
        res_sync = run_jaxserve(args, model_dir, requests, async_scheduling=False)
        res_sync.pop("_step_records")
        print(f"  async scheduling off: {res_sync['output_throughput']:.1f} output tok/s, "
              f"host_overhead_fraction {res_sync['host_overhead_fraction']:.3f}")
    res = run_jaxserve(args, model_dir, requests)
    steps = res.pop("_step_records")
    roofline = None
    if bandwidth:
        batch = min(res["max_num_seqs"], len(requests))
        roofline = B.roofline_for_run(cfg, res["dtype"], batch, mean_in, mean_out,
                                      B.bandwidth_value(bandwidth))
        roofline["copy_bandwidth"] = bandwidth
        res["output_throughput_of_roofline"] = res["output_throughput"] / roofline[
            "output_tokens_per_s"]
        if res.get("decode_step_throughput"):
            at = B.roofline_for_run(cfg, res["dtype"], res["decode_batch"], mean_in, mean_out,
                                    B.bandwidth_value(bandwidth))
            res["decode_roofline_at_batch"] = at["output_tokens_per_s"]
            res["decode_step_throughput_of_roofline"] = (res["decode_step_throughput"]
                                                         / at["output_tokens_per_s"])
    res.update(B.ratios(res, baselines))

    config = {k: v for k, v in vars(args).items()}
    config.update(model_dir=model_dir, mean_input_len=mean_in, mean_output_len=mean_out,
                  model_config={k: cfg.get(k) for k in (
                      "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "vocab_size")})
    out = dict(benchmark="throughput", **B.run_metadata(), config=config, jaxserve=res,
               baselines=baselines, roofline=roofline)
    if res_sync is not None:
        out["jaxserve_sync"] = res_sync
        out["host_overhead_fraction_sync"] = res_sync["host_overhead_fraction"]
        out["output_throughput_sync"] = res_sync["output_throughput"]
        out["output_throughput_async_vs_sync"] = (res["output_throughput"]
                                                  / res_sync["output_throughput"])
    # headline fields at the top level too, for tables
    for k in ("request_throughput", "output_throughput", "total_token_throughput",
              "compiles_after_warmup", "host_ms_per_step", "device_ms_per_step",
              "host_overhead_fraction", "decode_host_overhead_fraction"):
        if k in res:
            out[k] = res[k]
    for k, v in res.items():
        if k.endswith(("_vs_hf", "_vs_hf_cb", "_of_roofline")):
            out[k] = v
    if not args.no_plot:
        res["_input_len"], res["_output_len"] = round(mean_in), round(mean_out)
        out["plot"] = plot(path[:-5] + ".png", res, baselines, roofline, steps)
        del res["_input_len"], res["_output_len"]
    B.write_result(path, out)
    _print_summary(out)
    print(f"wrote {path}")
    return out


def _print_summary(out: dict) -> None:
    r = out["jaxserve"]
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, {r['output_throughput']:.2f} output "
          f"tokens/s ({r['elapsed_time']:.2f} s, {r['num_steps']} steps, host "
          f"{r.get('host_ms_per_step', 0):.2f} ms / device {r.get('device_ms_per_step', 0):.2f} "
          f"ms per step, {r['compiles_after_warmup']} compiles after warm-up)")
    if r.get("profile"):
        prof = r["profile"]
        print(f"  profile ({prof['num_prompts']} requests, {prof['op_time_ms']:.1f} ms of op "
              "time): " + ", ".join(f"{m} {v:.1f} ms" for m, v in prof["module_time_ms"].items()))
        for op in prof["top_ops"][:10]:
            print(f"    {op['total_ms']:9.3f} ms {op['fraction']:6.1%} x{op['count']:<5d} "
                  f"{op['name']}")
    if r.get("host_breakdown_ms_per_step"):
        print("  host ms per step: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["host_breakdown_ms_per_step"].items()))
    for k, v in out.items():
        if k.endswith(("_vs_hf", "_vs_hf_cb", "_of_roofline")):
            print(f"  {k}: {v:.3f}")


if __name__ == "__main__":
    main()

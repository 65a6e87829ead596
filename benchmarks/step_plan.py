"""Host cost of building one step's inputs, no device: ``InputBatch.prepare_inputs`` (the
engine's builder: the rows persist, the step is a diff) against ``build_step_plan`` (every row
rebuilt from its request, the engine's path before the persistent batch), on the same steps:
decode steps of 64 / 128 / 256 rows with a long context each (pages per row ~ context / 16;
only tokens changed since the last step), and a mixed step (prefill chunks beside decodes).
Pure numpy and Python, so the same on any machine with the same CPU.

    python -m benchmarks.step_plan --output-json step_plan.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import common as C  # noqa: E402

BLOCK = 16


def decode_rows(n: int, context: int, rng) -> list:
    """``n`` decode rows (a pending token each, greedy) with contexts around ``context``."""
    from jaxserve.core.request import PLACEHOLDER
    from jaxserve.core.sampling_metadata import SamplingRow
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.step_plan import ScheduledSeq

    sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows, first = [], 1
    for i in range(n):
        ctx = int(rng.integers(context, context + 128))
        k = ctx // BLOCK + 1
        rows.append(ScheduledSeq(new_token_ids=[PLACEHOLDER], start_pos=ctx,
                                 block_ids=[list(range(first, first + k))], prev_row=i,
                                 sampling=SamplingRow(sp, [1] * 8, [2] * ctx, [2], 8)))
        first += k
    return rows


def prefill_rows(n: int, chunk: int, first_page: int) -> list:
    """``n`` prefill chunks of ``chunk`` tokens that do not finish their prompts."""
    from jaxserve.core.step_plan import ScheduledSeq

    return [ScheduledSeq(new_token_ids=list(range(3, 3 + chunk)), start_pos=0,
                         block_ids=[list(range(first_page + i * (chunk // BLOCK + 1),
                                               first_page + (i + 1) * (chunk // BLOCK + 1)))],
                         sample=False) for i in range(n)]


def time_plan(rows, *, budget: int, max_pages: int, iters: int) -> float:
    """Best mean ms of build_step_plan over three rounds of ``iters`` calls."""
    from jaxserve.core.step_plan import token_ladder
    from jaxserve.testing.reference_plan import build_step_plan

    ladder, rng = token_ladder(budget), np.random.default_rng(0)

    def once():
        return build_step_plan(rows, block_size=BLOCK, max_pages_per_seq=max_pages,
                               ladder=ladder, max_num_seqs=256, history_len=max_pages * BLOCK,
                               rng=rng)

    return _best(once, iters)


def time_prepare(rows, *, budget: int, max_pages: int, iters: int) -> float:
    """Best mean ms of ``InputBatch.prepare_inputs`` for the same step: the rows are in the
    batch already (added once, as the scheduler's first diff of each does), the step's diff
    names them with their new tokens."""
    from jaxserve.core.batch_diff import BatchDiff, NewRequestData
    from jaxserve.core.request import PLACEHOLDER
    from jaxserve.core.sampling_params import SamplingParams
    from jaxserve.core.step_plan import token_ladder
    from jaxserve.worker.input_batch import InputBatch

    batch = InputBatch(max_rows=256, num_groups=1, max_pages=max_pages, block_size=BLOCK,
                       max_model_len=max_pages * BLOCK, max_num_seqs=256, eos_token_ids=[2],
                       seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    new = []
    for i, r in enumerate(rows):
        p = r.sampling.params if r.sampling is not None else greedy
        known = [3] * r.start_pos + [t for t in r.new_token_ids if t != PLACEHOLDER]
        new.append(NewRequestData(f"r{i}", known, r.start_pos if r.sample else len(known), p,
                                  [list(b) for b in r.block_ids]))
    batch.apply(BatchDiff(new_reqs=new))
    batch.apply(BatchDiff())  # a step later: the rows' pending ids on the device are theirs
    diff = BatchDiff(req_ids=[f"r{i}" for i in range(len(rows))],
                     num_tokens=[len(r.new_token_ids) for r in rows],
                     token_ids=[int(t) for r in rows for t in r.new_token_ids],
                     start_pos=[r.start_pos for r in rows], sample=[r.sample for r in rows],
                     num_draft=[0] * len(rows),
                     num_output=[r.sampling.num_generated if r.sampling else 0 for r in rows])
    ladder = token_ladder(budget)
    return _best(lambda: batch.prepare_inputs(diff, ladder=ladder), iters)


def _best(once, iters: int) -> float:
    for _ in range(5):
        once()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        best = min(best, (time.perf_counter() - t0) / iters)
    return 1e3 * best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=512, help="decode rows' context (tokens)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--output-json", default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    max_pages = max(args.context + 128, 256) // BLOCK + 2  # decode rows and prefill chunks
    steps = {f"decode {n}": decode_rows(n, args.context, rng) for n in (64, 128, 256)}
    dec = decode_rows(192, args.context, rng)
    steps["192 decode + 4 x 256 prefill"] = dec + prefill_rows(
        4, 256, 1 + sum(len(r.block_ids[0]) for r in dec))
    cases, baseline = {}, {}
    for name, rows in steps.items():
        kw = dict(budget=2048, max_pages=max_pages, iters=args.iters)
        cases[name] = time_prepare(rows, **kw)
        baseline[name] = time_plan(rows, **kw)
    out = dict(benchmark="step_plan", **C.run_metadata(), config=vars(args),
               ms_per_step={"prepare_inputs": cases, "build_step_plan": baseline},
               ratio={k: cases[k] / baseline[k] for k in cases})
    path = args.output_json or C.result_path("step_plan", args)
    if not args.no_plot:
        out["plot"] = C.bar_plot(path[:-5] + ".png", list(cases), {
            "prepare_inputs (persistent batch)": list(cases.values()),
            "build_step_plan (rows rebuilt)": list(baseline.values())},
            ylabel="ms per step", title="host cost of one step's inputs")
    C.write_json(path, out)
    for k in cases:
        print(f"{k}: prepare_inputs {cases[k]:.3f} ms, build_step_plan {baseline[k]:.3f} ms "
              f"({cases[k] / baseline[k]:.2f}x)")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

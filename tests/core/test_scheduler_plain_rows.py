"""The scheduler's inline branches for plain rows (a decode inside its last page, an id that
needs no grammar or logprobs) against its general per-row path: random workloads driven the
engine's way (async: placeholders after dispatch, ids read one step later, stops on EOS, stop
ids, min_tokens, max_tokens and max_model_len, final-only reports) give the same steps, the
same diffs and the same outputs with ``inline_plain_rows`` on and off, step by step."""
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler

import numpy as np
from types import SimpleNamespace

EOS = 0
VOCAB = 6  # small: EOS and stop ids come up often


def _sampled(rid: str, pos: int, salt: int) -> int:
    """The id a row samples: a function of its request and position only (both runs agree)."""
    return zlib.crc32(f"{rid}:{pos}:{salt}".encode()) % VOCAB


def _fetched(out, salt: int):
    ids = [_sampled(s.request_id, s.start_pos + s.num_new_tokens, salt) for s in out.scheduled]
    n = len(ids)
    return SimpleNamespace(token_ids=np.array(ids, np.int32), logprobs=-np.ones(n),
                           ranks=np.ones(n, int), topk_ids=None, topk_logprobs=None,
                           prompt_logprobs=None, num_emitted=None)


def _step_record(out) -> tuple:
    """Everything a step decided, as plain values."""
    return (msgspec.json.encode(out.batch),
            [(s.request_id, s.num_new_tokens, s.start_pos, s.sample, list(s.new_token_ids),
              s.num_draft, s.prompt_span) for s in out.scheduled],
            out.preempted, out.swap_out, out.swap_in, out.finished_req_ids,
            [(o.request_id, o.new_token_ids, o.finish_reason) for o in out.finished_outputs],
            out.num_batched_tokens)


def _drive(cfg: dict, specs: list[dict], aborts: dict, salt: int, inline: bool):
    """Run the workload the engine's way: the trace of steps and outputs, the requests' final
    ids and statuses, the rows the general path's _add_scheduled took of all rows, and the
    scheduler."""
    cc = CacheConfig(block_size=cfg["block_size"], enable_prefix_caching=cfg["prefix"],
                     swap_space=4.0)
    sc = SchedulerConfig(max_num_seqs=cfg["max_seqs"], max_num_batched_tokens=cfg["budget"],
                         preemption_mode=cfg["mode"])
    bm = BlockManager(cfg["num_pages"], cfg["block_size"], enable_prefix_caching=cfg["prefix"])
    s = Scheduler(sc, cc, bm, cfg["max_model_len"], page_bytes=1 << 30, eos_token_ids=[EOS])
    s.inline_plain_rows = inline
    general = [0]
    add = s._add_scheduled

    def counted(*a, **k):
        general[0] += 1
        return add(*a, **k)
    s._add_scheduled = counted
    trace, reqs, rows = [], [], 0
    pending = sorted(specs, key=lambda sp: sp["at_step"])
    inflight, steps = None, 0
    while pending or s.has_unfinished() or inflight is not None:
        while pending and pending[0]["at_step"] <= steps:
            sp = pending.pop(0)
            r = Request(sp["rid"], sp["prompt"], SamplingParams(
                max_tokens=sp["max_tokens"], min_tokens=min(sp["min_tokens"], sp["max_tokens"]),
                stop_token_ids=sp["stop_ids"], ignore_eos=sp["ignore_eos"]),
                arrival_time=float(sp["at_step"]), priority=sp["priority"])
            r.final_only = sp.get("final_only", False)
            s.add_request(r)
            reqs.append(r)
        for rid in aborts.get(steps, []):
            s.abort_request(rid)
        out = s.schedule()
        rows += len(out.scheduled)
        s.update_after_dispatch(out)  # placeholders: the ids are read one step later
        outs = []
        if inflight is not None:
            outs = s.update_from_output(inflight, _fetched(inflight, salt))
        inflight = out if out.scheduled else None
        trace.append((_step_record(out), [(o.request_id, o.new_token_ids, o.finish_reason,
                                           o.stop_reason) for o in outs]))
        steps += 1
        assert steps < 2000, "did not terminate"
    final = [(r.request_id, r.status.value, list(r.output_token_ids), r.stop_reason)
             for r in reqs]
    bm.check_invariants([])
    return SimpleNamespace(trace=trace, final=final, general=general[0], rows=rows, sched=s)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    cfg = dict(block_size=block_size, max_model_len=max_model_len,
               num_pages=draw(st.integers(max_model_len // block_size + 2, max_model_len + 24)),
               budget=draw(st.integers(max_model_len, 64)), max_seqs=draw(st.integers(1, 8)),
               mode=draw(st.sampled_from(["recompute", "swap"])), prefix=draw(st.booleans()))
    shared = draw(st.lists(st.integers(1, VOCAB - 1), max_size=12))
    specs = []
    for i in range(draw(st.integers(1, 10))):
        tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=20))
        specs.append(dict(
            rid=f"r{i}", prompt=((shared if draw(st.booleans()) else []) + tail)[:max_model_len],
            max_tokens=draw(st.integers(1, 24)), min_tokens=draw(st.integers(0, 4)),
            stop_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)),
            ignore_eos=draw(st.booleans()), priority=draw(st.integers(0, 1)),
            at_step=draw(st.integers(0, 10)), final_only=draw(st.booleans())))
    aborts = draw(st.dictionaries(st.integers(0, 20), st.lists(st.sampled_from(
        [sp["rid"] for sp in specs]), max_size=2), max_size=2))
    return cfg, specs, aborts, draw(st.integers(0, 3))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_inline_plain_rows_match_the_general_path(w):
    cfg, specs, aborts, salt = w
    got = _drive(cfg, specs, aborts, salt, inline=True)
    ref = _drive(cfg, specs, aborts, salt, inline=False)
    assert ref.general == ref.rows  # the reference took every row the general way
    for i, (a, b) in enumerate(zip(got.trace, ref.trace)):
        assert a == b, f"step {i}"
    assert len(got.trace) == len(ref.trace)
    assert got.final == ref.final
    assert got.sched.generation_tokens_total == ref.sched.generation_tokens_total


def test_plain_decodes_skip_the_general_path_and_stop_where_it_does():
    """A batch of decodes takes the inline branch (no _add_scheduled per row) and still stops
    each request where the general path does: EOS after min_tokens, a stop id, max_tokens."""
    cfg = dict(block_size=16, max_model_len=64, num_pages=64, budget=64, max_seqs=8,
               mode="recompute", prefix=True)
    specs = [dict(rid=f"r{i}", prompt=[1 + i % 5, 2, 3], max_tokens=12, min_tokens=i % 3,
                  stop_ids=[i % 5 + 1] if i % 2 else [], ignore_eos=i == 0, priority=0,
                  at_step=0) for i in range(8)]
    got = _drive(cfg, specs, {}, 0, inline=True)
    ref = _drive(cfg, specs, {}, 0, inline=False)
    assert got.trace == ref.trace and got.final == ref.final
    assert got.general < got.rows / 2, (got.general, got.rows)  # most rows: plain decodes
    assert {st for _, st, _, _ in got.final} == {"finished_length", "finished_stopped"}
    for rid, status, ids, stop_reason in got.final:
        sp = next(x for x in specs if x["rid"] == rid)
        if status == "finished_stopped":
            assert len(ids) >= sp["min_tokens"]
            assert ids[-1] == EOS and not sp["ignore_eos"] or ids[-1] in sp["stop_ids"]
        else:
            assert len(ids) == sp["max_tokens"]


@pytest.mark.parametrize("inline", [True, False])
def test_generation_tokens_counted_once_per_id(inline):
    """Every id read from the device counts once in generation_tokens_total, on either
    branch (ignore_eos: each request runs to max_tokens)."""
    cfg = dict(block_size=4, max_model_len=32, num_pages=32, budget=32, max_seqs=4,
               mode="recompute", prefix=False)
    specs = [dict(rid=f"r{i}", prompt=[1, 2, 3, 4, 5][: i + 1], max_tokens=6, min_tokens=0,
                  stop_ids=[], ignore_eos=True, priority=0, at_step=0) for i in range(4)]
    got = _drive(cfg, specs, {}, 1, inline=inline)
    assert [len(ids) for _, _, ids, _ in got.final] == [6] * 4
    assert all(st == "finished_length" for _, st, _, _ in got.final)
    assert got.sched.generation_tokens_total == 24


@pytest.mark.parametrize("inline", [True, False])
def test_final_only_request_reports_once_with_every_id(inline):
    """A final-only request (offline, no stop strings) gets no output while it runs and one at
    its finish holding every id and its logprobs; a streaming one beside it reports each id."""
    cc, sc = CacheConfig(block_size=4), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(sc, cc, BlockManager(64, 4), 256, eos_token_ids=[EOS])
    s.inline_plain_rows = inline
    quiet = Request("q", [1, 2, 3], SamplingParams(max_tokens=5, logprobs=0))
    plain = Request("p", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    loud = Request("l", [3, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    quiet.final_only = plain.final_only = True
    for r in (quiet, plain, loud):
        s.add_request(r)
    reports: dict[str, list] = {"q": [], "p": [], "l": []}
    inflight = None
    while s.has_unfinished() or inflight is not None:
        out = s.schedule()
        s.update_after_dispatch(out)
        if inflight is not None:
            fetched = _fetched(inflight, 0)
            fetched.token_ids[:] = 4  # never EOS: every request runs to max_tokens
            for o in s.update_from_output(inflight, fetched):
                reports[o.request_id].append(o)
        inflight = out if out.scheduled else None
    for rid in ("q", "p"):
        (o,) = reports[rid]  # one report, at the finish
        assert o.new_token_ids == [4] * 5 and o.finish_reason == "length"
    assert [t.token_id for t in reports["q"][0].new_logprobs] == [4] * 5
    assert [o.new_token_ids for o in reports["l"]] == [[4]] * 5
    assert s.generation_tokens_total == 15

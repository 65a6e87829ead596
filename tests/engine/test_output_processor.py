"""The output processor turns the core's ids into vLLM's cumulative outputs: text, stop
strings across token boundaries, logprob entries, n > 1 (children merged back into one output)
and offline (final-only) requests."""
from __future__ import annotations

import pytest

from jaxserve.core.outputs import CoreOutput, RequestMetrics, TokenLogprobs
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.output_processor import OutputProcessor


class CharTokenizer:
    """Token id i is the character chr(97 + i); enough to check text handling exactly."""

    eos_token_id = None

    def decode(self, ids, **_):
        return "".join(chr(97 + int(i)) for i in ids)


def ids(text):
    return [ord(c) - 97 for c in text]


class Proc(OutputProcessor):
    """Addresses core outputs by (request id, choice index), as the tests did before fan-out."""

    def add_request(self, *args, **kw):
        parent = super().add_request(*args, **kw)
        self.core_ids = getattr(self, "core_ids", {})
        self.core_ids.update({(parent.request_id, c.index): c.request_id
                              for c in parent.children})
        return parent


def step(p, rid, *per_seq, **kw):
    return [CoreOutput(p.core_ids[rid, i], list(t), **kw) for i, t in per_seq]


def test_a_stop_string_across_tokens_stops_at_the_token_that_completes_it():
    p = Proc(CharTokenizer())
    p.add_request("r", None, ids("xy"), SamplingParams(stop=["cd"], max_tokens=50))
    outs, stops = p.process(step(p, "r", (0, ids("abc"))))
    assert outs[0].outputs[0].text == "abc" and not stops
    outs, stops = p.process(step(p, "r", (0, ids("def"))))
    out = outs[0].outputs[0]
    assert out.text == "ab" and out.finish_reason == "stop" and out.stop_reason == "cd"
    assert out.token_ids == ids("abcd")  # the id that completed the stop string is kept
    assert outs[0].finished
    assert [(s.request_id, s.num_kept) for s in stops] == [(p.core_ids["r", 0], 4)]
    # the core keeps stepping until told: its late ids are dropped
    assert p.process(step(p, "r", (0, ids("gh")))) == ([], [])
    assert p.num_requests == 0


def test_include_stop_str_and_min_tokens():
    p = Proc(CharTokenizer())
    p.add_request("a", None, [0], SamplingParams(stop=["b"], include_stop_str_in_output=True))
    p.add_request("b", None, [0], SamplingParams(stop=["b"], min_tokens=3))
    outs, stops = p.process(step(p, "a", (0, ids("abc"))) + step(p, "b", (0, ids("abcb"))))
    a, b = (o.outputs[0] for o in outs)
    assert a.text == "ab" and a.finish_reason == "stop"
    # "b" at the second id is inside min_tokens; the one at the fourth stops it
    assert b.text == "abc" and b.token_ids == ids("abcb")
    assert sorted((s.request_id, s.num_kept) for s in stops) == sorted(
        [(p.core_ids["a", 0], 2), (p.core_ids["b", 0], 4)])


def test_core_finish_reasons_and_n_choices():
    p = Proc(CharTokenizer())
    p.add_request("r", None, [0], SamplingParams(n=2, max_tokens=2))
    outs, _ = p.process(step(p, "r", (0, ids("a")), (1, ids("b"))))
    assert len(outs) == 1  # the two children's news merge into one output
    assert [c.text for c in outs[0].outputs] == ["a", "b"] and not outs[0].finished
    outs, _ = p.process([CoreOutput(p.core_ids["r", 0], ids("c"), finish_reason="length"),
                         CoreOutput(p.core_ids["r", 1], ids("d"), finish_reason="stop",
                                    stop_reason=7)])
    c0, c1 = outs[0].outputs
    assert (c0.text, c0.finish_reason) == ("ac", "length")
    assert (c1.text, c1.finish_reason, c1.stop_reason) == ("bd", "stop", 7)
    assert outs[0].finished and p.num_requests == 0


def test_final_only_requests_report_once():
    p = Proc(CharTokenizer())
    p.add_request("r", "prompt", [0], SamplingParams(max_tokens=3), final_only=True)
    assert p.process(step(p, "r", (0, ids("ab")))) == ([], [])
    outs, _ = p.process([CoreOutput(p.core_ids["r", 0], ids("c"), finish_reason="length")])
    assert len(outs) == 1 and outs[0].outputs[0].text == "abc" and outs[0].prompt == "prompt"


def test_logprob_entries_get_their_text_and_ranks():
    p = Proc(CharTokenizer())
    p.add_request("r", None, [0], SamplingParams(logprobs=2, prompt_logprobs=1))
    lp = [TokenLogprobs(2, -0.5, 3, [0, 1, 2], [-0.1, -0.3, -0.5]),
          TokenLogprobs(0, -0.1, 1, [0, 1, 2], [-0.1, -0.2, -0.9])]
    (co,) = step(p, "r", (0, [2, 0]), new_logprobs=lp)
    co.new_prompt_logprobs = [TokenLogprobs(4, -2.0, 5, [1], [-0.2])]
    out = p.process([co])[0][0]
    first, second = out.outputs[0].logprobs
    assert {t: (e.logprob, e.rank, e.decoded_token) for t, e in first.items()} == {
        2: (-0.5, 3, "c"), 0: (-0.1, 1, "a"), 1: (-0.3, 2, "b")}  # top-2 of the 3 sent
    assert list(second) == [0, 1] and second[0].rank == 1
    assert out.outputs[0].cumulative_logprob == pytest.approx(-0.6)
    assert out.prompt_logprobs[0] is None
    assert {t: e.decoded_token for t, e in out.prompt_logprobs[1].items()} == {4: "e", 1: "b"}


def test_an_aborted_request_drops_its_late_outputs():
    p = Proc(CharTokenizer())
    p.add_request("r", None, [0], SamplingParams())
    core_ids = p.abort_request("r")
    assert core_ids == [p.core_ids["r", 0]]  # what the core must abort
    assert p.process(step(p, "r", (0, ids("a")))) == ([], [])


def test_n_children_are_independent_core_requests_merged_back():
    """Fan-out: each choice is its own core request (own seed, prompt logprobs on choice 0
    only, siblings share choice 0's prompt); one merged output per step; aborting the
    request names every child; a finished sibling waits for the others."""
    p = Proc(CharTokenizer())
    parent = p.add_request("r", None, [0], SamplingParams(n=3, seed=5, max_tokens=4,
                                                          prompt_logprobs=1))
    kids = parent.children
    assert [c.index for c in kids] == [0, 1, 2] and len({c.request_id for c in kids}) == 3
    assert all("r" != c.request_id for c in kids)  # never the caller's id
    assert [c.params.seed for c in kids] == [5, 6, 7] and all(c.params.n == 1 for c in kids)
    assert [c.params.prompt_logprobs for c in kids] == [1, None, None]
    assert [c.prefix_parent for c in kids] == [None, kids[0].request_id, kids[0].request_id]
    m = [RequestMetrics(arrival_time=1.0, first_token_time=t, last_token_time=t)
         for t in (3.0, 2.0, 4.0)]
    outs, _ = p.process([CoreOutput(kids[i].request_id, ids("ab"[i % 2]), metrics=m[i],
                                    finish_reason="length" if i == 1 else None)
                         for i in (2, 1, 0)])
    (out,) = outs
    assert [c.index for c in out.outputs] == [0, 1, 2]  # in index order, whatever came first
    assert [c.finish_reason for c in out.outputs] == [None, "length", None]
    assert not out.finished
    assert (out.metrics.first_token_time, out.metrics.last_token_time) == (2.0, 4.0)
    # a finished child's late ids are ignored; the others go on
    outs, _ = p.process([CoreOutput(kids[1].request_id, ids("z")),
                         CoreOutput(kids[0].request_id, ids("c"))])
    assert [c.text for c in outs[0].outputs] == ["ac", "b", "a"]
    assert sorted(p.abort_request("r")) == sorted(c.request_id for c in kids)
    assert p.num_requests == 0 and p.process([CoreOutput(kids[0].request_id, [1])]) == ([], [])


def test_a_running_request_id_is_refused():
    p = Proc(CharTokenizer())
    p.add_request("r", None, [0], SamplingParams())
    with pytest.raises(Exception, match="already running"):
        p.add_request("r", None, [0], SamplingParams())

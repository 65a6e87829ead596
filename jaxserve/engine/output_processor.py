"""The output processor: token ids from the engine core in, ``RequestOutput``s out.

It owns everything textual about a generation: incremental detokenization, stop strings,
logprob entries with their decoded tokens, and the cumulative outputs (n > 1 choices, offline
requests that report only when done). It never touches jax, so ``jaxserve serve`` runs it in
the API process and the core only ever sends ids; ``LLM`` and ``AsyncLLM`` run the same class
in-process behind ``LLMEngine.step``. An ``n > 1`` request reaches the core as ``n`` independent
requests (engine/parallel_sampling.py); their outputs are merged back here into one state.

The core decides the stops it can see on ids (EOS, stop token ids, max_tokens, max_model_len,
a finished grammar). A stop string is only visible here: ``process`` returns those stops, and
the caller tells the core to finish that core request (``LLMEngine.finish_sequences``). Ids the core
produced after the stop string (it keeps stepping until told) are dropped here, never shown.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.core.outputs import (CompletionOutput, CoreOutput, Logprob, RequestOutput,
                                   TokenLogprobs)
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.parallel_sampling import ParentRequest, merge_metrics
from jaxserve.engine.tokenizer import IncrementalDetokenizer, check_stop_strings, decode_token
from jaxserve.errors import InvalidRequestError


@dataclass
class SequenceStop:
    """A stop string ended core request ``request_id`` after ``num_kept`` output ids."""

    request_id: str
    num_kept: int


@dataclass
class _Sequence:
    index: int
    core_id: str  # the core request that produces it
    detok: IncrementalDetokenizer | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: object = None  # the core request's RequestMetrics


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    final_only: bool
    prompt_logprobs: list | None
    num_cached_tokens: int = 0
    hidden_states: list | None = None  # return_hidden_states: [n, K, H] arrays in order
    kv_transfer_params: dict | None = None  # a finished prefill's, for its remote decode

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    @property
    def metrics(self):
        return merge_metrics([s.metrics for s in self.sequences])


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}  # by the caller's request id
        self._seq_of: dict[str, tuple[_RequestState, _Sequence]] = {}  # by core request id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, final_only: bool = False) -> ParentRequest:
        """Register a request; returns its fan-out, the core requests to send (a request id
        already running is an error)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        parent = ParentRequest(request_id, params)
        seqs = []
        for child in parent.children:
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               params.skip_special_tokens,
                                               params.spaces_between_special_tokens)
            seqs.append(_Sequence(child.index, child.request_id, detok,
                                  logprobs=[] if params.logprobs is not None else None))
        st = _RequestState(request_id, prompt, list(prompt_token_ids), params, seqs, final_only,
                           [None] if params.prompt_logprobs is not None else None)
        self._requests[request_id] = st
        for seq in seqs:
            self._seq_of[seq.core_id] = (st, seq)
        return parent

    def abort_requests(self, request_ids) -> list[str]:
        """Forget requests; returns the core requests to abort."""
        core_ids = []
        for rid in request_ids:
            st = self._requests.get(rid)
            if st is not None:
                core_ids += [s.core_id for s in st.sequences]
                self._forget(st)
        return core_ids

    def abort_request(self, request_id: str) -> list[str]:
        return self.abort_requests([request_id])

    def _forget(self, st: _RequestState) -> None:
        self._requests.pop(st.request_id, None)
        for seq in st.sequences:
            self._seq_of.pop(seq.core_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process(self, core_outputs: list[CoreOutput]) -> tuple[list[RequestOutput],
                                                             list[SequenceStop]]:
        """Apply one step's core outputs. -> (one output per request they touched, the
        stop-string stops the core must be told about)."""
        touched: dict[str, _RequestState] = {}
        stops = []
        for co in core_outputs:
            hit = self._seq_of.get(co.request_id)
            if hit is None:
                continue  # aborted, or finished here by a stop string: late ids are dropped
            st, seq = hit
            touched[st.request_id] = st
            if co.metrics is not None:
                seq.metrics = co.metrics
            if seq.index == 0:
                st.num_cached_tokens = co.num_cached_tokens
            if co.new_prompt_logprobs and st.prompt_logprobs is not None:
                k = st.params.prompt_logprobs
                st.prompt_logprobs.extend(self._entry(tl, k) for tl in co.new_prompt_logprobs)
            if co.kv_transfer_params is not None:
                st.kv_transfer_params = co.kv_transfer_params
            if co.new_hidden_states:
                st.hidden_states = (st.hidden_states or []) + co.new_hidden_states
            if seq.finish_reason is not None:
                continue
            if seq.detok is None and (seq.logprobs is None or co.new_logprobs is None):
                seq.token_ids += co.new_token_ids  # ids only: no text, so no stop string
            else:
                self._append(st, seq, co.new_token_ids, co.new_logprobs)
            if seq.finish_reason is not None:  # a stop string
                stops.append(SequenceStop(seq.core_id, len(seq.token_ids)))
            elif co.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = co.finish_reason, co.stop_reason
        outputs = []
        for st in touched.values():
            seqs = st.sequences
            finished = (seqs[0].finish_reason is not None if len(seqs) == 1
                        else st.finished)
            if finished or not st.final_only:
                outputs.append(self._output(st))
            if finished:
                self._forget(st)
        return outputs, stops

    def _append(self, st: _RequestState, seq: _Sequence, ids: list[int],
                logprobs: list[TokenLogprobs] | None) -> None:
        """Add ids one at a time; a stop string ends the sequence at the id that completes it."""
        params = st.params
        stop = params.stop or []
        if isinstance(stop, str):
            stop = [stop]
        for j, tok in enumerate(ids):
            seq.token_ids.append(tok)
            if logprobs is not None and seq.logprobs is not None:
                tl = logprobs[j]
                seq.cumulative_logprob += tl.logprob
                seq.logprobs.append(self._entry(tl, params.logprobs))
            if seq.detok is None:
                continue
            delta = seq.detok.add_tokens([tok])
            seq.text = seq.detok.text
            if stop and len(seq.token_ids) >= params.min_tokens:
                hit = check_stop_strings(seq.text, len(delta), stop,
                                         params.include_stop_str_in_output)
                if hit is not None:
                    stop_str, cut = hit
                    if cut is not None:
                        seq.text = seq.text[:cut]
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
                    return

    def _entry(self, tl: TokenLogprobs, k: int | None) -> dict:
        """{token id: Logprob} of one position: the chosen token, then the top-k asked for
        (k = -1: every entry the core sent, i.e. the whole vocabulary)."""
        tok = self.tokenizer
        d = {tl.token_id: Logprob(tl.logprob, tl.rank, decode_token(tok, tl.token_id))}
        n = len(tl.top_ids) if k is not None and k < 0 else (k or 0)
        for r, (tid, lp) in enumerate(zip(tl.top_ids[:n], tl.top_logprobs)):
            if tid not in d:
                d[tid] = Logprob(lp, r + 1, decode_token(tok, tid))
        return d

    def _output(self, st: _RequestState) -> RequestOutput:
        comps = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in st.sequences]
        metrics = st.metrics
        if st.finished and metrics is not None and metrics.finished_time is None:
            metrics.finished_time = metrics.last_token_time
        return RequestOutput(
            request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
            outputs=comps, finished=st.finished,
            prompt_logprobs=list(st.prompt_logprobs) if st.prompt_logprobs else None,
            metrics=metrics, num_cached_tokens=st.num_cached_tokens,
            hidden_states=(np.concatenate(st.hidden_states) if st.hidden_states else None),
            kv_transfer_params=st.kv_transfer_params)

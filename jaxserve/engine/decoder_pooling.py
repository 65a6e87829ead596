"""Embeddings from the generative engine: a decoder's final hidden state at a prompt's last token
(LAST pooling, as Qwen3-Embedding and e5-mistral pool), on the paged engine itself.

A pooling request is a prompt run as a prefill beside everybody's decode, chunked like any
prompt, its full pages in the prefix cache (a document embedded twice, or a chat history then
embedded, computes only what it does not share). When its last chunk runs, the step copies that
row's final hidden state to the host (``StepPlan.pool_rows``) and the scheduler ends it with the
vector instead of a token (``Scheduler._finish_pooled``). So one server answers chat and
``/v1/embeddings`` on one model and one page pool, and the scheduler's token budget shares the
steps between them.

Only LAST pooling: MEAN or CLS would need hidden states of prompt positions a prefix hit never
recomputes.
"""
from __future__ import annotations

from jaxserve.core.pooling_params import (PoolingModelInfo, PoolingOutput, PoolingParams,
                                          check_params, postprocess)
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.pooling_inputs import pooling_prompt_ids
from jaxserve.errors import InvalidRequestError

TASKS = ("embed",)


def decoder_pooling_info(model_config, pooler_config=None) -> PoolingModelInfo:
    """LAST pooling of the final hidden state, normalized (vLLM's defaults for a decoder
    embedder); ``--pooler-config`` may turn normalization off or set default dimensions."""
    info = PoolingModelInfo(hidden_size=model_config.hidden_size, pooling_type="LAST",
                            normalize=True)
    if pooler_config is not None:
        if pooler_config.pooling_type not in (None, "LAST"):
            raise InvalidRequestError(
                f"pooling_type {pooler_config.pooling_type}: the generative engine pools LAST "
                "only (a prefix-cache hit never recomputes earlier positions)",
                param="pooler_config")
        if pooler_config.normalize is not None:
            info.normalize = pooler_config.normalize
        info.default_dimensions = pooler_config.dimensions
    return info


class DecoderPooling:
    """The generative engine's pooling requests: admitted as one-step prefills, answered as
    ``PoolingOutput``."""

    def __init__(self, engine, info: PoolingModelInfo):
        self.engine = engine
        self.info = info
        self.pending: dict[str, tuple[PoolingParams, list[int]]] = {}

    def add(self, request_id: str, prompt, params: PoolingParams, *, pair=None,
            arrival_time: float | None = None, priority: int = 0, lora_request=None) -> None:
        if pair is not None:
            raise InvalidRequestError("a text pair needs a cross-encoder (--runner pooling); "
                                      "this engine embeds one text at a time", param="input")
        if params.task not in TASKS:
            raise InvalidRequestError(
                f"task {params.task!r}: a generative model embeds (task 'embed'); "
                "classification and scoring need --runner pooling", param="task")
        engine = self.engine
        ids, _ = pooling_prompt_ids(engine.tokenizer, prompt, params, engine.max_model_len)
        self.add_core(request_id, ids, params, arrival_time=arrival_time, priority=priority,
                      lora_request=lora_request)

    def add_core(self, request_id: str, ids: list[int], params: PoolingParams, **kw) -> None:
        """Tokenized ids into the scheduler as a prefill that samples nothing kept."""
        if request_id in self.pending:
            raise InvalidRequestError(f"request_id {request_id!r} is already running",
                                      param="request_id")
        check_params(params, self.info)
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                 detokenize=False)
        self.engine.add_core_request(request_id, ids, prefill, pooling=params, **kw)
        self.pending[request_id] = (params, list(ids))

    def outputs(self, core_outputs) -> tuple[list[PoolingOutput], list]:
        """Split a step's core outputs: the pooled ones as ``PoolingOutput``, the rest."""
        pooled, rest = [], []
        for co in core_outputs:
            entry = self.pending.pop(co.request_id, None) if co.finished else \
                self.pending.get(co.request_id)
            if entry is None:
                rest.append(co)
                continue
            if not co.finished:
                continue
            params, ids = entry
            if co.pooled is None:  # aborted (or failed) before its prompt was computed
                pooled.append(PoolingOutput(co.request_id, None, ids,
                                            error=str(co.stop_reason or co.finish_reason)))
                continue
            pooled.append(PoolingOutput(co.request_id,
                                        postprocess(co.pooled, ids, params, self.info), ids))
        return pooled, rest

    def abort(self, request_ids) -> None:
        """Forget the pooling requests among ``request_ids``."""
        for rid in request_ids:
            self.pending.pop(rid, None)

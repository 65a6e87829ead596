"""The stops visible on token ids (vLLM's ``check_stop``), as a pure function of the request
and its newest id. Stop strings are the output processor's: they need text."""
from __future__ import annotations

import logging

from jaxserve.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def stop_status(req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int
                ) -> tuple[RequestStatus, int | None] | None:
    """(finished status, stop reason) when ``token``, ``req``'s newest known output id, ends
    it: a grammar that rejects it or is complete, EOS or one of the request's stop token ids
    once ``min_tokens`` are out, ``max_tokens``, or ``max_model_len``; None otherwise."""
    params = req.sampling_params
    if req.grammar is not None:
        if not req.grammar.accept(token):
            logger.warning("request %s: token %d is outside its grammar (%s)",
                           req.request_id, token, req.grammar.error)
            return RequestStatus.FINISHED_STOPPED, None
        if req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED, None
    n_out = req.num_known_output_tokens
    if n_out >= params.min_tokens:
        if token in eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if params.stop_token_ids and token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if n_out >= req.max_tokens or req.num_tokens - req.num_pending >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None

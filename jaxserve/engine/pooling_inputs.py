"""A pooling request's prompt -> token ids (and BERT's token type ids for a text pair).

Shared by the offline engine and the API process (no jax). Text is tokenized with the
model's special tokens, as sentence-transformers does; ``truncate_prompt_tokens`` truncates
as the tokenizer does (``truncation=True``, so [CLS] ... [SEP] stay), token ids keep their last
k. A prompt longer than ``max_model_len`` without it is an error naming the field.
"""
from __future__ import annotations

from jaxserve.core.pooling_params import PoolingParams
from jaxserve.errors import InvalidRequestError


def _limit(params: PoolingParams, max_model_len: int) -> int | None:
    k = params.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
            f"({max_model_len}). Please select a smaller truncation size.",
            param="truncate_prompt_tokens")
    return k


def pooling_prompt_ids(tokenizer, prompt, params: PoolingParams, max_model_len: int,
                       pair: str | None = None, param: str = "input"
                       ) -> tuple[list[int], list[int] | None]:
    """(token ids, token type ids or None) of one input (``pair``: the second text of a
    cross-encoder's pair)."""
    k = _limit(params, max_model_len)
    types = None
    if isinstance(prompt, str):
        if not prompt and pair is None:
            raise InvalidRequestError("an input is empty", param=param)
        try:
            enc = tokenizer(prompt, pair, truncation=k is not None, max_length=k) \
                if k is not None else tokenizer(prompt, pair)
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"could not tokenize the input: {e}", param=param) from None
        ids = list(enc["input_ids"])
        if pair is not None and "token_type_ids" in enc:
            types = list(enc["token_type_ids"])
    elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise InvalidRequestError("an input is empty", param=param)
        if pair is not None:
            raise InvalidRequestError("a text pair must be strings", param=param)
        ids = list(prompt)[-k:] if k is not None else list(prompt)
        vocab = len(tokenizer)
        for t in ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(f"token id {t} is out of range [0, {vocab})",
                                          param=param)
    else:
        raise InvalidRequestError("an input must be a string or a list of token ids",
                                  param=param)
    if len(ids) > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids)} tokens in the input. Please reduce the length of the input, "
            "or set truncate_prompt_tokens (-1: the model's maximum).", param=param)
    return ids, types

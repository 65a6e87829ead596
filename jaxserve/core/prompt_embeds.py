"""Prompts given as embeddings (``{"prompt_embeds": array}``, vLLM's ``EmbedsPrompt``).

Host side only (numpy; torch imported only to read a torch tensor or a ``torch.save``d one).
An embeddings prompt of ``n`` rows runs as a request of ``n`` placeholder prompt ids whose
tokens read the given rows instead of the embedding table (``worker.forward_hooks``). Its
prefix-cache pages are keyed by the embeddings' digest, so they are shared only with the same
embeddings, never with a token prompt.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io

import numpy as np

from jaxserve.errors import InvalidRequestError

PARAM = "prompt_embeds"
PLACEHOLDER_ID = 0  # the prompt id of an embeddings position (never embedded)


def as_embeds(value, hidden_size: int) -> np.ndarray:
    """``[n, hidden_size]`` float32 from a numpy / jax array, a torch tensor or nested lists;
    anything else, or non-finite values, is an error naming ``prompt_embeds``."""
    if type(value).__module__.startswith("torch"):
        value = value.detach().to("cpu").float().numpy()
    try:
        arr = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise InvalidRequestError("prompt_embeds must be a float array of shape [tokens, "
                                  "hidden]", param=PARAM) from None
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]  # vLLM accepts a leading batch axis of 1
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != hidden_size:
        raise InvalidRequestError(f"prompt_embeds must have shape [tokens >= 1, {hidden_size}],"
                                  f" got {list(arr.shape)}", param=PARAM)
    if not np.isfinite(arr).all():
        raise InvalidRequestError("prompt_embeds holds non-finite values", param=PARAM)
    return np.ascontiguousarray(arr)


def digest(arr: np.ndarray) -> str:
    """The prefix-cache key of an embeddings prompt (its shape and bytes)."""
    h = hashlib.sha256(str(arr.shape).encode())
    h.update(arr.tobytes())
    return "prompt_embeds:" + h.hexdigest()


def decode_base64(text) -> np.ndarray:
    """One base64 string of ``/v1/completions``' ``prompt_embeds``: vLLM's format (a
    ``torch.save``d tensor; needs torch importable) or a ``.npy`` array (``np.save``)."""
    if not isinstance(text, str):
        raise InvalidRequestError("prompt_embeds must be a base64 string or a list of them",
                                  param=PARAM)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("prompt_embeds is not valid base64", param=PARAM) from None
    if raw.startswith(b"\x93NUMPY"):
        try:
            return np.load(io.BytesIO(raw), allow_pickle=False)
        except ValueError as e:
            raise InvalidRequestError(f"prompt_embeds: a bad .npy array ({e})",
                                      param=PARAM) from None
    try:
        import torch
    except ImportError:
        raise InvalidRequestError("prompt_embeds: a torch.save'd tensor needs torch in the "
                                  "server; send a base64 .npy array instead",
                                  param=PARAM) from None
    try:
        t = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unreadable payload is the client's error
        raise InvalidRequestError(f"prompt_embeds: not a torch.save'd tensor nor a .npy array"
                                  f" ({type(e).__name__})", param=PARAM) from None
    if not isinstance(t, torch.Tensor):
        raise InvalidRequestError("prompt_embeds: the payload is not a tensor", param=PARAM)
    return t.detach().float().numpy()

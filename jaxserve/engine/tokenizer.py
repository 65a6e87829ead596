"""Text side of generation: incremental detokenization, stop strings, chat templates.

Host side only (no jax). Works with any transformers tokenizer (loading lives in loader.py).
"""
from __future__ import annotations

import weakref
from typing import Sequence

from jaxserve.errors import InvalidRequestError

# Context tokens of the prompt kept in the detokenization window (vLLM uses 5 as well): enough
# for tokenizers whose decode of a token depends on its left neighbour (SentencePiece spaces).
INITIAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT = "\ufffd"


# Where transformers defines a fast tokenizer's ``decode`` / ``_decode`` (v5 and v4 names): a class
# that keeps both decodes straight through its ``tokenizers`` backend.
_PLAIN_DECODE = {"transformers.tokenization_utils_base"}
_PLAIN_FAST_DECODE = {"transformers.tokenization_utils_tokenizers",
                      "transformers.tokenization_utils_fast"}


def _defined_in(cls, name: str) -> str | None:
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__module__
    return None


def backend_decoder(tokenizer):
    """The ``tokenizers`` backend's ``decode`` when it gives exactly what ``tokenizer.decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)`` gives, else None.

    The per-call overhead of transformers' wrapper (~8 us against ~1 us for the backend) is
    most of the host's detokenization time at hundreds of running sequences (two decodes per
    token). Subclasses that override either decode keep the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    cls = type(tokenizer)
    if (_defined_in(cls, "decode") not in _PLAIN_DECODE
            or _defined_in(cls, "_decode") not in _PLAIN_FAST_DECODE):
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that never split a UTF-8 character.

    vLLM's prefix/read offset method on token ids: ``prefix_offset..read_offset`` is a window of
    already-emitted tokens decoded for context, and the delta is what decoding the window plus the
    new tokens adds to it. When that text ends in U+FFFD (an incomplete byte sequence from
    byte-level BPE) or adds nothing (a skipped special token), the delta is held back and the
    offsets stay, so the next token completes the character. ``text`` is the output text so far
    (prompt excluded); the engine may truncate it for stop strings.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        start = max(0, len(prompt_token_ids) - INITIAL_DETOKENIZATION_OFFSET)
        tail = [int(t) for t in prompt_token_ids[start:]]
        self._ids: list[int] = tail  # window context + output ids
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.output_token_ids: list[int] = []
        self.text = ""
        self._backend_decode = backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:  # spaces_between_special_tokens: slow-only option
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; returns the new text (possibly "" while a character is open)."""
        delta = []
        for t in new_ids:
            t = int(t)
            self._ids.append(t)
            self.output_token_ids.append(t)
            prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self._ids[self.prefix_offset:])
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
                continue
            delta.append(new_text[len(prefix_text):])
            self.prefix_offset = self.read_offset
            self.read_offset = len(self._ids)
            # drop ids left of the window so a long generation does not keep them all twice
            if self.prefix_offset > 1024:
                del self._ids[: self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
        out = "".join(delta)
        self.text += out
        return out


def prompt_ids(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """A prompt (text, token ids, or ``{"prompt_token_ids": ..., "prompt": ...}``) as
    ``(text or None, token ids)``: the input processor's last step, the same in the API process
    and in-process. The engine core checks the ids."""
    if isinstance(prompt, str):
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    try:
        return None, [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise InvalidRequestError("prompt must be a string or a list of token ids",
                                  param="prompt") from None


def check_stop_strings(text: str, new_delta_len: int, stop: Sequence[str],
                       include_stop_str_in_output: bool) -> tuple[str, int | None] | None:
    """Did the last ``new_delta_len`` characters of ``text`` complete a stop string?

    Only the tail that could contain a new match is searched (a stop string may span token
    boundaries: it may start before the delta). Returns ``(stop_str, truncate_to)``: the output
    text becomes ``text[:truncate_to]`` — the stop string is cut off, or kept when
    ``include_stop_str_in_output`` — and ``truncate_to`` is None when nothing needs cutting.
    When several stop strings match, the earliest in the text wins (ties: the first listed).
    vLLM semantics otherwise (StopChecker.check_stop_strings).
    """
    if not new_delta_len or not stop:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        start = max(0, len(text) - new_delta_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    end = i + len(s) if include_stop_str_in_output else i
    return s, (None if end >= len(text) else end)


def stop_buffer_length(stop: Sequence[str] | None, include_stop_str_in_output: bool) -> int:
    """Characters a stream must hold back so it never shows a stop string's beginning that a
    later token completes (vLLM's stop_buffer_length)."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def _message_content(content, i: int):
    """OpenAI content (string, None, or a list of parts) -> a string for the template."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        if any(isinstance(p, dict) and p.get("type") == "image" for p in content):
            return _parts_with_images(content, i)
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{i}].content: only text parts are supported, got {kind!r}",
                    param="messages")
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}",
        param="messages")


def _parts_with_images(content: list, i: int) -> list[dict]:
    """Text and image parts as HF chat templates take them (the template places each image's
    tokens; the front end expands them to the image's count)."""
    out = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "image":
            out.append({"type": "image"})
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(
                part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"messages[{i}].content: part type {kind!r} is not "
                                      "supported", param="messages")
    return out


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects",
                                  param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(m).__name__}",
                                      param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role must be a non-empty string, got {role!r}",
                                      param="messages")
        if "content" not in m and not m.get("tool_calls"):
            raise InvalidRequestError(f"messages[{i}] has no content", param="messages")
        msg = dict(m)
        msg["content"] = _message_content(m.get("content"), i)
        out.append(msg)
    return out


def apply_chat_template(tokenizer, messages, add_generation_prompt: bool = True,
                        chat_template: str | None = None, **template_kwargs) -> list[int]:
    """Render ``messages`` with the tokenizer's (or the given) chat template -> token ids.

    The rendered text already holds the template's special tokens (BOS...), so it is encoded
    without adding them again (as vLLM does).
    """
    msgs = normalize_messages(messages)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; pass one (--chat-template or "
            "chat_template=...) or use the completions API", param="chat_template")
    try:
        text = tokenizer.apply_chat_template(msgs, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except InvalidRequestError:
        raise
    except Exception as e:  # jinja errors (raise_exception in templates) come from the messages
        raise InvalidRequestError(f"could not apply the chat template: {e}",
                                  param="messages") from None
    if not isinstance(text, str):  # some versions return a list for a batch
        text = text[0]
    return list(tokenizer.encode(text, add_special_tokens=False))


_token_text_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text for logprob display (special tokens kept; a partial UTF-8 byte shows
    as U+FFFD, like vLLM). Cached per tokenizer."""
    try:
        cache = _token_text_cache.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        cache = {}
    s = cache.get(token_id)
    if s is None:
        s = tokenizer.decode([int(token_id)], skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
        cache[token_id] = s
    return s

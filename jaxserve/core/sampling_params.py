"""SamplingParams: vLLM's names and defaults, validated up front so bad input never reaches the device.

Host side only (no jax). Every invalid value raises ``InvalidRequestError(msg, param=<field>)``
whose message names the field and the value. Limits that exist only because the device side works
on fixed shapes (``MAX_LOGIT_BIAS``, ``MAX_STOP_TOKEN_IDS``) are module constants; the logprobs
limit is the engine's ``max_logprobs`` (checked by :meth:`SamplingParams.verify_logprobs`).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.grammar_limits import check_spec_limits
from jaxserve.errors import InvalidRequestError

# vLLM's default --max-logprobs: the most top logprobs a request may ask for (the sampler's
# static top-k width comes from the engine's max_logprobs).
DEFAULT_MAX_LOGPROBS = 20
# logit_bias entries per request (the sampler's padded bias table has this width at most).
MAX_LOGIT_BIAS = 1024
# stop_token_ids per request (masked on device while min_tokens is not reached).
MAX_STOP_TOKEN_IDS = 63
# temperature below this is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
MAX_SEED = 2**64 - 1


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, dict or string), ``regex``, ``choice`` (list of strings),
    ``grammar`` (Lark or GBNF/EBNF text), ``json_object=True`` (any JSON object) or
    ``structural_tag`` (llguidance's structural tag JSON). The engine compiles it with
    llguidance; a schema/regex/grammar that does not compile is an error naming the field."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    # where the spec came from in a request ("response_format", "guided_json", ...): error
    # messages name it; the Python API leaves it None ("structured_outputs.<field>")
    _origin: str | None = field(default=None, repr=False, compare=False)

    FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [f for f in self.FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}",
                param=self._origin or "structured_outputs")
        kind = given[0]
        v = getattr(self, kind)
        ok = {"json": isinstance(v, (str, dict)), "regex": isinstance(v, str),
              "grammar": isinstance(v, str), "json_object": v is True,
              "structural_tag": isinstance(v, (str, dict)),
              "choice": isinstance(v, (list, tuple)) and bool(v)
              and all(isinstance(c, str) for c in v)}[kind]
        if not ok:
            want = {"json": "a JSON schema (object or string)", "regex": "a string",
                    "grammar": "a string", "json_object": "true",
                    "structural_tag": "an object or a JSON string",
                    "choice": "a non-empty list of strings"}[kind]
            raise _bad(self.param(kind), v, f"must be {want}")
        if kind == "choice":
            self.choice = list(v)
        check_spec_limits(kind, getattr(self, kind), self.param(kind))

    @property
    def kind(self) -> str:
        return next(f for f in self.FIELDS if getattr(self, f) not in (None, False))

    def param(self, kind: str | None = None) -> str:
        """The request field an error about this spec names."""
        return self._origin or f"structured_outputs.{kind or self.kind}"


def _bad(param: str, value: Any, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {why}, got {value!r}", param=param)


def resolve_num_logprobs(param: str, value: int | None, max_logprobs: int,
                         vocab_size: int) -> int | None:
    """vLLM's rule: -1 asks for the whole vocabulary; the count may not exceed ``max_logprobs``
    (-1 there = the vocabulary size). Returns the count to compute (at most the vocabulary)."""
    if value is None:
        return None
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    n = vocab_size if value == -1 else value
    if n > limit:
        asked = f"{value} (the whole vocabulary, {vocab_size})" if value == -1 else f"{value}"
        raise InvalidRequestError(
            f"{param}: requested {asked} logprobs, more than the server's max_logprobs of "
            f"{limit} (--max-logprobs / LLM(max_logprobs=...))", param=param)
    return min(n, vocab_size)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling controls (vLLM semantics; see ``docs`` of vllm.SamplingParams).

    ``max_tokens=None`` means "up to max_model_len" (the engine resolves it). ``top_k`` 0 or -1
    disables top-k. ``logprobs=k`` returns the sampled token's logprob plus the top-k (k up to the
    engine's ``max_logprobs``, 20 by default; -1 = the whole vocabulary, allowed when
    ``max_logprobs`` is -1 or at least the vocabulary size); logprobs are those of the raw model
    distribution (vLLM V1's default ``raw_logprobs``). ``prompt_logprobs`` likewise.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's token filters: sample only from these ids / never these words
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # this request decodes one token a step even when the engine speculates (its own choice:
    # e.g. a latency-insensitive batch job that should not spend verify compute)
    disable_speculative_decoding: bool = False
    # vLLM's free-form per-request arguments (custom logits processors read them). One key
    # the engine itself reads: "return_hidden_states", a list of layer indices.
    extra_args: dict[str, Any] | None = None
    # the residual stream at these layers (HF's ``output_hidden_states`` indices: 0 = the
    # embeddings, i = after decoder layer i, num_layers = the final norm's output; negative
    # from the end) for every token the model reads; the same as
    # ``extra_args["return_hidden_states"]``
    return_hidden_states: list[int] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()

    # -- normalisation (types the OpenAI layer may hand us) -------------------------------------
    def _normalize(self) -> None:
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise _bad("allowed_token_ids", ids, "must be a non-empty list of token ids")
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise _bad("bad_words", words, "must be a list of non-empty strings")
            self.bad_words = list(words)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise _bad("extra_args", self.extra_args, "must be a dict")
        layers = self.return_hidden_states
        from_extra = (self.extra_args or {}).get("return_hidden_states")
        if layers is not None and from_extra is not None and list(layers) != list(from_extra):
            raise _bad("return_hidden_states", layers, "differs from "
                       "extra_args['return_hidden_states']")
        if layers is None:
            layers = from_extra
        if layers is not None:
            name = "return_hidden_states"
            if not isinstance(layers, (list, tuple)) or not layers or not all(
                    _is_int(i) for i in layers):
                raise _bad(name, layers, "must be a non-empty list of layer indices")
            if len(set(layers)) != len(layers):
                raise _bad(name, layers, "must not repeat a layer")
            self.return_hidden_states = [int(i) for i in layers]
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise _bad("stop", self.stop, "must be a string or a list of strings")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise _bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", self.logit_bias, "must be a dict of token id -> bias")
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)  # JSON object keys arrive as strings
                except (TypeError, ValueError):
                    raise _bad("logit_bias", k, "keys must be token ids") from None
                if isinstance(k, float) and k != tok or isinstance(k, bool):
                    raise _bad("logit_bias", k, "keys must be token ids")
                bias[tok] = v
            self.logit_bias = bias
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise _bad("structured_outputs", self.structured_outputs, f"is invalid ({e})"
                           ) from None
        elif not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise _bad("structured_outputs", self.structured_outputs,
                       "must be a StructuredOutputsParams or a dict")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if not _is_number(v):
                raise _bad(name, v, "must be a number")
            setattr(self, name, float(v))

    # -- validation -----------------------------------------------------------------------------
    def _verify(self) -> None:
        def check_int(name: str, lo: int | None = None, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not _is_int(v):
                raise _bad(name, v, "must be an integer")
            if lo is not None and v < lo:
                raise _bad(name, v, f"must be >= {lo}")

        check_int("n", 1)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise _bad(name, v, "must be finite")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.temperature < 0.0:
            raise _bad("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        check_int("top_k")
        if self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be -1 or 0 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None:
            check_int("seed", 0)
            if self.seed > MAX_SEED:
                raise _bad("seed", self.seed, "must be < 2**64")
        check_int("max_tokens", 1, allow_none=True)
        check_int("min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
                param="min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            check_int(name, -1, allow_none=True)
        for s in self.stop:
            if not isinstance(s, str):
                raise _bad("stop", s, "must contain only strings")
            if not s:
                raise _bad("stop", s, "cannot contain an empty string")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise _bad("stop_token_ids", t, "must contain non-negative integer token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", len(self.stop_token_ids),
                       f"may hold at most {MAX_STOP_TOKEN_IDS} ids")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise _bad("logit_bias", len(self.logit_bias),
                           f"may hold at most {MAX_LOGIT_BIAS} entries")
            for tok, v in self.logit_bias.items():
                if tok < 0:
                    raise _bad("logit_bias", tok, "keys must be non-negative token ids")
                if not _is_number(v) or not math.isfinite(v):
                    raise _bad("logit_bias", v, f"values must be finite numbers (token {tok})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "detokenize", "disable_speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a boolean")
        if self.return_hidden_states is not None and self.n != 1:
            raise _bad("return_hidden_states", self.return_hidden_states, "needs n=1")
        if not self.detokenize and self.stop:
            raise _bad("stop", self.stop, "needs detokenize=True (stop strings match on text)")

    # -- derived --------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        """The one greedy rule (vLLM's): a temperature below ``SAMPLING_EPS``."""
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def verify_hidden_states(self, num_layers: int, max_layers: int) -> SamplingParams:
        """Check ``return_hidden_states`` against the model's layers and the engine's
        ``max_hidden_state_layers``; return the params with negative indices resolved (a copy
        if anything changed)."""
        layers = self.return_hidden_states
        if layers is None:
            return self
        name = "return_hidden_states"
        if max_layers == 0:
            raise _bad(name, layers, "needs an engine started with max_hidden_state_layers > 0 "
                       "(--max-hidden-state-layers)")
        if len(layers) > max_layers:
            raise _bad(name, layers, f"asks for {len(layers)} layers, more than the engine's "
                       f"max_hidden_state_layers={max_layers}")
        resolved = []
        for i in layers:
            if not -(num_layers + 1) <= i <= num_layers:
                raise _bad(name, i, f"must be in [-{num_layers + 1}, {num_layers}] (0: the "
                           f"embeddings, {num_layers}: the final norm's output)")
            resolved.append(i % (num_layers + 1))
        if len(set(resolved)) != len(resolved):
            raise _bad(name, layers, "must not repeat a layer")
        if resolved == layers:
            return self
        out = self.clone()
        out.return_hidden_states = resolved
        if out.extra_args and "return_hidden_states" in out.extra_args:
            out.extra_args = {**out.extra_args, "return_hidden_states": resolved}
        return out

    def verify_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary (needs the model, so the engine calls it)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise _bad("stop_token_ids", t, f"must be < vocab size {vocab_size}")
        for t in self.logit_bias or ():
            if t >= vocab_size:
                raise _bad("logit_bias", t, f"keys must be < vocab size {vocab_size}")
        for t in self.allowed_token_ids or ():
            if t >= vocab_size:
                raise _bad("allowed_token_ids", t, f"must be < vocab size {vocab_size}")

    def verify_logprobs(self, max_logprobs: int, vocab_size: int) -> SamplingParams:
        """Check ``logprobs`` / ``prompt_logprobs`` against the engine's ``max_logprobs`` and
        return the params with -1 resolved to the vocabulary size (a copy if anything changed)."""
        resolved = {name: resolve_num_logprobs(name, getattr(self, name), max_logprobs,
                                               vocab_size)
                    for name in ("logprobs", "prompt_logprobs")}
        if all(getattr(self, k) == v for k, v in resolved.items()):
            return self
        out = self.clone()
        for k, v in resolved.items():
            setattr(out, k, v)
        return out

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

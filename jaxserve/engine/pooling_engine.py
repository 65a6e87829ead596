"""The pooling engine of an encoder-only model: requests in, one packed step at a time,
pooled vectors out (``--runner pooling``).

An encoder reads each prompt whole and keeps nothing, so there is no page, no KV cache and no
chunking: a step takes waiting requests first come, first served, while they pack into the
largest token bucket and ``max_num_seqs`` (``EncoderRunner.plan``); a request that does not fit
waits for the next step, and nobody behind it overtakes it. The same surface as ``LLMEngine``
where the core process and ``LLM`` need it (``core_step``, ``has_unfinished_requests``,
``stats``, ``startup_progress``, ``abort_core_requests``).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.core.pooling_params import (PoolingModelInfo, PoolingOutput, PoolingParams,
                                          check_params, postprocess)
from jaxserve.engine.pooling_inputs import pooling_prompt_ids
from jaxserve.errors import InvalidRequestError
from jaxserve.worker.pooling_runner import EncoderRunner

logger = logging.getLogger(__name__)

# With no --max-num-batched-tokens, a pooling step holds this many tokens (at least one
# max_model_len prompt): whole prompts are packed, so the budget is the batch, not a chunk. On
# CPU a few rows already reach the matmuls' peak and a larger step only pads more.
DEFAULT_POOLING_BATCHED_TOKENS = {"gpu": 8192, "cpu": 1024}


@dataclasses.dataclass
class _Pending:
    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams


class PoolingEngine:
    """A loaded encoder, its runner and a first-come-first-served queue of whole prompts."""

    is_pooling = True

    def __init__(self, config: EngineConfig, *, model, model_config, model_dir, tokenizer,
                 dtype, max_model_len: int, info: PoolingModelInfo, dense, runner: EncoderRunner):
        self.config = config
        self.model = model
        self.model_config = model_config
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.pooling_info = info
        self.dense = dense  # sentence-transformers Dense modules, applied on the host
        self.runner = runner
        self.default_sampling = {}
        self.generation_config = {}
        self._waiting: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        self.prompt_tokens_total = 0
        self.num_steps = 0

    # ---- front end ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: PoolingParams | None = None, *,
                    pair: str | None = None) -> None:
        """Tokenize (``pair``: a cross-encoder's second text) and queue."""
        params = params or PoolingParams(task=self.config.pooling_task or "embed")
        ids, types = pooling_prompt_ids(self.tokenizer, prompt, params, self.max_model_len, pair)
        self.add_core_request(request_id, ids, params, token_type_ids=types)

    def abort_request(self, request_ids) -> None:
        self.abort_core_requests([request_ids] if isinstance(request_ids, str) else request_ids)

    # ---- core -------------------------------------------------------------------------------
    def add_core_request(self, request_id: str, token_ids: list[int], params: PoolingParams, *,
                         token_type_ids: list[int] | None = None, **_unused) -> None:
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError("this server runs a pooling model (--runner pooling): "
                                      "it embeds, scores and classifies, it does not generate "
                                      "text", param="model")
        check_params(params, self.pooling_info)
        if not token_ids:
            raise InvalidRequestError("an input is empty", param="input")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(token_ids)} tokens in the input.", param="input")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequestError(f"a token id is out of range [0, {vocab})", param="input")
        if request_id in self._waiting:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._waiting[request_id] = _Pending(request_id, list(token_ids), token_type_ids, params)

    def abort_core_requests(self, request_ids) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self._waiting)

    def core_step(self) -> list[PoolingOutput]:
        """One packed step over a leading run of the waiting requests (``plan_prefix``)."""
        if not self._waiting:
            return []
        waiting = list(self._waiting.values())[:self.runner.max_num_seqs]
        k, step = self.runner.plan_prefix([(r.token_ids, r.token_type_ids) for r in waiting])
        if step is None:  # cannot happen: add_core_request admits prompts of one row at most
            raise RuntimeError("a pooling request does not fit the largest bucket")
        batch = waiting[:k]
        pooled = self.runner.run(step)
        outs = []
        for req, vec in zip(batch, pooled):
            del self._waiting[req.request_id]
            if self.dense and req.params.task in ("embed", "token_embed", "encode") \
                    and not self.pooling_info.num_labels:
                for d in self.dense:
                    vec = d(vec)
            data = postprocess(vec, req.token_ids, req.params, self.pooling_info)
            outs.append(PoolingOutput(req.request_id, data, req.token_ids))
            self.prompt_tokens_total += len(req.token_ids)
        self.num_steps += 1
        return outs

    step = core_step

    # ---- what the server reads ------------------------------------------------------------
    def startup_progress(self) -> tuple[bool, int, int]:
        n = len(self.runner.buckets)  # warm-up runs before the engine is made
        return True, min(self.runner.num_compiles, n), n

    def stats(self) -> dict:
        return dict(num_running=0, num_waiting=len(self._waiting), num_pages=0, free_pages=0,
                    num_compiles=self.runner.num_compiles,
                    num_compiles_at_warmup=self.runner.compiles_at_warmup,
                    prompt_tokens_total=self.prompt_tokens_total, num_steps=self.num_steps)

    def reset_prefix_cache(self) -> bool:
        return True

    def finish_sequences(self, stops) -> None:
        pass


def build_pooling_engine(config: EngineConfig) -> PoolingEngine:
    """Load an encoder (BERT family) with its checkpoint's pooling, size the runner's buckets
    and compile them."""
    from jaxserve.loaders.model_loader import load_tokenizer, resolve_dtype
    from jaxserve.loaders.sentence_transformers import (check_pooling_architecture, load_encoder,
                                                        pooling_info, read_st_modules,
                                                        resolve_pooling_model)

    from jaxserve.worker.runner import enable_compilation_cache

    t0 = time.perf_counter()
    config = resolve_pooling_model(config)
    enable_compilation_cache()
    unset = set(config.scheduler.backend_defaults)
    config = config.for_platform(jax.default_backend())
    try:
        dtype = resolve_dtype(config.dtype)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="dtype") from None
    if config.parallel.tensor_parallel_size > 1 or config.parallel.pipeline_parallel_size > 1:
        raise InvalidRequestError("--runner pooling runs an encoder on one device (no tensor or "
                                  "pipeline parallelism)", param="runner")
    for name, off in (("speculative_config", config.speculative is None),
                      ("enable_lora", config.lora is None), ("quantization",
                                                            config.quantization is None)):
        if not off:
            raise InvalidRequestError(f"{name} is not supported with --runner pooling",
                                      param=name)
    model_dir = Path(str(config.model)).expanduser()
    try:
        check_pooling_architecture(model_dir)
        st = read_st_modules(model_dir)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="model") from None
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    try:
        model, mc = load_encoder(model_dir, dtype=dtype, hf_overrides=config.hf_overrides,
                                 tokenizer=lambda: tokenizer)
    except ValueError as e:
        raise InvalidRequestError(str(e), param="model") from None
    info = pooling_info(model, mc, st, config.pooler_config)
    limit = min(mc.max_position_embeddings, st.max_seq_length or mc.max_position_embeddings)
    max_model_len = int(config.scheduler.max_model_len or limit)
    if max_model_len > mc.max_position_embeddings:
        raise InvalidRequestError(f"max_model_len={max_model_len} exceeds the model's limit of "
                                  f"{mc.max_position_embeddings}", param="max_model_len")
    budget = config.scheduler.max_num_batched_tokens
    if "max_num_batched_tokens" in unset:
        budget = max(DEFAULT_POOLING_BATCHED_TOKENS[
            "gpu" if jax.default_backend() == "gpu" else "cpu"], max_model_len)
    min_bucket = 16 if "min_token_bucket" in unset else config.scheduler.min_token_bucket
    runner = EncoderRunner(model, info.pooling_type, max_model_len, budget,
                           config.scheduler.max_num_seqs, min_bucket=min_bucket)
    logger.info("loaded %s (%s, %s pooling%s) in %.1f s", config.model, mc.architecture,
                info.pooling_type, ", normalized" if info.normalize else "",
                time.perf_counter() - t0)
    if not config.enforce_eager:  # --enforce-eager: each bucket compiles on its first step
        runner.warmup()
    return PoolingEngine(config, model=model, model_config=mc, model_dir=model_dir,
                         tokenizer=tokenizer, dtype=jnp.dtype(dtype), max_model_len=max_model_len,
                         info=info, dense=st.dense, runner=runner)

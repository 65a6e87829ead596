"""The offline ``LLM`` API, like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import logging
import os
from functools import partial
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.args import engine_config_from_kwargs
from jaxserve.engine.builder import build_engine
from jaxserve.worker.memory_budget import set_allocator_fraction
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.pooling_params import PoolingOutput, PoolingParams
from jaxserve.core.scoring import cosine_output, score_pairs


def _log_to_stderr(level: str | None) -> None:
    """``JAXSERVE_LOGGING_LEVEL=INFO``: the engine's start-up log (load, each compile) on stderr
    when the program has not set up logging itself (scripts, benchmarks)."""
    if level and not logging.getLogger().handlers:
        logging.basicConfig(level=level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class LLM:
    """Offline batched generation. Results come back in input order."""

    def __init__(self, model: str | None = None, **kwargs):
        _log_to_stderr(os.environ.get("JAXSERVE_LOGGING_LEVEL"))
        config = engine_config_from_kwargs(model, **kwargs)
        # before JAX starts, if it has not: gpu_memory_utilization of the device's total memory
        set_allocator_fraction(config.cache.gpu_memory_utilization)
        self.llm_engine = build_engine(config)
        self.config = self.llm_engine.config
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (``generate``'s default)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """``lora_request``: one ``LoRARequest`` for every prompt, or a list of one (or None,
        the base model) per prompt."""
        self._require_runner("generate", "generate")
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        prios = _per_prompt(priority, len(prompts), "priority") if priority is not None else None
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        return self._run([(p, sp, prios[i] if prios else 0, loras[i])
                          for i, (p, sp) in enumerate(zip(prompts, params))], use_tqdm)

    # ---- pooling (--runner pooling) ---------------------------------------------------------
    @property
    def runner_type(self) -> str:
        return "pooling" if getattr(self.llm_engine, "is_pooling", False) else "generate"

    def _pooling_info(self, method: str):
        """What the engine pools: a pooling runner's model, or a generative decoder's
        embeddings (LAST pooling of its final hidden state) for ``embed`` and ``score``."""
        engine = self.llm_engine
        if self.runner_type == "pooling":
            return engine.pooling_info
        if method in ("embed", "score") and getattr(engine, "pooling", None) is not None:
            return engine.pooling.info
        self._require_runner("pooling", method)

    def _require_runner(self, want: str, method: str) -> None:
        if self.runner_type != want:
            raise InvalidRequestError(
                f"LLM.{method} needs a model served with runner {want!r}; this LLM runs "
                f"{self.config.model} with runner {self.runner_type!r}"
                + (" (pass runner='pooling', or task='embed'|'score'|'classify')"
                   if want == "pooling" else ""), param="runner")

    def embed(self, prompts, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              use_tqdm: bool = False) -> list[PoolingOutput]:
        """One embedding per prompt (a string or token ids): ``out.outputs.embedding``."""
        params = pooling_params or PoolingParams(
            task="embed", truncate_prompt_tokens=truncate_prompt_tokens, dimensions=dimensions)
        return self.encode(prompts, params, use_tqdm=use_tqdm, method="embed")

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = False) -> list[PoolingOutput]:
        """Class probabilities per prompt (``out.outputs.probs``)."""
        return self.encode(prompts, PoolingParams(task="classify",
                                                  truncate_prompt_tokens=truncate_prompt_tokens),
                           use_tqdm=use_tqdm, method="classify")

    def reward(self, prompts, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = False) -> list[PoolingOutput]:
        """vLLM's ``LLM.reward``: the model's raw pooled output (a reward model pools ALL or
        STEP: one row per kept token)."""
        return self.encode(prompts, PoolingParams(task="encode",
                                                  truncate_prompt_tokens=truncate_prompt_tokens),
                           use_tqdm=use_tqdm, method="reward")

    def score(self, text_1, text_2, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[PoolingOutput]:
        """vLLM's ``LLM.score``: one query against many documents (or pairwise lists). A
        cross-encoder reads each pair together; an embedder scores by cosine similarity.
        ``out.outputs.score``."""
        info = self._pooling_info("score")
        pairs = score_pairs(text_1, text_2)
        if info.num_labels:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
            items = [(a, params, b) for a, b in pairs]
            return self._pool(items, use_tqdm)
        params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        texts = sorted({t for p in pairs for t in p}, key=str)
        vecs = {t: o.data for t, o in zip(texts, self._pool([(t, params, None) for t in texts],
                                                              use_tqdm))}
        return [cosine_output(str(i), vecs[a], vecs[b]) for i, (a, b) in enumerate(pairs)]

    def encode(self, prompts, pooling_params: PoolingParams | None = None, *,
               use_tqdm: bool = False, method: str = "encode") -> list[PoolingOutput]:
        """The pooled output of each prompt, in input order."""
        self._pooling_info(method)
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("prompts is empty", param="prompts")
        params = pooling_params or PoolingParams(task=self.config.pooling_task or "embed")
        return self._pool([(p, params, None) for p in prompts], use_tqdm)

    def _pool(self, items, use_tqdm: bool) -> list[PoolingOutput]:
        engine = self.llm_engine
        return self._drive([partial(engine.add_request, prompt=prompt, params=params, pair=pair)
                            for prompt, params, pair in items], use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             lora_request=None) -> list[RequestOutput]:
        self._require_runner("generate", "chat")
        from jaxserve.engine.tokenizer import apply_chat_template
        from jaxserve.multimodal.inputs import chat_images

        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in convs:  # image parts (image_url, image_pil) travel as multi_modal_data
            mmc = self.config.multimodal
            c, images = chat_images(c, mmc.allowed_local_media_path, mmc.allowed_media_domains)
            ids = apply_chat_template(self.llm_engine.tokenizer, c, add_generation_prompt,
                                      chat_template)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                           if images else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    # ---- research: weights in place, sleep and wake (engine/weight_sync.py) ---------------
    def update_weights(self, weights, *, in_flight: str = "wait") -> bool:
        """New weights without a restart: a pytree of ``jax.Array`` (an ``nnx.State`` or
        module, or a dict keyed by HF names) or a path (safetensors directory or file, orbax
        directory). Arrays already placed as the engine's (its mesh, sharding and dtype) are
        used as they are, with no copy; others are cast and placed once; fp8 / int8 layers
        are re-quantized. Everything is checked before anything changes (a ValueError names
        the tensor). No step recompiles; the prefix cache is reset. ``in_flight``: "wait"
        (requests running finish on the old weights, the swap follows) or "abort". True when
        the new weights are in place now."""
        return self.llm_engine.update_weights(weights, in_flight=in_flight)

    def get_weights(self) -> dict:
        """The engine's params keyed by HF name: its own device arrays (no copy), placed as
        ``update_weights`` uses them as they are."""
        return self.llm_engine.get_weights()

    def sleep(self, level: int = 1) -> None:
        """Give device memory back: level 1 drops the KV cache and moves the weights to host
        memory; level 2 drops both (``wake_up`` reloads the weights from their source)."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; both when None)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page; False while pages are in use."""
        return self.llm_engine.reset_prefix_cache()

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        return self._drive([partial(engine.add_request, prompt=prompt, params=sp, priority=prio,
                                    final_only=True, lora_request=lora)
                            for prompt, sp, prio, lora in items], use_tqdm)

    def _drive(self, adds, use_tqdm: bool) -> list:
        """Add each request (``add(request_id)``), step the engine until every one has
        finished, and return their outputs in input order; on any error (or interrupt) every
        request added is aborted, so nothing stays in the engine."""
        engine = self.llm_engine
        order = []
        try:
            for add in adds:
                rid = str(next(self._ids))
                add(rid)
                order.append(rid)
        except Exception:
            engine.abort_request(order)
            raise
        done: dict = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request(order)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in order]

def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts",
                                      param=name)
        return list(value)
    return [value] * n

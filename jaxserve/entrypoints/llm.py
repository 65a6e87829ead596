"""The offline ``LLM`` API, like vLLM's: ``LLM(model).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
from typing import Sequence

from tqdm.auto import tqdm

from jaxserve.config import (CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.errors import InvalidRequestError
from jaxserve.core.outputs import RequestOutput
from jaxserve.worker.runner import default_scheduler_limits
from jaxserve.core.sampling_params import SamplingParams


def engine_config_from_kwargs(model=None, *, tokenizer=None, dtype="auto", max_model_len=None,
                              gpu_memory_utilization=0.9, block_size=16, max_num_seqs=None,
                              max_num_batched_tokens=None, enable_prefix_caching=True,
                              swap_space=4.0, seed=0, tensor_parallel_size=1,
                              data_parallel_size=1, enable_expert_parallel=False,
                              load_format="auto",
                              attention_backend="auto", num_gpu_blocks_override=None,
                              preemption_mode="recompute", served_model_name=None,
                              min_token_bucket=None, token_bucket_growth=None,
                              async_scheduling=True, speculative_config=None) -> EngineConfig:
    seqs, toks, min_bucket, growth = default_scheduler_limits()
    return EngineConfig(
        model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, load_format=load_format,
        attention_backend=attention_backend, served_model_name=served_model_name,
        async_scheduling=bool(async_scheduling),
        speculative=SpeculativeConfig.from_dict(speculative_config),
        cache=CacheConfig(block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                          num_gpu_blocks_override=num_gpu_blocks_override,
                          enable_prefix_caching=enable_prefix_caching, swap_space=swap_space),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs or seqs,
            max_num_batched_tokens=max_num_batched_tokens or toks,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            min_token_bucket=min_token_bucket or min_bucket,
            token_bucket_growth=token_bucket_growth or growth),
        parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                data_parallel_size=data_parallel_size,
                                enable_expert_parallel=enable_expert_parallel),
    )


class LLM:
    """Offline batched generation. Results come back in input order."""

    def __init__(self, model: str | None = None, **kwargs):
        self.config = engine_config_from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        prios = _per_prompt(priority, len(prompts), "priority") if priority is not None else None
        return self._run([(p, sp, prios[i] if prios else 0)
                          for i, (p, sp) in enumerate(zip(prompts, params))], use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True
             ) -> list[RequestOutput]:
        from jaxserve.engine.tokenizer import apply_chat_template
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [apply_chat_template(self.llm_engine.tokenizer, c, add_generation_prompt,
                                       chat_template) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, items, use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order = []
        try:
            for prompt, sp, prio in items:
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, sp, priority=prio, final_only=True)
                order.append(rid)
        except Exception:
            engine.abort_request(order)
            raise
        done: dict[str, RequestOutput] = {}
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
    if value is None:
        return [SamplingParams() for _ in range(n)] if name == "sampling_params" else [0] * n
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts",
                                      param=name)
        return list(value)
    return [value] * n

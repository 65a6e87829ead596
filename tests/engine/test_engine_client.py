"""The three engine kinds a front end may be handed all implement ``EngineClient``."""
from __future__ import annotations

import asyncio
import inspect

import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.data_parallel import DataParallelAsyncLLM
from jaxserve.engine.protocol import EngineClient

METHODS = [name for name, v in vars(EngineClient).items()
           if not name.startswith("_") and (callable(v) or isinstance(v, property))]


@pytest.mark.parametrize("cls", [AsyncLLM, EngineCoreClient, DataParallelAsyncLLM])
def test_each_engine_kind_has_every_method_with_the_protocols_signature(cls):
    assert set(METHODS) >= {"generate", "abort", "reset_prefix_cache", "check_health",
                            "is_running", "startup_progress", "stats", "shutdown"}
    for name in METHODS:
        want, have = getattr(EngineClient, name), getattr(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(have, property), (cls.__name__, name)
            continue
        params = lambda f: [(p.name, p.kind, p.default)  # noqa: E731
                            for p in inspect.signature(f).parameters.values()]
        assert params(have) == params(want), (cls.__name__, name)
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want)
        assert inspect.isasyncgenfunction(have) == (name == "generate"), (cls.__name__, name)


def test_an_in_process_engine_is_an_engine_client(tiny_llama_dir):
    from jaxserve.config import engine_config_from_kwargs

    engine = AsyncLLM(engine_config_from_kwargs(str(tiny_llama_dir), max_model_len=64,
                                                max_num_seqs=2, num_gpu_blocks_override=16))
    try:
        assert isinstance(engine, EngineClient)
        assert engine.config.scheduler.backend_defaults == ()  # resolved for the platform
    finally:
        asyncio.run(engine.shutdown())

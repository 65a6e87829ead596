"""The research tests' engines: one token bucket, the tiny llama."""
import pytest

from processors import BanJax, Exploding

SMALL = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, min_token_bucket=32)


@pytest.fixture(scope="session")
def hidden_llm(tiny_llama_dir):
    from jaxserve import LLM

    return LLM(str(tiny_llama_dir), max_hidden_state_layers=3, **SMALL)


@pytest.fixture(scope="session")
def embeds_llm(tiny_llama_dir):
    from jaxserve import LLM

    return LLM(str(tiny_llama_dir), enable_prompt_embeds=True, **SMALL)


@pytest.fixture(scope="session")
def processors_llm(tiny_llama_dir):
    """processors.py's BanJax, BanHost (named as ``module:Class``) and Exploding."""
    from jaxserve import LLM

    return LLM(str(tiny_llama_dir), logits_processors=[BanJax, "processors:BanHost", Exploding],
               **SMALL)

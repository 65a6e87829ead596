"""Output-quality checks shared by the quantization tests and benchmark: perplexity of a text
through ``LLM`` (prompt logprobs), vLLM's greedy closeness rule, and live weight bytes."""
from __future__ import annotations

import math
from pathlib import Path

import jax

HELDOUT_TEXT = Path(__file__).parents[2] / "tests" / "data" / "heldout.txt"

# SmolLM2 engine settings shared by the quantization tests and benchmark (same shapes: the
# persistent compilation cache serves both). Two token buckets: 8 (decode of up to 8 rows) and
# 512 (the held-out text, the batched chat prompts) keep the CPU warm-up to two compiles.
SMOLLM2_ENGINE_KW = dict(dtype="bfloat16", max_model_len=1024, num_gpu_blocks_override=160,
                         max_num_seqs=8, max_num_batched_tokens=512, min_token_bucket=8,
                         token_bucket_growth=64)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "What is 12 times 7?",
    "Describe the colour blue to someone who cannot see.",
]


def perplexity(llm, text: str) -> float:
    """exp(mean negative log-likelihood) of ``text``'s tokens after the first, from one
    prefill with ``prompt_logprobs``."""
    from jaxserve.core.sampling_params import SamplingParams

    [out] = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)
    ids = list(out.prompt_token_ids)
    lps = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return math.exp(-sum(lps) / len(lps))


def greedy_chats(llm, prompts=CHAT_PROMPTS, max_tokens: int = 32, top: int = 8):
    """Greedy answers to one-turn chats: per prompt (token ids, per-position top logprobs)."""
    from jaxserve.core.sampling_params import SamplingParams

    convs = [[{"role": "user", "content": p}] for p in prompts]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True, logprobs=top), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def first_divergence(a, b, top: int = 5) -> str | None:
    """vLLM's rule (``check_logprobs_close``): the two greedy outputs agree up to their first
    differing token, where each side's token is among the other's ``top`` logprobs. -> None
    when close, else a description of the failure."""
    (ids_a, lp_a), (ids_b, lp_b) = a, b

    def best(lp) -> set:
        return set(sorted(lp, key=lambda t: -lp[t].logprob)[:top])

    for i, (x, y) in enumerate(zip(ids_a, ids_b)):
        if x != y:
            if x not in best(lp_b[i]) or y not in best(lp_a[i]):
                return f"position {i}: {x} vs {y} not in each other's top {top} logprobs"
            return None
    return None


def param_bytes(model, include=None) -> int:
    """Sum of ``nbytes`` of the model's live parameter arrays (optionally only those whose
    dotted path satisfies ``include``)."""
    from flax import nnx

    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = ".".join(str(p) for p in path)
        value = var.get_value()
        if isinstance(value, jax.Array) and (include is None or include(name)):
            total += value.nbytes
    return total

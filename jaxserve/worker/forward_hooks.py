"""What the jitted step adds to a family's own forward: hidden-state capture
(``SamplingParams.return_hidden_states``) and prompt embeddings in place of token embeddings.

Prompt embeddings shadow the family's ``embed`` on the merged module for one trace; the capture
is an output of the one layer loop (``ModelBase.run_layers(..., capture=)``), so every family
gets both without code of its own.

**Hidden states.**
The step gathers, for every token, the residual stream at up to K layers its row asked for
(``StepInputs.hidden_layers [S, K]``, -1 padded): ``[T, K, H]`` float32. K is the engine's
``max_hidden_state_layers``, so the trace depends only on the configuration, never on what rows
ask. Layer indices are Hugging Face's ``output_hidden_states`` ones: 0 = the embeddings (what
enters layer 0), ``i`` = the output of decoder layer ``i``, ``num_layers`` = the final norm's
output.

**Prompt embeddings.** Tokens with ``embed_mask`` set read their row of ``embeds [T, H]`` (what
the request gave as ``prompt_embeds``) instead of the embedding of their placeholder id.
"""
from __future__ import annotations

from contextlib import contextmanager

import jax.numpy as jnp


@contextmanager
def shadow(model, name: str, fn):
    """``model.<name>`` is ``fn`` inside the block (an instance attribute over the method; the
    merged module is the trace's own), then what it was."""
    had = name in vars(model)
    old = vars(model).get(name)
    object.__setattr__(model, name, fn)
    try:
        yield
    finally:
        if had:
            object.__setattr__(model, name, old)
        else:
            object.__delattr__(model, name)


@contextmanager
def prompt_embeds(model, embed_mask, embeds):
    """Inside the block, ``model.embed`` takes the given embeddings where ``embed_mask``."""
    if not model.supports_pipeline:
        raise ValueError(f"{type(model).__name__} does not give its forward in pieces "
                         "(embed, run_layer): prompt_embeds is not supported for it")
    embed = model.embed

    def embed_or_given(ids):
        x = embed(ids)
        if isinstance(x, tuple):
            raise ValueError(f"{type(model).__name__} embeds more than the residual stream: "
                             "prompt_embeds is not supported for it")
        return jnp.where(embed_mask[:, None], embeds.astype(x.dtype), x)

    with shadow(model, "embed", embed_or_given):
        yield


def token_layers(hidden_layers, query_start, num_tokens: int):
    """``[T, K]``: the layers each token's row asked for; -1 for padding tokens."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    S = hidden_layers.shape[0]
    row = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right"), 0, S - 1)
    real = t < query_start[-1]
    return jnp.where(real[:, None], hidden_layers[row], -1)

"""What the jitted step adds to a family's own forward: hidden-state capture
(``SamplingParams.return_hidden_states``) and prompt embeddings in place of token embeddings.

Both hook the family's ``embed`` and ``run_layer`` (the pieces pipeline stages run,
``supports_pipeline``), shadowed on the merged module for one trace, so every such family gets
them without code of its own.

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


def _check_pieces(model, what: str) -> None:
    if not model.supports_pipeline:
        raise ValueError(f"{type(model).__name__} does not give its forward in pieces "
                         f"(embed, run_layer): {what} is not supported for it")


@contextmanager
def prompt_embeds(model, embed_mask, embeds):
    """Inside the block, ``model.embed`` takes the given embeddings where ``embed_mask``."""
    _check_pieces(model, "prompt_embeds")
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


def residual(x):
    """A family's hidden carry may hold more than the residual stream (Gemma 4's per-layer
    inputs ride along as ``(x, pli)``)."""
    return x[0] if isinstance(x, tuple) else x


def forward_with_capture(model, hidden_layers, query_start, token_ids, positions, kv_pages,
                         md, **kwargs):
    """``model(token_ids, positions, kv_pages, md, **kwargs)`` plus ``[T, K, H]`` float32 of
    the residual stream at each token's asked layers (zeros where none)."""
    _check_pieces(model, "return_hidden_states")
    T = token_ids.shape[0]
    want = token_layers(hidden_layers, query_start, T)[..., None]  # [T, K, 1]
    num_layers = model.num_layers
    box = {}
    embed, run_layer = model.embed, model.run_layer

    def keep(i, x):
        x = residual(x).astype(jnp.float32)
        cap = box.get("cap")
        if cap is None:
            cap = jnp.zeros((T, want.shape[1], x.shape[-1]), jnp.float32)
        box["cap"] = jnp.where(want == i, x[:, None, :], cap)

    def embed_and_keep(ids):
        x = embed(ids)
        keep(0, x)
        return x

    def run_layer_and_keep(i, *args, **kw):
        x, kv = run_layer(i, *args, **kw)
        if i + 1 < num_layers:  # the last layer's output is read after the final norm
            keep(i + 1, x)
        return x, kv

    with shadow(model, "embed", embed_and_keep), \
            shadow(model, "run_layer", run_layer_and_keep):
        hidden, kv_pages = model(token_ids, positions, kv_pages, md, **kwargs)
    keep(num_layers, hidden)
    return hidden, kv_pages, box["cap"]

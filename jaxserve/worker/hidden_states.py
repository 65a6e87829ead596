"""Hidden-state capture inside the jitted step (``SamplingParams.return_hidden_states``).

The step gathers, for every token, the residual stream at up to K layers its row asked for
(``StepInputs.hidden_layers [S, K]``, -1 padded): ``[T, K, H]`` float32. K is the engine's
``max_hidden_state_layers``, so the trace depends only on the configuration, never on what rows
ask. Layer indices are Hugging Face's ``output_hidden_states`` ones: 0 = the embeddings (what
enters layer 0), ``i`` = the output of decoder layer ``i``, ``num_layers`` = the final norm's
output.

The model is run through its own forward: the family's ``embed`` and ``run_layer`` (the pieces
pipeline stages run, ``supports_pipeline``) are wrapped on the merged module for the trace, so
every such family captures without code of its own.
"""
from __future__ import annotations

import jax.numpy as jnp


def token_layers(hidden_layers, query_start, num_tokens: int):
    """``[T, K]``: the layers each token's row asked for; -1 for padding tokens."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    S = hidden_layers.shape[0]
    row = jnp.clip(jnp.searchsorted(query_start[1:], t, side="right"), 0, S - 1)
    real = t < query_start[-1]
    return jnp.where(real[:, None], hidden_layers[row], -1)


def _residual(x):
    """A family's hidden carry may hold more than the residual stream (Gemma 4's per-layer
    inputs ride along as ``(x, pli)``)."""
    return x[0] if isinstance(x, tuple) else x


def forward_with_capture(model, hidden_layers, query_start, token_ids, positions, kv_pages,
                         md, **kwargs):
    """``model(token_ids, positions, kv_pages, md, **kwargs)`` plus ``[T, K, H]`` float32 of
    the residual stream at each token's asked layers (zeros where none)."""
    if not getattr(model, "supports_pipeline", False):
        raise ValueError(f"{type(model).__name__} does not give its forward in pieces "
                         "(embed, run_layer): return_hidden_states is not supported for it")
    T = token_ids.shape[0]
    want = token_layers(hidden_layers, query_start, T)[..., None]  # [T, K, 1]
    num_layers = model.num_layers
    box = {}
    embed, run_layer = model.embed, model.run_layer

    def keep(i, x):
        x = _residual(x).astype(jnp.float32)
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

    # instance attributes shadow the methods for this trace only (the merged module is the
    # step's own, rebuilt from the graph on every trace)
    object.__setattr__(model, "embed", embed_and_keep)
    object.__setattr__(model, "run_layer", run_layer_and_keep)
    try:
        hidden, kv_pages = model(token_ids, positions, kv_pages, md, **kwargs)
    finally:
        object.__delattr__(model, "embed")
        object.__delattr__(model, "run_layer")
    keep(num_layers, hidden)
    return hidden, kv_pages, box["cap"]

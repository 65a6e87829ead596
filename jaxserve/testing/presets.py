"""Real model shapes without checkpoints: config.json + generation_config.json + a tokenizer.

Benchmarks run these with ``load_format="dummy"`` (random weights made on the device from the
config), so the 1.1B and 8B shapes can be measured on a machine with no network and no weights.
The tokenizer is a small stand-in (its vocab is far smaller than the model's); benchmarks feed
random token ids, so only the shapes matter.
"""
from __future__ import annotations

import copy
import json
import os

TOKENIZER_VOCAB = 512

PRESETS: dict[str, dict] = {
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    "tinyllama-1.1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.1-8B (Llama-3 8B shape with the llama3 rope scaling)
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # mistralai/Mixtral-8x7B-v0.1 (8 experts, 2 active per token); 93 GB in bf16 at 32 layers,
    # so GPU benchmarks cut ``num_hidden_layers``
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },

    # Gemma 4 31B-shaped (dense): 5 sliding (window 1024, 16 KV heads of 256) to 1 global
    # layer (4 KV heads of 512, keys serve as values). Shape figures as assumed for the capacity
    # arithmetic, not read from a released config.json.
    "gemma4-31b": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(60)],
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1000000.0}},
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
    # Gemma 4 26B-A4B-shaped (MoE: 128 experts, 8 active, beside a small dense MLP); figures as
    # assumed for the capacity arithmetic
    "gemma4-26b-a4b": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 2816,
        "intermediate_size": 2112,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 2,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(30)],
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1000000.0}},
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    },
}


def dense_twin(config: dict) -> dict:
    """The dense Llama with a MoE config's active parameters: the same attention and an MLP
    ``top_k`` experts wide, so a token costs the same FLOPs and, at batch 1, the same weight
    bytes as the MoE model."""
    out = {k: v for k, v in copy.deepcopy(config).items()
           if k not in ("num_local_experts", "num_experts", "num_experts_per_tok",
                        "moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size",
                        "router_aux_loss_coef", "output_router_logits", "decoder_sparse_step",
                        "mlp_only_layers")}
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    out.update(architectures=["LlamaForCausalLM"], model_type="llama",
               intermediate_size=int(config.get("num_experts_per_tok", 2)) * int(width))
    return out


def preset_config(name: str) -> dict:
    """A copy of the HF config.json dict of a preset; unknown names raise ValueError."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


def param_count(config: dict) -> int:
    """Number of weights of a Llama-family config (embeddings, layers, final norm, LM head)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    v, n_layers = config["vocab_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    attn = h * heads * d + 2 * h * kv_heads * d + heads * d * h
    if config.get("attention_bias"):
        attn += heads * d + 2 * kv_heads * d
    per_layer = attn + 3 * h * i + 2 * h
    head = 0 if config.get("tie_word_embeddings") else v * h
    return v * h + n_layers * per_layer + h + head


def write_preset(name: str, out_dir: str, config: dict | None = None) -> str:
    """Write config.json, generation_config.json and a small tokenizer (no weights) to out_dir
    (``config``: an edited copy of the preset's, e.g. fewer layers)."""
    config = preset_config(name) if config is None else config
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "do_sample": False}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    _write_tokenizer(out_dir, config["vocab_size"])
    return out_dir


def _write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """The tiny models' trained BPE, its vocabulary filled up to the model's ``vocab_size``, so
    every id a dummy-weight model samples decodes to text (a stream then carries text on every
    token, as with a real vocabulary)."""
    try:
        from jaxserve.testing.tiny_model import train_tokenizer
    except ImportError:
        tok = _byte_level_tokenizer()
    else:
        tok = train_tokenizer(TOKENIZER_VOCAB)
    tok.save_pretrained(out_dir)
    _fill_vocab(os.path.join(out_dir, "tokenizer.json"), vocab_size)


def _fill_vocab(path: str, vocab_size: int) -> None:
    """Ids past the trained BPE's up to ``vocab_size``: ' ' plus a letter word each (byte-level
    spellings, no merges, so encoding is unchanged)."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in tj.get("added_tokens", [])}
    next_id = 1 + max([*vocab.values(), *(t["id"] for t in tj.get("added_tokens", []))])
    n = 0
    for i in range(next_id, vocab_size):
        while True:
            word, k = "", n
            while True:
                word = chr(ord("a") + k % 26) + word
                k = k // 26 - 1
                if k < 0:
                    break
            n += 1
            if "\u0120" + word not in taken:
                break
        vocab["\u0120" + word] = i
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)


def _byte_level_tokenizer():
    """A byte-level BPE with no merges: 256 byte tokens plus <s>, </s>, <unk>. Needs no training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")

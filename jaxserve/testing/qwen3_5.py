"""Tiny random Qwen 3.5 / 3.6 checkpoints (dense or MoE; text-only ``*ForCausalLM`` or the
vision-language ``*ForConditionalGeneration`` layout), built with transformers' own classes,
plus random weights for the multi-token-prediction head under the released checkpoints' names
(``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*`` a
full-attention decoder layer, ``mtp.norm``): transformers ignores ``mtp.*`` on load, so HF
``generate`` on the same directory stays the reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.loaders.demo_model import BOS, EOS_TEXT, IM_END, PAD, train_tokenizer

TEXT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, max_position_embeddings=40960, tie_word_embeddings=False,
            rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=IM_END, pad_token_id=PAD)
DENSE = dict(intermediate_size=128)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
           num_experts_per_tok=2)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=64)
# The VL layout's tokenizer adds Qwen's vision tokens after the trained vocabulary, and a chat
# template that renders content parts as Qwen's does (an image as start, pad, end).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen's image processor settings at a tiny scale: 16-pixel patches merged 2x2, so an image
# becomes (h/32)*(w/32) tokens, at least 1 and at most 16.
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast",
                "processor_class": "Qwen3VLProcessor", "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                "do_resize": True, "do_convert_rgb": True}


def make_tiny_qwen3_5(out_dir, *, moe: bool = False, vl: bool = False, seed: int = 0,
                      mtp: bool = True, **text_overrides) -> Path:
    """Write the checkpoint, a trained tokenizer and the generation config to ``out_dir``.
    Zero-centred norms, the gated norm, ``A_log`` and ``dt_bias`` get random values so the
    tests see every one of them. ``mtp``: add a random MTP head (``mtp.*``)."""
    import torch
    import transformers as tf

    text = {**TEXT, **(MOE if moe else DENSE), **text_overrides}
    tokenizer = train_tokenizer(text["vocab_size"])
    ids = {}
    if vl:
        tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
        tokenizer.chat_template = VL_CHAT_TEMPLATE
        text["vocab_size"] = len(tokenizer)
        ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                        "video_token_id"), tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    torch.manual_seed(seed)
    if moe:
        cfg = (tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **ids) if vl
               else tf.Qwen3_5MoeTextConfig(**text))
        cls = tf.Qwen3_5MoeForConditionalGeneration if vl else tf.Qwen3_5MoeForCausalLM
    else:
        cfg = (tf.Qwen3_5Config(text_config=text, vision_config=VISION, **ids) if vl
               else tf.Qwen3_5TextConfig(**text))
        cls = tf.Qwen3_5ForConditionalGeneration if vl else tf.Qwen3_5ForCausalLM
    if vl:
        cfg.tie_word_embeddings = False
    model = cls(cfg).float()
    rng = np.random.default_rng(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:  # biases and norms off their init, so tests see them
                if name.endswith(("bias", "norm1.weight", "norm2.weight", "norm.weight")):
                    base = 1.0 if name.endswith("weight") else 0.0
                    p.copy_(torch.from_numpy(base + 0.1 * rng.standard_normal(p.shape)))
                elif name.endswith("pos_embed.weight"):
                    p.copy_(torch.from_numpy(0.5 * rng.standard_normal(p.shape)))
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.from_numpy(1 + 0.1 * rng.standard_normal(p.shape)))
            elif name.endswith("norm.weight"):  # zero-centred: (1 + w)
                p.copy_(torch.from_numpy(0.1 * rng.standard_normal(p.shape)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.from_numpy(rng.uniform(-1, 1, p.shape)))
    model.generation_config = tf.GenerationConfig(bos_token_id=BOS,
                                                  eos_token_id=[IM_END, EOS_TEXT],
                                                  pad_token_id=PAD)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if vl:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    if mtp:
        _add_mtp_head(out, text, rng)
    cfg_path = out / "config.json"
    c = json.loads(cfg_path.read_text())
    c["_jaxserve_note"] = "random weights: tests only"
    if mtp:
        (c["text_config"] if "text_config" in c else c)["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(c, indent=2, sort_keys=True) + "\n")
    return out


def _add_mtp_head(out: Path, text: dict, rng: np.random.Generator) -> None:
    """Random ``mtp.*`` tensors written into the checkpoint beside the model's. The decoder
    layer copies the shapes (and expert layout) of the model's last full-attention layer as
    transformers saved it, with fresh random values."""
    from safetensors.numpy import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(str(path))
    h = text["hidden_size"]
    every = int(text.get("full_attention_interval") or 4)
    last_full = max(i for i in range(text["num_hidden_layers"]) if (i + 1) % every == 0)
    layer = next(p for p in (f"model.language_model.layers.{last_full}.",
                             f"model.layers.{last_full}.") if any(k.startswith(p) for k in tensors))
    mtp = {}
    for name, arr in tensors.items():
        if not name.startswith(layer):
            continue
        new = "mtp.layers.0." + name[len(layer):]
        if name.endswith("norm.weight"):  # zero-centred (1 + w)
            mtp[new] = 0.1 * rng.standard_normal(arr.shape)
        else:
            mtp[new] = rng.standard_normal(arr.shape) * float(np.std(arr) or 0.02)
    mtp["mtp.fc.weight"] = rng.standard_normal((h, 2 * h)) * (2 * h) ** -0.5
    for norm in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * rng.standard_normal((h,))
    tensors.update({k: v.astype(np.float32) for k, v in mtp.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


class TorchMtpHead:
    """A dense checkpoint's MTP head built from HF's own full-attention decoder layer and
    norms with its ``mtp.*`` weights, over HF's target hidden states (normed): the reference
    the engine's head is tested against, and a way to train the tiny head."""

    def __init__(self, path):
        import torch
        import transformers as tf
        from safetensors.numpy import load_file
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        path = Path(path)
        arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
        self.hf = hf = getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()
        cfg = getattr(hf.config, "text_config", hf.config)
        w = {k[len("mtp."):]: torch.from_numpy(v) for k, v in
             load_file(str(path / "model.safetensors")).items() if k.startswith("mtp.")}
        full = cfg.layer_types.index("full_attention")
        self.layer = m.Qwen3_5DecoderLayer(cfg, layer_idx=full).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items()
                                    if k.startswith("layers.0.")})
        self.norms = {}
        for name in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
            self.norms[name] = m.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).eval()
            self.norms[name].load_state_dict({"weight": w[f"{name}.weight"]})
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fc.load_state_dict({"weight": w["fc.weight"]})

    @property
    def _text(self):
        """HF's text model (a vision-language checkpoint's ``language_model``)."""
        return getattr(self.hf.model, "language_model", self.hf.model)

    def _head(self, next_ids, hidden, next_embeds=None, pos=None):
        """Head outputs (normed) at positions 0..len-1, causal over the whole sequence;
        ``next_embeds``: the next tokens' input embeddings where they are not the plain token
        embeddings (image tokens); ``pos``: M-RoPE positions ``[3, 1, len]``."""
        import torch

        n = self.norms
        e = self._text.embed_tokens(next_ids) if next_embeds is None else next_embeds
        x = self.fc(torch.cat([n["pre_fc_norm_embedding"](e), n["pre_fc_norm_hidden"](hidden)],
                              dim=-1))
        if pos is None:
            pos = torch.arange(x.shape[1])[None]
        x = self.layer(x, self._text.rotary_emb(x, pos), attention_mask=None,
                       position_ids=pos)
        return n["norm"](x[0] if isinstance(x, tuple) else x)

    def _context(self, tokens: list[int], images: dict | None, k: int = 0):
        """``tokens`` as the head reads them: (ids ``[1, L]``, the model's final hidden
        states ``[1, L, H]``, the input embeddings of tokens ``1 .. L-1`` (None: plain token
        embeddings), rotary positions of the tokens and ``k`` text tokens after them (None:
        ``0 ..``)). ``images``: HF's keyword arguments of the image tokens in ``tokens``
        (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``): image embeddings at
        the placeholders and M-RoPE positions ``[3, 1, L + k]``."""
        import torch

        ids = torch.tensor([tokens])
        if images is None:
            return ids, self.hf.model(ids).last_hidden_state, None, None
        m = self.hf.model
        emb = m.get_input_embeddings()(ids)
        feats = m.get_image_features(images["pixel_values"], images["image_grid_thw"],
                                     return_dict=True).pooler_output
        emb[ids == self.hf.config.image_token_id] = torch.cat(feats, dim=0).to(emb.dtype)
        hidden = m(input_ids=ids, **images).last_hidden_state
        types = images["mm_token_type_ids"]
        pos, _ = m.get_rope_index(torch.cat([ids, torch.zeros((1, k), dtype=ids.dtype)], 1),
                                  torch.cat([types, torch.zeros((1, k), dtype=types.dtype)], 1),
                                  images["image_grid_thw"])
        return ids, hidden, emb[:, 1:], pos[-3:]

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits of the token two ahead at positions ``0 .. L-2``."""
        import torch

        with torch.no_grad():
            ids, hidden, _, _ = self._context(tokens, None)
            return self.hf.lm_head(self._head(ids[:, 1:], hidden[:, :-1]))[0].numpy()

    def keys(self, tokens: list[int], images: dict | None = None) -> np.ndarray:
        """The head's keys (normed, rotated) at positions ``0 .. L-2``: ``[Hkv, L-1, D]``."""
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        n, attn = self.norms, self.layer.self_attn
        with torch.no_grad():
            ids, hidden, emb, pos = self._context(tokens, images)
            L = ids.shape[1] - 1
            e = self._text.embed_tokens(ids[:, 1:]) if emb is None else emb
            x = self.fc(torch.cat([n["pre_fc_norm_embedding"](e),
                                   n["pre_fc_norm_hidden"](hidden[:, :-1])], dim=-1))
            h = self.layer.input_layernorm(x)
            k = attn.k_norm(attn.k_proj(h).view(1, L, -1, attn.head_dim)).transpose(1, 2)
            cos, sin = self._text.rotary_emb(x, torch.arange(L)[None] if pos is None
                                             else pos[:, :, :L])
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            return k[0].numpy()

    def drafts(self, tokens: list[int], k: int, images: dict | None = None) -> list[int]:
        """What the head proposes after ``tokens``: draft 1 from the last token's predecessor,
        then ``k - 1`` steps on its own hidden state and draft, one position on each.
        ``images``: as :meth:`_context`."""
        import torch

        out = []
        with torch.no_grad():
            ids, hidden, emb, pos = self._context(tokens, images, k)
            hidden, nxt = hidden[:, :-1], ids[:, 1:]
            for _ in range(k):
                n = nxt.shape[1]
                h = self._head(nxt, hidden, emb, None if pos is None else pos[:, :, :n])
                h = h[:, -1:]
                d = int(self.hf.lm_head(h)[0, 0].argmax())
                out.append(d)
                nxt = torch.cat([nxt, torch.tensor([[d]])], dim=1)
                hidden = torch.cat([hidden, h], dim=1)
                if emb is not None:
                    emb = torch.cat([emb, self._text.embed_tokens(torch.tensor([[d]]))], dim=1)
        return out

    def distill(self, steps: int = 60, num_seqs: int = 32, prompt_len: int = 8,
                new_tokens: int = 40, lr: float = 3e-3, seed: int = 0) -> None:
        """Train the head (the target frozen) to guess the target's own greedy token two
        ahead, on greedy continuations of random prompts: a random head is never right, and
        acceptance figures need one that sometimes is."""
        import torch

        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            prompts = torch.tensor(rng.integers(5, self.hf.config.vocab_size, (num_seqs,
                                                                               prompt_len)))
            seqs = self.hf.generate(prompts, max_new_tokens=new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
            hidden = self.hf.model(seqs).last_hidden_state
        params = [*self.fc.parameters(), *self.layer.parameters(),
                  *(p for n in self.norms.values() for p in n.parameters())]
        opt = torch.optim.Adam(params, lr=lr)
        for _ in range(steps):
            logits = self.hf.lm_head(self._head(seqs[:, 1:-1], hidden[:, :-2]))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     seqs[:, 2:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()

    def save(self, path) -> None:
        """Write the head's weights back into the checkpoint's ``mtp.*`` tensors."""
        from safetensors.numpy import load_file, save_file

        f = Path(path) / "model.safetensors"
        tensors = load_file(str(f))
        mods = {"fc.": self.fc, "layers.0.": self.layer,
                **{f"{k}.": v for k, v in self.norms.items()}}
        for prefix, mod in mods.items():
            for name, p in mod.state_dict().items():
                tensors[f"mtp.{prefix}{name}"] = p.detach().numpy().astype(np.float32)
        save_file(tensors, str(f), metadata={"format": "pt"})

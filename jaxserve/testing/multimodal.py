"""Helpers of the multimodal tests and benchmarks: test images (and their data URLs), Qwen's
prompt pieces, and HF ``generate`` on a tiny Qwen 3.5 VLM with the same image processor as the
reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PROMPT_HEAD = "<|im_start|>user\n"
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_image(w: int, h: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3),
                                                                dtype=np.uint8))


class HFReference:
    """HF ``generate`` on the checkpoint, images through the same image processor."""

    def __init__(self, path: Path):
        import torch
        import transformers as tf

        from jaxserve.multimodal.processor import ImageProcessor

        self.torch = torch
        [arch] = json.loads((path / "config.json").read_text())["architectures"]
        self.model = getattr(tf, arch).from_pretrained(path, dtype=torch.float32).eval()
        self.tok = tf.AutoTokenizer.from_pretrained(path)
        self.proc = ImageProcessor(path)
        self.image_id = json.loads((path / "config.json").read_text())["image_token_id"]

    def ids(self, prompt: str, images) -> list[int]:
        from jaxserve.multimodal.processor import expand_placeholders

        return expand_placeholders(self.tok.encode(prompt), self.image_id,
                                   self.proc.process(images))

    def greedy(self, prompt: str, images, n: int) -> list[int]:
        return self.greedy_ids(self.tok.encode(prompt), images, n)

    def chat_ids(self, messages) -> list[int]:
        """The prompt ids the server renders for ``messages`` (image parts as the template's
        ``{"type": "image"}``), before placeholder expansion."""
        from jaxserve.engine.tokenizer import apply_chat_template

        rendered = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                     else [{"type": "image"} if p["type"] in ("image_url", "image_pil") else p
                           for p in m["content"]]} for m in messages]
        return list(apply_chat_template(self.tok, rendered, add_generation_prompt=True))

    def inputs(self, ids: list[int], images) -> tuple[list[int], dict]:
        """(``ids`` with each image's placeholders expanded, HF's image keyword arguments of
        them: ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``; {} without
        images)."""
        from jaxserve.multimodal.processor import expand_placeholders

        torch = self.torch
        processed = self.proc.process(images)
        ids = expand_placeholders(ids, self.image_id, processed)
        if not processed:
            return ids, {}
        return ids, dict(
            pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in processed])),
            image_grid_thw=torch.tensor([p.grid_thw for p in processed]),
            mm_token_type_ids=torch.tensor([[int(t == self.image_id) for t in ids]]))

    def greedy_ids(self, ids: list[int], images, n: int) -> list[int]:
        torch = self.torch
        ids, kw = self.inputs(ids, images)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, **kw)
        return out[0, len(ids):].tolist()


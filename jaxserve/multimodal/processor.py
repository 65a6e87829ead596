"""The checkpoint's own HF image processor, run in the front-end process.

A checkpoint names its processor class in ``preprocessor_config.json`` (or in the
``image_processor`` entry of ``processor_config.json``, transformers 5's layout)
(``image_processor_type``); the fast (torchvision) variants are swapped for transformers' PIL
backend of the same family (``Qwen2VLImageProcessorFast`` -> ``Qwen2VLImageProcessorPil``,
``Gemma4ImageProcessor`` -> ``Gemma4ImageProcessorPil``), so a machine without torchvision still
loads the checkpoint with the same settings. Each image becomes pixel rows, its patch grid, the
number of placeholder tokens it takes in the prompt and a content hash (the key of the
encoder-output and prefix caches).

Qwen's processor gives patch rows and ``image_grid_thw``; Gemma 4's pads every image to
``max_soft_tokens * k^2`` patches with ``image_position_ids`` (-1 = padding) and counts its soft
tokens: its real patches (row-major) are kept, as the grid ``(1, rows, cols)``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

# processor families served, by the class name's stem
_SUPPORTED = ("Qwen2VLImageProcessor", "Gemma4ImageProcessor")


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the encoder step (host arrays, msgspec-friendly by ``to_dict``)."""

    pixel_values: np.ndarray   # [P, C*Tp*ps*ps] float32, the processor's patch order
    grid_thw: tuple[int, int, int]
    num_tokens: int            # placeholder tokens in the prompt
    hash: str                  # sha256 of the pixels and grid: same picture, same hash


def image_processor_settings(model_dir) -> dict | None:
    """The image processor's saved settings, None when the checkpoint ships none."""
    path = Path(model_dir) / "preprocessor_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    path = Path(model_dir) / "processor_config.json"
    if path.is_file():
        nested = json.loads(path.read_text()).get("image_processor")
        if isinstance(nested, dict):
            return nested
    return None


def image_processor_class_name(model_dir) -> str:
    cfg = image_processor_settings(model_dir)
    if cfg is None:
        raise ValueError(f"{model_dir} has no preprocessor_config.json: the checkpoint ships no "
                         "image processor")
    name = cfg.get("image_processor_type") or ""
    for stem in _SUPPORTED:
        if name.startswith(stem):
            return stem + "Pil"
    raise ValueError(f"image_processor_type {name!r} is not supported (supported: "
                     f"{', '.join(s + '[Fast|Pil]' for s in _SUPPORTED)})")


class ImageProcessor:
    """``process(images) -> [ProcessedImage]`` with the checkpoint's settings, overridden by
    ``mm_processor_kwargs`` (vLLM's ``--mm-processor-kwargs``, e.g. ``max_pixels``)."""

    def __init__(self, model_dir, mm_processor_kwargs: dict | None = None):
        import transformers

        cls = getattr(transformers, image_processor_class_name(model_dir))
        cfg = image_processor_settings(model_dir)
        kwargs = dict(mm_processor_kwargs or {})
        size = dict(cfg.get("size") or {})
        # vLLM's names for Qwen's pixel bounds
        if "min_pixels" in kwargs:
            size["shortest_edge"] = int(kwargs.pop("min_pixels"))
        if "max_pixels" in kwargs:
            size["longest_edge"] = int(kwargs.pop("max_pixels"))
        allowed = set(getattr(cls, "valid_kwargs").__annotations__) | {"size"}
        for k in kwargs:
            if k not in allowed:
                raise ValueError(f"mm_processor_kwargs: {k!r} is not a setting of "
                                 f"{cls.__name__}")
        cfg = {k: v for k, v in cfg.items()
               if k not in ("image_processor_type", "processor_class")}
        cfg.update(kwargs)
        if size:
            cfg["size"] = size
        self.hf = cls(**cfg)
        self.family = "gemma4" if cls.__name__.startswith("Gemma4") else "qwen2vl"
        if self.family == "gemma4":
            k = int(self.hf.pooling_kernel_size)
            self.merge = k  # k x k patches pool into one soft token
            self.max_patches = int(self.hf.max_soft_tokens) * k * k
            return
        self.merge = int(getattr(self.hf, "merge_size", 2))
        hf_size = getattr(self.hf, "size", None) or {}
        lo, hi = hf_size.get("shortest_edge"), hf_size.get("longest_edge")
        if lo is not None and hi is not None and int(lo) > int(hi):
            raise ValueError(f"image processor: min_pixels (size.shortest_edge {lo}) exceeds "
                             f"max_pixels (size.longest_edge {hi})")
        patch = int(getattr(self.hf, "patch_size", 14))
        # the most patches an image becomes: the encoder's largest bucket
        self.max_patches = max(int(hi or 0) // (patch * patch), self.merge * self.merge)

    def process(self, images) -> list[ProcessedImage]:
        if not images:
            return []
        out = self.hf(images=list(images), return_tensors="np")
        if self.family == "gemma4":
            return self._gemma4(out)
        pixels = np.asarray(out["pixel_values"], np.float32)
        grids = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])]
        result, start = [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            px = np.ascontiguousarray(pixels[start:start + n])
            start += n
            h = hashlib.sha256(np.asarray(g, np.int64).tobytes() + px.tobytes()).hexdigest()
            result.append(ProcessedImage(px, g, n // (self.merge * self.merge), h))
        return result

    def _gemma4(self, out) -> list[ProcessedImage]:
        result = []
        counts = np.asarray(out["num_soft_tokens_per_image"]).reshape(-1)
        for px, pos, n_tok in zip(np.asarray(out["pixel_values"], np.float32),
                                  np.asarray(out["image_position_ids"]), counts):
            real = np.all(pos != -1, axis=-1)
            n = int(real.sum())
            cols, rows = int(pos[real, 0].max()) + 1, int(pos[real, 1].max()) + 1
            if rows * cols != n or not real[:n].all():
                raise ValueError(f"image positions are not a {rows}x{cols} grid")
            px = np.ascontiguousarray(px[:n])
            g = (1, rows, cols)
            h = hashlib.sha256(np.asarray(g, np.int64).tobytes() + px.tobytes()).hexdigest()
            result.append(ProcessedImage(px, g, int(n_tok), h))
        return result


def expand_placeholders(token_ids: list[int], image_token_id: int,
                        images: list[ProcessedImage], begin: int | None = None,
                        end: int | None = None) -> list[int]:
    """Each run of ``image_token_id`` (one per image, in order, as the chat template writes
    them) becomes the image's ``num_tokens`` placeholders, between ``begin`` and ``end`` where
    given (Gemma 4's processor writes begin-of-image, the soft tokens, end-of-image)."""
    out: list[int] = []
    i, k = 0, 0
    while i < len(token_ids):
        if token_ids[i] != image_token_id:
            out.append(token_ids[i])
            i += 1
            continue
        while i < len(token_ids) and token_ids[i] == image_token_id:
            i += 1
        if k >= len(images):
            raise ValueError(f"the prompt has more image placeholders than the {len(images)} "
                             "image(s) given")
        out.extend(([] if begin is None else [begin]) + [image_token_id] * images[k].num_tokens
                   + ([] if end is None else [end]))
        k += 1
    if k != len(images):
        raise ValueError(f"{len(images)} image(s) given but the prompt has {k} image "
                         "placeholder(s)")
    return out

"""A request's images as the engine core sees them: already processed in the front end (pixel
rows, patch grid, where its placeholder run sits in the prompt, a content hash), so the core
never decodes an image. Host only (no jax); msgspec, so it travels in ``NewRequestData`` and
over the core client's socket as is.
"""
from __future__ import annotations

import msgspec
import numpy as np


class ImageItem(msgspec.Struct, array_like=True, gc=False):
    hash: str  # sha256 of pixels and grid: the encoder-output and prefix-cache key
    offset: int  # index of its first placeholder token in the prompt
    num_tokens: int  # placeholder tokens (= encoder output rows)
    grid_thw: tuple[int, int, int]  # patch grid before merging
    pixels: bytes  # float32 rows [t*h*w, patch_dim], the processor's patch order
    patch_dim: int

    def pixel_array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, np.float32).reshape(-1, self.patch_dim)


class MultiModalInputs(msgspec.Struct, array_like=True, gc=False):
    images: list[ImageItem]
    image_token_id: int

    def page_keys(self, lo: int, hi: int) -> tuple[str, ...]:
        """Hashes of the images whose placeholders overlap prompt positions ``[lo, hi)``: a
        page's prefix-cache key carries them, so the same text with another picture misses."""
        return tuple(im.hash for im in self.images
                     if im.offset < hi and im.offset + im.num_tokens > lo)

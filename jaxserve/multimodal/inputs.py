"""A prompt's ``multi_modal_data`` into what the engine core takes: the checkpoint's image
processor runs here (the front end), each image's placeholder run is expanded to its token
count, and the images travel as ``core.mm_inputs.MultiModalInputs``.

Processed images are cached by content (the encoded pixels' hash) unless
``--disable-mm-preprocessor-cache``: a picture sent again skips resizing and normalising.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from jaxserve.config import MultiModalConfig
from jaxserve.core.mm_inputs import ImageItem, MultiModalInputs
from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal.processor import (
    ImageProcessor,
    ProcessedImage,
    expand_placeholders,
    image_processor_settings,
)

CACHE_ITEMS = 256


def model_takes_images(hf_config: dict) -> bool:
    return bool(hf_config.get("vision_config")) and "image_token_id" in hf_config


class MultiModalInputProcessor:
    """Images of one model (None from :meth:`for_model` for a text-only one)."""

    def __init__(self, model_dir, hf_config: dict, config: MultiModalConfig,
                 max_num_batched_tokens: int | None = None):
        self.config = config
        self.image_token_id = int(hf_config["image_token_id"])
        self.processor = ImageProcessor(model_dir, config.mm_processor_kwargs)
        # Gemma 4: begin- and end-of-image tokens around each image's soft tokens
        self.wrap = ((int(hf_config["boi_token_id"]), int(hf_config["eoi_token_id"]))
                     if self.processor.family == "gemma4" else (None, None))
        # an image whose tokens see each other both ways runs in one step (the scheduler
        # never splits it), so it must fit the step's token budget
        self.max_run = (max_num_batched_tokens
                        if hf_config.get("use_bidirectional_attention") == "vision" else None)
        self._cache: OrderedDict[str, ProcessedImage] | None = (
            None if config.disable_mm_preprocessor_cache else OrderedDict())

    @classmethod
    def for_model(cls, model_dir, hf_config: dict, config: MultiModalConfig,
                  max_num_batched_tokens: int | None = None):
        if model_dir is None or not model_takes_images(hf_config):
            return None
        if image_processor_settings(model_dir) is None:
            return None
        return cls(model_dir, hf_config, config, max_num_batched_tokens)

    def process(self, token_ids: list[int], data, where: str = "multi_modal_data"
                ) -> tuple[list[int], MultiModalInputs | None]:
        """(expanded prompt ids, the images) of a prompt and its ``multi_modal_data``."""
        images = _images_of(data, where)
        limit = self.config.limit("image")
        if len(images) > limit:
            raise InvalidRequestError(f"{where}.image: {len(images)} images, more than the "
                                      f"limit of {limit} per prompt (--limit-mm-per-prompt)",
                                      param=f"{where}.image")
        if not images:
            if self.image_token_id in token_ids:
                raise InvalidRequestError("the prompt has image placeholders but no image was "
                                          "given", param=where)
            return token_ids, None
        processed = [self._process_one(im, f"{where}.image[{i}]")
                     for i, im in enumerate(images)]
        for i, p in enumerate(processed):
            if self.max_run is not None and p.num_tokens > self.max_run:
                raise InvalidRequestError(
                    f"{where}.image[{i}]: the image becomes {p.num_tokens} tokens that attend "
                    "to each other (use_bidirectional_attention='vision') and so run in one "
                    f"step, more than --max-num-batched-tokens ({self.max_run})",
                    param=f"{where}.image[{i}]")
        try:
            ids = expand_placeholders(token_ids, self.image_token_id, processed, *self.wrap)
        except ValueError as e:
            raise InvalidRequestError(str(e), param=f"{where}.image") from None
        items, k = [], 0
        for i, t in enumerate(ids):
            if t == self.image_token_id and (i == 0 or ids[i - 1] != t):
                p = processed[k]
                items.append(ImageItem(p.hash, i, p.num_tokens, p.grid_thw,
                                       p.pixel_values.tobytes(), p.pixel_values.shape[1]))
                k += 1
        return ids, MultiModalInputs(items, self.image_token_id)

    def _process_one(self, image, where: str) -> ProcessedImage:
        key = None
        if self._cache is not None:
            key = hashlib.sha256(f"{image.mode}{image.size}".encode()
                                 + image.tobytes()).hexdigest()
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            out = self.processor.process([image.convert("RGB")])[0]
        except Exception as e:  # noqa: BLE001 - the processor's refusal of this image
            raise InvalidRequestError(f"{where}: the image processor refused it ({e})",
                                      param=where) from None
        n = int(np.prod(out.grid_thw))
        if n > self.processor.max_patches:  # the processor's own bounds did not hold
            raise InvalidRequestError(f"{where}: the image becomes {n} patches, more than the "
                                      f"{self.processor.max_patches} the encoder takes",
                                      param=where)
        if self._cache is not None:
            self._cache[key] = out
            if len(self._cache) > CACHE_ITEMS:
                self._cache.popitem(last=False)
        return out


def _images_of(data, where: str) -> list:
    from PIL import Image

    if data is None:
        return []
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{where} must be a dict such as {{'image': image}}",
                                  param=where)
    for k in data:
        if k != "image":
            raise InvalidRequestError(f"{where}.{k}: only images are supported (video and "
                                      "audio are not)", param=f"{where}.{k}")
    images = data.get("image")
    if images is None:
        return []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for i, im in enumerate(images):
        if not isinstance(im, Image.Image):
            raise InvalidRequestError(f"{where}.image[{i}] must be a PIL image, got "
                                      f"{type(im).__name__}", param=f"{where}.image[{i}]")
    return images


def text_only_error(where: str = "multi_modal_data") -> InvalidRequestError:
    return InvalidRequestError(f"{where}: this model takes no images here (a text-only model, "
                               "a vision tower jaxserve does not run yet, or "
                               "--limit-mm-per-prompt image 0)", param=where)


def chat_images(messages: list[dict], allowed_local_media_path: str | None = None,
                allowed_media_domains: tuple[str, ...] = ()) -> tuple[list[dict], list]:
    """A conversation's image parts (vLLM's ``image_url`` and ``image_pil``) loaded, in order,
    and the messages with each one as the template's ``{"type": "image"}``."""
    from jaxserve.multimodal.media import load_image_url

    rendered, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            rendered.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "image_url":
                url = (part.get("image_url") or {}).get("url")
                images.append(load_image_url(
                    url, where, allowed_local_media_path=allowed_local_media_path,
                    allowed_media_domains=allowed_media_domains))
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(_images_of({"image": part.get("image_pil")}, where)[0])
                parts.append({"type": "image"})
            elif kind in ("video_url", "input_audio", "audio_url"):
                raise InvalidRequestError(f"{where}: content part type {kind!r} is not "
                                          "supported (text and images are)", param=where)
            else:
                parts.append(part)
        rendered.append({**m, "content": parts})
    return rendered, images

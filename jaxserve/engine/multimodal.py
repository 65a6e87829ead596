"""Images in the engine: the front end's processor (``multimodal.inputs``) and the runner's
encoder step (``worker.mm_step``) for a vision-language checkpoint, and how a prompt carries
its images (vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}``)."""
from __future__ import annotations

from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal.inputs import MultiModalInputProcessor, text_only_error

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


def input_processor(engine) -> MultiModalInputProcessor | None:
    """The image input processor of the engine's model (None: text-only, or images off with
    ``--limit-mm-per-prompt '{"image": 0}'``, or a vision tower jaxserve does not run yet)."""
    if engine.model.visual is None or engine.config.multimodal.limit(
            "image") == 0:
        return None
    return MultiModalInputProcessor.for_model(
        engine.model_dir, engine.model_config.hf, engine.config.multimodal,
        max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens)


def attach_encoder(engine, processor: MultiModalInputProcessor | None) -> None:
    """Give the runner its encoder step (before warm-up) when the model takes images."""
    if processor is None or engine.model.visual is None:
        return
    if engine.config.parallel.num_hosts > 1:
        # not yet: the cross-host hand-offs carry no image inputs: images stay off (a 400
        # naming the part), text is served
        engine.mm_processor = None
        return
    from jaxserve.worker.mm_step import EncoderRunner

    engine.runner.mm = EncoderRunner(engine.runner,
                                     max_image_patches=processor.processor.max_patches,
                                     dtype=engine.dtype)
    # tokens of one image that see each other run in one step: the scheduler never splits them
    engine.scheduler.whole_image_runs = engine.runner.mm.bidirectional


def split_prompt(prompt):
    """(the prompt without its images, its ``multi_modal_data`` or None)."""
    if not isinstance(prompt, dict):
        return prompt, None
    for k in prompt:
        if k not in PROMPT_KEYS:
            raise InvalidRequestError(f"prompt.{k} is not supported (keys: "
                                      f"{', '.join(PROMPT_KEYS)})", param=f"prompt.{k}")
    data = prompt.get("multi_modal_data")
    if "prompt_token_ids" in prompt:
        return {k: prompt[k] for k in ("prompt", "prompt_token_ids") if k in prompt}, data
    if "prompt" not in prompt:
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                  param="prompt")
    return prompt["prompt"], data


__all__ = ["input_processor", "attach_encoder", "split_prompt", "text_only_error"]

"""The encoder step and the encoder-output cache of a vision-language model's runner.

Before a step whose rows reach image placeholders, each image not in the cache runs through
the vision tower (images of every request batched into one call per patch bucket; a bucket is
a power of two of patches, compiled at start-up, so serving never compiles). Outputs land in
one device buffer ``[C + 1, H]`` (row ``C`` is the trash row padding writes to), rows handed
out per image hash and evicted least recently used; a preempted request, a chunk that splits
an image's run, or another request with the same picture reads them there, never re-encodes.

The step's model inputs then say, per token, which buffer row replaces its embedding
(``mm_rows[T]``, -1 for text) and, for Qwen, its M-RoPE positions ``[3, T]`` (a request's
prompt table, ``index + delta`` past it; text-only rows and padding have all three rows equal
to the position; Gemma 4 keeps its text positions ``[T]``), and for a checkpoint whose image
tokens see each other both ways (Gemma 4's ``use_bidirectional_attention="vision"``) each
token's last visible position ``kv_limit[T]`` (its image's last placeholder; -1, causal, for
text and padding), which the scheduler keeps inside the step. Every step of such a runner
carries these arrays (off values when no image is in the step), so the forward has one trace
per token bucket.

The families differ in the tower's input only (:class:`_QwenTower`, :class:`_Gemma4Tower`):
Qwen packs images as patch rows merged 2x2 into tokens; Gemma 4 packs them too, attention kept
within each image and k x k patches pooled into a soft token.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.core.batch_diff import BatchDiff
from jaxserve.core.mm_inputs import MultiModalInputs
from jaxserve.models import gemma4_vision, qwen3_5_vision
from jaxserve.multimodal.mrope import mrope_positions
from jaxserve.worker.step_inputs import StepImages

logger = logging.getLogger(__name__)

MIN_PATCH_BUCKET = 64


def _encode_fn(graphdef, treedef, counter):
    def encode(state_leaves, buf, inp, write_rows):
        counter[0] += 1
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, state_leaves))
        emb = model.encode_images(inp)
        return buf.at[write_rows].set(emb.astype(buf.dtype))

    return jax.jit(encode, donate_argnums=(1,))


def patch_ladder(max_patches: int, unit: int) -> list[int]:
    """Patch buckets: a power of two of tokens (``unit`` patches each) from
    ``MIN_PATCH_BUCKET`` patches up, and the largest image's."""
    top = -(-max_patches // unit) * unit
    ladder, b = [], max(1, MIN_PATCH_BUCKET // unit)
    while b * unit < top:
        ladder.append(b * unit)
        b *= 2
    return ladder + [top] if not ladder or ladder[-1] != top else ladder


class _QwenTower:
    """Qwen 3.5's ViT: merged patch rows, M-RoPE positions for the text model."""

    mrope = True

    def __init__(self, hf: dict):
        self.cfg = qwen3_5_vision.vision_config(hf)
        self.merge = int(self.cfg["spatial_merge_size"])
        self.unit = self.merge * self.merge
        c = self.cfg
        self.patch_dim = int(c["in_channels"]) * int(c["temporal_patch_size"]) * int(
            c["patch_size"]) ** 2

    def warmup_grid(self, bucket: int):
        side = int(np.sqrt(self.unit))
        return (1, side, bucket // side)

    def inputs(self, pixels: list[np.ndarray], grids, bucket: int):
        return qwen3_5_vision.vision_inputs(np.concatenate(pixels), grids, cfg=self.cfg,
                                            num_patches=bucket)


class _Gemma4Tower:
    """Gemma 4's encoder: images packed, k x k pooling; text positions unchanged."""

    mrope = False

    def __init__(self, hf: dict):
        self.cfg = gemma4_vision.vision_config(hf)
        self.merge = int(self.cfg["pooling_kernel_size"])
        self.unit = self.merge * self.merge
        self.patch_dim = 3 * int(self.cfg["patch_size"]) ** 2

    def warmup_grid(self, bucket: int):
        return (1, self.merge, bucket // self.merge)

    def inputs(self, pixels: list[np.ndarray], grids, bucket: int):
        return gemma4_vision.packed_inputs(pixels, grids, k=self.merge, num_patches=bucket)


def bidirectional_images(hf: dict) -> bool:
    """Whether an image's placeholder tokens attend to each other both ways (HF Gemma 4's
    ``text_config.use_bidirectional_attention == "vision"``)."""
    return hf.get("use_bidirectional_attention") == "vision"


def tower_of(hf: dict):
    kind = (hf.get("vision_config") or {}).get("model_type")
    return _Gemma4Tower(hf) if kind == "gemma4_vision" else _QwenTower(hf)


class _Req:
    __slots__ = ("mm", "mrope", "delta")

    def __init__(self, mm: MultiModalInputs, prompt_ids: list[int], merge: int | None):
        self.mm = mm
        self.mrope, self.delta = (None, 0) if merge is None else mrope_positions(
            prompt_ids, mm.image_token_id, [im.grid_thw for im in mm.images], merge)


class EncoderRunner:
    """Vision-tower steps of one runner (``runner.mm``)."""

    def __init__(self, runner, *, max_image_patches: int, dtype, warmup: bool = True):
        self.runner = runner
        self.tower = tower_of(runner.model_config.hf)
        self.merge, self.unit = self.tower.merge, self.tower.unit
        self.ladder = patch_ladder(max_image_patches, self.unit)
        self.bidirectional = bidirectional_images(runner.model_config.hf)
        # the MTP head embeds the token after each row's chunk, an image token at times
        spec = runner.config.speculative
        self.with_next_rows = spec is not None and spec.method == "mtp"
        max_tokens = self.ladder[-1] // self.unit
        sched = runner.config.scheduler
        self.capacity = 2 * max(sched.max_num_batched_tokens, max_tokens)
        hidden = runner.model_config.hidden_size
        # the tower runs where the embeddings are merged: the model, or pipeline stage 0
        stages = runner.stages
        if stages is None:
            graphdef, treedef = runner.graphdef, jax.tree_util.tree_structure(runner.state)
            mesh = runner.mesh
        else:
            (graphdef, treedef), mesh = stages.stage_defs[0], stages.stage_meshes[0]
        # placed (committed) from the start, as every encoder output is: one trace per bucket
        self.buf = jax.device_put(jnp.zeros((self.capacity + 1, hidden), dtype),
                                  sharding.replicated(mesh or sharding.default_mesh()))
        self._compiles = [0]
        self._encode = _encode_fn(graphdef, treedef, self._compiles)
        self.entries: OrderedDict[str, tuple[int, int]] = OrderedDict()  # hash -> (row, n)
        self.reqs: dict[str, _Req] = {}
        self.num_encoded = 0  # images run through the tower (cache misses)
        self._off_rows: dict[int, np.ndarray] = {}  # [T] -1 of each token bucket
        if warmup and not runner.config.enforce_eager:
            self.warmup()

    def _tower_leaves(self) -> list:
        """The params the tower reads (under pipeline parallelism: stage 0's, which hold it)."""
        r = self.runner
        return r._state_leaves if r.stages is None else r.stages.stage_leaves[0]

    @property
    def num_compiles(self) -> int:
        return self._compiles[0]

    def warmup(self) -> None:
        """Compile every patch bucket (writes go to the trash row)."""
        for b in self.ladder:
            inp = self.tower.inputs([np.zeros((b, self.tower.patch_dim), np.float32)],
                                    [self.tower.warmup_grid(b)], b)
            self.buf = self._encode(self._tower_leaves(), self.buf, inp,
                                    np.full(b // self.unit, self.capacity, np.int32))
        jax.block_until_ready(self.buf)
        logger.info("vision encoder: %d patch buckets compiled (%s)", len(self.ladder),
                    self.ladder)

    # ---- the persistent batch's rows --------------------------------------------------
    def apply(self, diff: BatchDiff) -> None:
        for rid in diff.removed:
            self.reqs.pop(rid, None)
        for new in diff.new_reqs:
            if new.mm is not None:
                self.reqs[new.req_id] = _Req(new.mm, new.token_ids[:new.num_prompt_tokens],
                                             self.merge if self.tower.mrope else None)

    # ---- a step's inputs ---------------------------------------------------------------
    def off_arrays(self, positions: np.ndarray, num_seqs: int) -> StepImages:
        """The :class:`StepImages` of a step without images (``positions[T]``, ``num_seqs``
        rows)."""
        t = positions.shape[0]
        rows = self._off_rows.get(t)
        if rows is None:
            rows = self._off_rows[t] = np.full(t, -1, np.int32)
        pos = (np.broadcast_to(positions, (3, t)).astype(np.int32) if self.tower.mrope
               else positions)
        return StepImages(pos, rows, self.buf, rows if self.bidirectional else None,
                          np.full(num_seqs, -1, np.int32) if self.with_next_rows else None)

    def prepare(self, diff: BatchDiff, positions: np.ndarray, num_seqs: int) -> StepImages:
        """The step's :class:`StepImages` for the plan's ``positions[T]`` and ``num_seqs``
        rows, encoding what the step's image tokens need first (and, for the MTP head, the
        image token after a row's chunk)."""
        t = positions.shape[0]
        mrope = np.broadcast_to(positions, (3, t)).copy() if self.tower.mrope else positions
        rows = np.full(t, -1, np.int32)
        limit = np.full(t, -1, np.int32) if self.bidirectional else None
        next_rows = np.full(num_seqs, -1, np.int32) if self.with_next_rows else None
        q0 = 0
        needs = []  # (token slice in the step, image, first index in the image)
        nexts = []  # (row, image, index in the image) of a chunk's next prompt token
        for i, (rid, n, start) in enumerate(zip(diff.req_ids, diff.num_tokens,
                                                diff.start_pos)):
            r = self.reqs.get(rid)
            if r is not None:
                if r.mrope is not None:
                    p = np.arange(start, start + n)
                    L = r.mrope.shape[1]
                    inside = p < L
                    mrope[:, q0:q0 + n] = np.where(inside[None],
                                                   r.mrope[:, np.minimum(p, L - 1)],
                                                   p[None] + r.delta)
                for im in r.mm.images:
                    lo, hi = max(start, im.offset), min(start + n, im.offset + im.num_tokens)
                    if lo < hi:
                        needs.append((q0 + lo - start, q0 + hi - start, im, lo - im.offset))
                    if next_rows is not None and 0 <= start + n - im.offset < im.num_tokens:
                        nexts.append((i, im, start + n - im.offset))
            q0 += n
        if needs or nexts:
            images = [im for *_, im, _ in needs] + [im for _, im, _ in nexts]
            self._encode_missing(images, {im.hash for im in images})
        for a, b, im, first in needs:
            row, _ = self.entries[im.hash]
            self.entries.move_to_end(im.hash)
            rows[a:b] = row + first + np.arange(b - a)
            if limit is not None:
                limit[a:b] = im.offset + im.num_tokens - 1
        for i, im, index in nexts:
            next_rows[i] = self.entries[im.hash][0] + index
        return StepImages(mrope, rows, self.buf, limit, next_rows)

    def _encode_missing(self, images, pinned: set) -> None:
        todo, seen = [], set()
        for im in images:
            if im.hash not in self.entries and im.hash not in seen:
                seen.add(im.hash)
                todo.append(im)
        top = self.ladder[-1]
        batch, size = [], 0
        for im in todo:
            n = int(np.prod(im.grid_thw))
            if n > top:
                raise ValueError(f"an image of {n} patches exceeds the encoder's largest bucket "
                                 f"({top})")
            if size + n > top:
                self._run(batch, pinned)
                batch, size = [], 0
            batch.append(im)
            size += n
        if batch:
            self._run(batch, pinned)

    def _run(self, images, pinned: set) -> None:
        total = sum(int(np.prod(im.grid_thw)) for im in images)
        bucket = next(b for b in self.ladder if b >= total)
        write = np.full(bucket // self.unit, self.capacity, np.int32)
        k = 0
        for im in images:
            row = self._allocate(im.num_tokens, pinned)
            self.entries[im.hash] = (row, im.num_tokens)
            write[k:k + im.num_tokens] = row + np.arange(im.num_tokens)
            k += im.num_tokens
        inp = self.tower.inputs([im.pixel_array() for im in images],
                                [im.grid_thw for im in images], bucket)
        before = self._compiles[0]
        self.buf = self._encode(self._tower_leaves(), self.buf, inp, write)
        if self._compiles[0] != before:
            self.runner._add_compiles(self._compiles[0] - before)
        self.num_encoded += len(images)

    def _allocate(self, n: int, pinned: set) -> int:
        """First free run of ``n`` rows, evicting least recently used unpinned images."""
        while True:
            used = sorted(self.entries.values())
            at = 0
            for row, m in used:
                if row - at >= n:
                    return at
                at = max(at, row + m)
            if self.capacity - at >= n:
                return at
            victim = next((h for h in self.entries if h not in pinned), None)
            if victim is None:
                raise ValueError(f"the encoder cache ({self.capacity} rows) cannot hold this "
                                 "step's images")
            del self.entries[victim]

"""Qwen's multimodal rotary positions (M-RoPE) for a prompt, as HF's ``get_rope_index``.

Text tokens advance all three rows (temporal, height, width) together; an image's merged
``(t, h, w)`` grid of placeholder tokens takes ``start + (t, row, col)`` and the text after it
resumes at ``start + max(h, w)``. A generated token at index ``i`` is at ``i + delta`` in every
row, ``delta`` being the prompt's last position + 1 minus its length.
"""
from __future__ import annotations

import numpy as np


def mrope_positions(token_ids, image_token_id: int, grids, merge: int = 2
                    ) -> tuple[np.ndarray, int]:
    """Positions ``[3, L]`` (int32) of a prompt whose image placeholder runs, in order, have
    patch grids ``grids`` [(t, h, w)], and the delta of the tokens after it."""
    ids = np.asarray(token_ids)
    out = np.zeros((3, len(ids)), np.int64)
    grids = list(grids)
    i, pos, img = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            j = i
            while j < len(ids) and ids[j] != image_token_id:
                j += 1
            out[:, i:j] = pos + np.arange(j - i)
            pos += j - i
            i = j
            continue
        if img >= len(grids):
            raise ValueError("the prompt has more image placeholder runs than images")
        t, h, w = (int(x) for x in grids[img])
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if ids[i:i + n].tolist() != [image_token_id] * n:
            raise ValueError(f"image {img}: expected {n} placeholder tokens")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, i:i + n] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(gh, gw)
        i += n
        img += 1
    if img != len(grids):
        raise ValueError(f"{len(grids)} images but {img} placeholder runs in the prompt")
    delta = int(out.max() + 1 - len(ids)) if len(ids) else 0
    return out.astype(np.int32), delta

"""MRoPE position ids (3 x L) for Qwen2-VL-style models, equal to the model's own get_rope_index.
Text runs advance all three axes together; an image or video run spans (t, h/merge, w/merge) on its own axes, its
temporal ids spaced by the run's interval (Qwen2.5-VL video), and the text after it starts max(h, w)/merge later.
"""

from __future__ import annotations

import numpy as np


def mrope_position_ids(
    length: int, image_runs: list[tuple[int, int]], grids: np.ndarray, merge_size: int, intervals: list | None = None
) -> np.ndarray:
    """image_runs: [start, end) token ranges of each image's (or video's) placeholder run, in order; grids: N x 3
    (t, h, w); intervals: the temporal step of each run (1, or a float32 as Qwen2.5-VL's time_interval)."""
    pos = np.empty((3, length), dtype=np.int64)
    cursor = 0  # next token index to fill
    next_pos = 0  # position id the next text token gets
    for k, ((start, end), (t, h, w)) in enumerate(zip(image_runs, grids)):
        n_text = start - cursor
        pos[:, cursor:start] = np.arange(next_pos, next_pos + n_text)
        gt, gh, gw = int(t), int(h) // merge_size, int(w) // merge_size
        assert end - start == gt * gh * gw, "image run length must equal its merged grid size"
        base = next_pos + n_text
        ti, hi, wi = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        step = 1 if intervals is None else intervals[k]
        if step != 1:  # float32 product truncated toward zero, as the model's (arange(t) * interval).long()
            ti = (ti.astype(np.float32) * np.float32(step)).astype(np.int64)
        pos[0, start:end] = ti.ravel() + base
        pos[1, start:end] = hi.ravel() + base
        pos[2, start:end] = wi.ravel() + base
        next_pos = base + max(gh, gw)
        cursor = end
    pos[:, cursor:] = np.arange(next_pos, next_pos + (length - cursor))
    return pos.astype(np.int32)

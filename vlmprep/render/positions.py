"""MRoPE position ids (3 x L) for Qwen2-VL-style models, equal to the model's own get_rope_index.
Text runs advance all three axes together; an image or video run spans (t, h/merge, w/merge) on its own axes, its
temporal ids spaced by the run's interval (Qwen2.5-VL video), and the text after it starts max(h, w)/merge later.
sample_position_ids finds a rendered sample's runs (sample.py) and gives its ids, MRoPE or 1-D by the family.
"""

from __future__ import annotations

import numpy as np

from vlmprep.families import FamilySpec
from vlmprep.types import RecordError


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
        ti = np.arange(base, base + gt)
        step = 1 if intervals is None else intervals[k]
        if step != 1:  # float32 product truncated toward zero, as the model's (arange(t) * interval).long()
            ti = (np.arange(gt, dtype=np.float32) * np.float32(step)).astype(np.int64) + base
        # meshgrid(arange(gt), arange(gh), arange(gw), "ij") + base, each axis broadcast (np.indices: 3x the cost)
        run = np.empty((3, gt, gh, gw), dtype=np.int64)
        run[0] = ti[:, None, None]
        run[1] = np.arange(base, base + gh)[None, :, None]
        run[2] = np.arange(base, base + gw)[None, None, :]
        pos[:, start:end] = run.reshape(3, -1)
        next_pos = base + max(gh, gw)
        cursor = end
    pos[:, cursor:] = np.arange(next_pos, next_pos + (length - cursor))
    return pos.astype(np.int32)


def sample_position_ids(
    family: FamilySpec, mm_types: np.ndarray, image_spans, video_spans, grids, video_grids, sgt, image_processor
) -> np.ndarray:
    """A rendered sample's 3 x L position ids (L = len(mm_types)): MRoPE over each image's and video's placeholder
    runs (spans: each expansion's [start, end) tokens; grids and video_grids: N x 3; sgt: seconds per temporal patch
    of each video; the image processor, for its merge_size) where the family's positions are mrope, else 0..L-1 on
    every row."""
    n = len(mm_types)
    if family.positions != "mrope":
        return np.broadcast_to(np.arange(n, dtype=np.int32), (3, n)).copy()
    runs = []
    for a, b in image_spans:
        run = mm_types[a:b].nonzero()[0]
        runs.append((a + int(run[0]), a + int(run[-1]) + 1, tuple(grids[len(runs)]), 1))
    for k, (a, b) in enumerate(video_spans):
        runs += _video_runs(family, a, mm_types[a:b], video_grids[k], sgt[k])
    return mrope_position_ids(
        n,
        [r[:2] for r in sorted(runs)],
        np.array([r[2] for r in sorted(runs)], dtype=np.int64).reshape(-1, 3),
        image_processor.merge_size,
        intervals=[r[3] for r in sorted(runs)],
    )


def _video_runs(family: FamilySpec, start: int, types: np.ndarray, grid, sgt) -> list[tuple]:
    """(start, end, grid, temporal interval) of each placeholder run of one video, as get_rope_index groups them:
    Qwen2/2.5-VL one run of t x h x w (2.5: temporal ids spaced tokens_per_second * second_per_grid_t); Qwen3-VL
    one run per temporal patch, split by its timestamp text."""
    idx = np.flatnonzero(types == 2)
    breaks = np.flatnonzero(np.diff(idx) > 1)
    bounds = list(zip(np.r_[idx[:1], idx[breaks + 1]], np.r_[idx[breaks], idx[-1:]] + 1))
    t, h, w = (int(x) for x in grid)
    if family.video == "qwen3":
        if len(bounds) != t:
            raise RecordError(
                "image_wrapper_missing", f"a video of {t} temporal patches expanded to {len(bounds)} runs"
            )
        return [(start + int(a), start + int(b), (1, h, w), 1) for a, b in bounds]
    if len(bounds) != 1:
        raise RecordError("image_wrapper_missing", f"a video expanded to {len(bounds)} placeholder runs, expected 1")
    interval = np.float32(family.tokens_per_second) * np.float32(sgt) if family.video == "qwen2.5" else 1
    return [(start + int(bounds[0][0]), start + int(bounds[0][1]), (t, h, w), interval)]

"""A sample as inspect shows it: a stored sample (its arrays and meta read now, its images and video frames decoded
only when a view shows them) or a rendered one (inspect's raw mode) -> InspectedSample, the one input of the views
(view.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from vlmprep.shards.manifest import ShardFormatError
from vlmprep.shards.reader import StoredSample


@dataclass
class InspectedVideo:
    """One video of a sample: its grid row, its source timing (meta) and its stored frames, decoded on demand."""

    grid_thw: tuple[int, int, int]
    fps: float  # the source's frame rate
    total_num_frames: int  # frames in the source
    frame_indices: list[int]  # source frame of each stored frame
    frames: list[Callable[[], np.ndarray]]  # per stored frame: uint8 HxWx3

    @property
    def timestamps(self) -> list[float]:
        """Seconds into the source of each stored frame."""
        return [i / self.fps for i in self.frame_indices]


@dataclass
class InspectedSample:
    """One sample as stored (dir mode) or as build would store it (raw mode); facts come from the arrays."""

    key: str  # 10-digit input position, as in the shard
    id: str
    source: tuple[str, int]  # file, line
    where: str  # shard name, or "rendered from input"
    input_ids: np.ndarray
    loss_mask: np.ndarray
    mm_token_type_ids: np.ndarray
    image_grid_thw: np.ndarray  # [N, 3]
    images: list[Callable[[], np.ndarray]]  # per occurrence: uint8 HxWx3, decoded only when a view needs it
    num_tokens_before_truncation: int
    truncated: bool
    dropped_images: int
    unrendered_tool_calls: int = 0
    warnings: list[str] = field(default_factory=list)
    split: int | None = None  # the sample's number when --long-traces split cut its record
    messages: list[int] = field(default_factory=list)  # input message indices the sample holds
    trains: list[int] = field(default_factory=list)  # input message indices it trains
    removed_images: list[int] = field(default_factory=list)  # input image occurrences --keep-images removed
    videos: list[InspectedVideo] = field(default_factory=list)
    dropped_videos: int = 0
    # [start, end) of each image's whole unit (wrappers, breaks, separators); None: a dataset that did not record
    # them, whose images show as their runs of tokens marked image
    image_spans: list[tuple[int, int]] | None = None


def image_token_count(sample: InspectedSample) -> int:
    """Tokens standing for image content: the images' spans summed (older datasets: the tokens marked image)."""
    if sample.image_spans is not None:
        return sum(b - a for a, b in sample.image_spans)
    return int((np.asarray(sample.mm_token_type_ids) == 1).sum())


def sample_from_rendered(s, key: str) -> InspectedSample:
    """A RenderedSample (inspect's raw mode) -> the InspectedSample the views show, under shard key `key`."""
    return InspectedSample(
        key=key,
        id=s.id,
        source=(s.source.file, s.source.line),
        where="rendered from input",
        input_ids=s.input_ids,
        loss_mask=s.loss_mask,
        mm_token_type_ids=s.mm_token_type_ids,
        image_grid_thw=np.asarray(s.image_grid_thw).reshape(-1, 3),
        images=[(lambda px=im.pixels: px) for im in s.images],
        num_tokens_before_truncation=s.num_tokens_before_truncation,
        truncated=s.truncated,
        dropped_images=s.dropped_images,
        unrendered_tool_calls=s.unrendered_tool_calls,
        split=s.split,
        messages=list(s.source_messages),
        trains=list(s.trains),
        removed_images=list(s.removed_images),
        videos=[
            InspectedVideo(
                grid_thw=tuple(int(x) for x in v.grid_thw),
                fps=float(v.fps),
                total_num_frames=int(v.total_num_frames),
                frame_indices=list(v.frame_indices),
                frames=[(lambda px=px: px) for px in v.frames],
            )
            for v in s.videos
        ],
        dropped_videos=s.dropped_videos,
        image_spans=[(int(a), int(b)) for a, b in s.image_spans],
    )


def sample_from_stored(s: StoredSample) -> InspectedSample:
    """A stored sample's arrays and meta, read now (the shard closes after selection); images decode on demand."""
    meta = s.meta()
    ids, mask, types = s.array("input_ids"), s.array("loss_mask"), s.array("mm_token_type_ids")
    if not (len(ids) == len(mask) == len(types)):
        raise ValueError(f"{s.where}: sample {s.key} has misaligned arrays ({ids.shape}, {mask.shape}, {types.shape})")
    grid = s.array("image_grid_thw").reshape(-1, 3)
    sizes = s.stored_sizes()  # every member's declared size checked against the meta before any is decoded
    blobs = {name: s.read(name) for name in dict.fromkeys(s.image_members())}
    loaders = [(lambda name=name: s.decode(name, sizes[name], blobs[name])) for name in s.image_members()]
    videos = _stored_videos(s, meta, sizes)
    src = meta.get("source") or {}
    sample = InspectedSample(
        key=s.key,
        id=str(meta.get("id")),
        source=(str(src.get("file")), int(src.get("line", 0))),
        where=s.where,
        input_ids=ids,
        loss_mask=mask,
        mm_token_type_ids=types,
        image_grid_thw=grid,
        images=loaders,
        num_tokens_before_truncation=int(meta.get("num_tokens_before_truncation", len(ids))),
        truncated=bool(meta.get("truncated", False)),
        dropped_images=int(meta.get("dropped_images", 0)),
        unrendered_tool_calls=int(meta.get("unrendered_tool_calls", 0)),
        split=meta.get("split"),
        messages=list(meta.get("messages", [])),
        trains=list(meta.get("trains", [])),
        removed_images=list(meta.get("removed_images", [])),
        videos=videos,
        dropped_videos=int(meta.get("dropped_videos", 0)),
        image_spans=_spans(meta, len(ids)),
    )
    # The view is computed from the arrays; a meta that disagrees with them is a corrupt dataset worth seeing.
    for k, v in (
        ("num_tokens", len(ids)),
        ("num_trainable_tokens", int(mask.sum())),
        ("num_image_tokens", image_token_count(sample)),
        ("num_images", len(grid)),
        ("num_video_tokens", int((types == 2).sum())),
        ("num_videos", len(videos)),
    ):
        if k in meta and meta[k] != v:
            sample.warnings.append(f"meta {k}={meta[k]} but the arrays give {v}")
    return sample


def _stored_videos(s: StoredSample, meta: dict, sizes: dict) -> list[InspectedVideo]:
    """Format v3: the meta's videos with their frame members (the reader checks them; read now, decoded on demand);
    grids from the array."""
    members = s.video_members()
    if not members:
        return []
    grid = s.array("video_grid_thw").reshape(-1, 3)
    out = []
    for k, (v, names) in enumerate(zip(meta["videos"], members)):
        try:
            fps, total, indices = float(v["fps"]), int(v["total_num_frames"]), [int(i) for i in v["frame_indices"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ShardFormatError(f"{s.where}: sample {s.key}: meta videos[{k}] is malformed ({e!r})") from None
        if fps <= 0 or len(indices) != len(names):
            raise ShardFormatError(
                f"{s.where}: sample {s.key}: meta videos[{k}] has fps {fps} and {len(indices)} "
                f"frame_indices for {len(names)} frames (fps must be > 0, one index per frame)"
            )
        blobs = {n: s.read(n) for n in names}
        out.append(
            InspectedVideo(
                grid_thw=tuple(int(x) for x in grid[k]),
                fps=fps,
                total_num_frames=total,
                frame_indices=indices,
                frames=[(lambda n=n, b=b: s.decode(n, sizes[n], b)) for n, b in blobs.items()],
            )
        )
    return out


def _spans(meta: dict, n: int) -> list[tuple[int, int]] | None:
    """The images' spans the meta records, where every image has one in order inside the n tokens (else None: the
    view falls back to the tokens marked image, and verify names the fault)."""
    spans = [im.get("span") for im in meta.get("images") or []]
    if not spans or any(not isinstance(sp, list) or len(sp) != 2 for sp in spans):
        return None
    end = 0
    for a, b in spans:
        if not (isinstance(a, int) and isinstance(b, int) and end <= a < b <= n):
            return None
        end = b
    return [(a, b) for a, b in spans]

"""Collate: DecodedSamples -> Batch, the first tensors. Vectorized: each field is one scatter into a right-padded
B x L layout in compact dtypes; labels (input_ids with IGNORE_INDEX where loss_mask == 0) and the attention mask
are made on the device.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from trainer.data.decode import DecodedSample
from trainer.data.errors import DataError
from trainer.data.vision import PLACEHOLDER_SIDE, HostPixels
from vlmprep_schemas.views import Packed

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    """On the host (what collate makes) the token fields are compact: int32 ids and positions, uint8 masks, a
    third of the bytes of int64 to fill and to copy to the device. `to(device)` widens them to the int64 the
    model takes; labels and attention_mask are derived from loss_mask and lengths where they are used."""

    input_ids: torch.Tensor  # int32 [B, L] on the host, int64 after to()
    loss_mask: torch.Tensor  # uint8 [B, L], 1 where the token is trained
    lengths: torch.Tensor  # int64 [B], real tokens per row (right padding), the placeholder image included
    position_ids: torch.Tensor  # int32/int64 [3, B, L], the stored MRoPE positions ([4, 1, N] when packed)
    mm_token_type_ids: torch.Tensor  # uint8/int64 [B, L]
    image_grid_thw: torch.Tensor  # int64 [N, 3], one row per occurrence, in token order
    images: list[torch.Tensor]  # unique uint8 H x W x 3 images; pixel math happens on the device
    image_index: list[int]  # occurrence -> images
    sample_ids: list[str]
    positions: list[int]  # stream positions of the samples, for resume checks
    num_tokens: int  # real tokens of real samples (no padding, no placeholder)
    num_trained: int  # tokens that carry a loss: labels[:, 1:] != IGNORE_INDEX
    video_grid_thw: torch.Tensor = torch.zeros(0, 3, dtype=torch.int64)  # int64 [V, 3], one row per video, token order
    second_per_grid_ts: torch.Tensor = torch.zeros(0)  # float32 [V]
    videos: list[list[torch.Tensor]] = ()  # per video its uint8 H x W x 3 frames; pixel math on the device
    vision: dict = field(default_factory=dict)  # families whose pixels the host makes: the model's pixel inputs
    filler: int = 0  # placeholder tokens at the end of row 0 (a micro-batch without images): not real tokens
    rows: int = 0  # packed rows laid end to end in this one flat row (trainer/data/pack.py); 0 = not packed
    sources: tuple[int, ...] = ()  # per sample: its dataset's index in a mixture
    sample_tokens: tuple[int, ...] = ()  # per sample: its tokens (where a packed row's segments end)
    image_rows: tuple[int, ...] = ()  # per image occurrence (token order): its row of input_ids

    @property
    def packed(self) -> bool:
        """True when rows hold several samples each: [4, 1, N] positions, row 0 restarting at 0 per sample, and no
        attention mask."""
        return self.position_ids.shape[0] == 4

    @property
    def num_samples(self) -> int:
        """How many samples the batch holds (packed rows count each sample)."""
        return len(self.sample_ids)

    @property
    def attention_mask(self) -> torch.Tensor:
        """int64 [B, L]: 1 on each row's real tokens, 0 on the padding after `lengths`."""
        L = self.input_ids.shape[1]
        return (torch.arange(L, device=self.lengths.device) < self.lengths[:, None]).long()

    @property
    def real(self) -> torch.Tensor:
        """bool [B, L]: the real tokens, neither padding nor a placeholder image (what a router's balance loss
        counts)."""
        L = self.input_ids.shape[1]
        real = torch.arange(L, device=self.lengths.device) < self.lengths[:, None]
        if self.filler:
            end = int(self.lengths[0])
            real[0, end - self.filler : end] = False
        return real

    @property
    def labels(self) -> torch.Tensor:
        """int64 [B, L] labels: the input id where loss_mask trains it, IGNORE_INDEX elsewhere (and on padding)."""
        return torch.where(self.loss_mask.bool(), self.input_ids.long(), IGNORE_INDEX)

    def to(self, device) -> "Batch":
        """This batch on `device`, the token fields widened to int64 there (copied compact, non-blocking); pixels and
        other float fields move as they are."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True).long()  # copy compact, widen on the device

        return replace(
            self,
            input_ids=move(self.input_ids),
            loss_mask=self.loss_mask.to(device, non_blocking=True),
            lengths=move(self.lengths),
            position_ids=move(self.position_ids),
            mm_token_type_ids=move(self.mm_token_type_ids),
            image_grid_thw=move(self.image_grid_thw),
            video_grid_thw=move(self.video_grid_thw),
            second_per_grid_ts=self.second_per_grid_ts.to(device, non_blocking=True),
            vision={k: v.to(device, non_blocking=True) for k, v in self.vision.items()},
        )


def keep_freed_buffers() -> None:
    """glibc hands freed multi-MB blocks back to the OS (mmap, heap trim), so each micro-batch's fresh B x L
    arrays page-fault their memory in again: about half of collate time. Keeping up to 256 MB of freed heap
    lets the next batch reuse it (1,024 samples: ~14 -> ~8 ms). No-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's 64-bit maximum
    libc.mallopt(m_trim_threshold, 256 << 20)


@dataclass(frozen=True)
class CollateSpec:
    """What collate needs from the model and processor: the pad id, the image (and video) placeholder ids, patch and
    merge size; `videos` when the run trains video, so every micro-batch runs the same vision passes on every rank."""

    pad_id: int
    image_token_id: int  # the model's image token (patchify families: the one mm_token_type_ids marks as image)
    patch_size: int
    merge_size: int
    video_token_id: int = -1
    videos: bool = False  # the run's data holds videos: every micro-batch runs the video pass (see collate)
    host: HostPixels | None = None  # families whose pixel inputs the host makes (trainer/data/vision.py)
    # The tokens a placeholder image adds (host families: the model's image token, as many as the processor expands
    # a small black image to; see vision.host_pixels) and the size it is stored at. Empty: one image_token_id (the
    # patchify families' 1 x 2 x 2 grid).
    placeholder: tuple[int, ...] = ()
    placeholder_size: tuple[int, int] = (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE)
    vocab_size: int = 0  # the model's input embedding rows: every token id is below it (0: not checked)


def check_tokens(ids: np.ndarray, mm: np.ndarray, samples: list[DecodedSample], spec: CollateSpec) -> None:
    """Refuses (DataError) a micro-batch the model cannot take: a token id outside the model's embeddings (the shards'
    tokenizer is not the model's: an IndexError deep in the forward otherwise, a device assert on a GPU), image or
    video tokens (by mm_token_type_ids) that are not the model's placeholder id (shards built for another family), or
    videos in a run that does not train them."""
    if spec.vocab_size and len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < spec.vocab_size:
        s = next(
            s for s in samples if len(s.input_ids) and not 0 <= s.input_ids.min() <= s.input_ids.max() < spec.vocab_size
        )
        bad = int(s.input_ids.max() if s.input_ids.max() >= spec.vocab_size else s.input_ids.min())
        raise DataError(
            f"sample {s.id} (key {s.key}) holds token id {bad}, outside the model's {spec.vocab_size} embeddings: the "
            "dataset was tokenized for another vocabulary (its processor swapped, or built for another model); "
            "rebuild it with this model's processor"
        )
    if not spec.videos and any(s.videos for s in samples):
        raise DataError(
            f"samples {[s.id for s in samples if s.videos]} hold videos, but this run does not train "
            "video (its manifest counts none, or the model's video path is not verified)"
        )
    # A host family's processor marks its own image tokens (wrappers, breaks): the family is checked at start-up.
    for kind, want in ((1, spec.image_token_id), (2, spec.video_token_id))[1 if spec.host is not None else 0 :]:
        if (ids[mm == kind] != want).any():
            name = ("image", "video")[kind - 1]
            raise DataError(
                f"samples {[s.id for s in samples]} mark {name} tokens that are not the model's {name} "
                f"token {want}: the shards were built for another model family"
            )


def media(samples: list[DecodedSample]) -> tuple[list, list[int], list, list, list, list]:
    """Images (unique, with the occurrence index) and videos of the samples in token order, with their grids."""
    images: list = []  # uint8 H x W x 3, numpy or (from a DataLoader worker) tensors
    index: list[int] = []
    for s in samples:
        index.extend(len(images) + u for u in s.image_index)
        images.extend(s.images)
    grids = [s.image_grid_thw for s in samples if len(s.image_grid_thw)]
    videos = [v for s in samples for v in s.videos]
    vgrids = [s.video_grid_thw for s in samples if len(s.video_grid_thw)]
    seconds = [s.second_per_grid_ts for s in samples if len(s.second_per_grid_ts)]
    return images, index, grids, videos, vgrids, seconds


def placeholders(spec: CollateSpec, *, image: bool, video: bool) -> tuple[list[tuple[int, int]], dict]:
    """The placeholder image / video a micro-batch without one gets: (token id, mm type) per token, and the media.
    A placeholder video is two black frames of one merged patch: its single token runs the video pass."""
    side = spec.patch_size * spec.merge_size
    tokens, out = [], {}
    if image and spec.host is not None:  # its processor resizes it; grid rows are sizes there
        tokens += [(t, 1) for t in spec.placeholder]
        h, w = spec.placeholder_size
        out.update(images=[np.zeros((h, w, 3), dtype=np.uint8)], index=[0], grids=[np.array([[1, h, w]], np.int64)])
    elif image:
        tokens.append((spec.image_token_id, 1))
        out.update(
            images=[np.zeros((side, side, 3), dtype=np.uint8)],
            index=[0],
            grids=[np.array([[1, spec.merge_size, spec.merge_size]], dtype=np.int64)],
        )
    if video:
        tokens.append((spec.video_token_id, 2))
        out.update(
            videos=[[np.zeros((side, side, 3), dtype=np.uint8)] * 2],
            vgrids=[np.array([[1, spec.merge_size, spec.merge_size]], dtype=np.int64)],
            seconds=[np.ones(1, dtype=np.float32)],
        )
    return tokens, out


_ROW_FIELDS = ("input_ids", "mm_token_type_ids", "loss_mask")
_ROW_COPY_MAX = 32  # rows up to which collate copies row by row: faster than the mask up to ~32 short rows


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)  # one row: no copy


def collate(samples: list[DecodedSample], spec: CollateSpec) -> Batch:
    """A micro-batch without images (or without samples) gets one placeholder image after row 0's last
    token: every rank must run the vision tower in every forward, or FSDP's per-block all-gathers would
    pair up across ranks in different orders and hang. Causal attention keeps it from touching any
    real token, and it carries no label. Likewise, where the run's data holds videos, a micro-batch without one gets
    a placeholder video: images and videos go through the same vision blocks in two calls, so a rank that made
    only one of them would all-gather a different number of times than the others."""
    lens = np.array([s.num_tokens for s in samples] or [1], dtype=np.int64)
    extra, fill = placeholders(
        spec, image=not any(s.image_index for s in samples), video=spec.videos and not any(s.videos for s in samples)
    )
    B, L = len(lens), max(int(lens.max()), int(lens[0]) + len(extra))

    ids = np.full((B, L), spec.pad_id, dtype=np.int32)
    loss = np.zeros((B, L), dtype=np.uint8)
    mm = np.zeros((B, L), dtype=np.uint8)
    pos = np.zeros((3, B, L), dtype=np.int32)
    if samples:
        flat_ids, flat_mm, flat_mask = (_flat([getattr(s, f) for s in samples]) for f in _ROW_FIELDS)
        check_tokens(flat_ids, flat_mm, samples, spec)
        # labels[:, 1:] != IGNORE_INDEX, counted without a pass over B x L: all trained tokens but each row's first
        firsts = np.cumsum(lens) - lens
        num_trained = int(np.count_nonzero(flat_mask)) - int(np.count_nonzero(flat_mask[firsts]))
        if B <= _ROW_COPY_MAX:  # a few rows: a slice per row beats building and applying the B x L mask
            for b, s in enumerate(samples):
                n = int(lens[b])
                ids[b, :n], loss[b, :n], mm[b, :n] = s.input_ids, s.loss_mask, s.mm_token_type_ids
                pos[:, b, :n] = s.position_ids
        else:
            # Right padding: the real tokens are exactly `valid`, and a boolean-mask assignment fills it in row-major
            # order, i.e. in the order of the concatenated samples (several times faster than row/col fancy indexing).
            valid = np.arange(L) < lens[:, None]
            ids[valid], loss[valid], mm[valid] = flat_ids, flat_mask, flat_mm
            flat_pos = np.concatenate([s.position_ids for s in samples], axis=1)
            for k in range(3):  # per row: a leading slice makes numpy's mask assignment ~8x slower
                pos[k][valid] = flat_pos[k]
    else:
        num_trained = 0

    images, index, grids, videos, vgrids, seconds = media(samples)
    images, index, grids = fill.get("images", images), fill.get("index", index), fill.get("grids", grids)
    videos, vgrids, seconds = fill.get("videos", videos), fill.get("vgrids", vgrids), fill.get("seconds", seconds)
    for token, kind in extra:
        n = int(lens[0])
        ids[0, n], mm[0, n] = token, kind
        lens[0] = n + 1
        pos[:, 0, n] = pos[:, 0, n - 1] + 1 if n else 0

    rows = [0] if "index" in fill else [b for b, s in enumerate(samples) for _ in s.image_index]
    vision, images = host_inputs(spec, samples, fill, ids, mm, (images, index, rows))
    return Batch(
        vision=vision,
        filler=len(extra),
        input_ids=torch.from_numpy(ids),
        loss_mask=torch.from_numpy(loss),
        lengths=torch.from_numpy(lens),
        position_ids=torch.from_numpy(pos),
        mm_token_type_ids=torch.from_numpy(mm),
        image_grid_thw=torch.from_numpy(np.concatenate(grids).astype(np.int64)),
        images=[torch.as_tensor(im) for im in images],
        image_index=index,
        **video_fields(videos, vgrids, seconds),
        sample_ids=[s.id for s in samples],
        positions=[s.position for s in samples],
        num_tokens=int(sum(s.num_tokens for s in samples)),
        num_trained=num_trained,
        sources=tuple(s.source for s in samples),
        sample_tokens=tuple(s.num_tokens for s in samples),
        image_rows=tuple(rows),
    )


def host_inputs(
    spec: CollateSpec, samples: list[DecodedSample], fill: dict, ids: np.ndarray, mm: np.ndarray, media: tuple
) -> tuple[dict, list]:
    """A host family's pixel inputs for the micro-batch: each sample's images in token order through the dataset's
    image processor, or the placeholder image in row 0 where the micro-batch has none ({} for the patchify families);
    and its unique images (`media`: them, the per-occurrence index and row of ids) as the device takes them (Gemma 4's
    and Mllama's resized here, with the inputs made from them: HostPixels.device_images)."""
    images, index, rows = media
    if spec.host is None:
        return {}, images
    # A large photo's views stand in its place (vlmprep_schemas.views.Packed: the array and the sizes it packs).
    per_sample = [
        [Packed(s.images[u], *s.views[u]) if s.views and s.views[u] else s.images[u] for u in s.image_index]
        for s in samples
    ] or [[]]
    if "images" in fill:
        per_sample[0] = fill["images"]
    vision = spec.host(per_sample, ids, mm)
    images, extra = spec.host.device_images(images, index, rows, ids)
    return {**vision, **extra}, images


# A batch without videos shares these: nothing writes into a batch's tensors, and making two empty tensors for every
# micro-batch cost ~1.5% of a small photo's load (benchmarks/peers --end-to-end).
_NO_VIDEO_GRIDS = torch.zeros(0, 3, dtype=torch.int64)
_NO_SECONDS = torch.zeros(0)


def video_fields(videos: list, vgrids: list, seconds: list) -> dict:
    """The video part of a batch: each sample's frames as tensors, the video grids (int64 [N, 3]) and seconds per
    temporal grid (float32 [N]), empty tensors when there are none."""
    if not (videos or vgrids or seconds):
        return {"videos": [], "video_grid_thw": _NO_VIDEO_GRIDS, "second_per_grid_ts": _NO_SECONDS}
    return dict(
        videos=[[torch.as_tensor(f) for f in v] for v in videos],
        video_grid_thw=torch.from_numpy(np.concatenate(vgrids).astype(np.int64))
        if vgrids
        else torch.zeros(0, 3, dtype=torch.int64),
        second_per_grid_ts=torch.from_numpy(np.concatenate(seconds).astype(np.float32)) if seconds else torch.zeros(0),
    )


def token_sources(batch: Batch) -> torch.Tensor:
    """int64 like input_ids: each token's dataset index (padding and the placeholder image: the row's last)."""
    B, L = batch.input_ids.shape
    src = torch.tensor(batch.sources or (0,), dtype=torch.int64)
    if batch.packed:
        n = torch.tensor(batch.sample_tokens or (L,), dtype=torch.int64)
        out = torch.repeat_interleave(src, n)
        return torch.cat([out, out[-1:].expand(L - len(out))])[None]
    if not batch.sources:
        return torch.zeros(B, L, dtype=torch.int64)
    return src[:, None].expand(B, L).contiguous()

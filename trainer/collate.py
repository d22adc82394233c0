"""Collate: DecodedSamples -> Batch, the first tensors. Vectorized: each field is one scatter into a right-padded
B x L layout; labels = input_ids with IGNORE_INDEX where loss_mask == 0.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from trainer.decode import DecodedSample
from trainer.shards import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    labels: torch.Tensor  # int64 [B, L], IGNORE_INDEX where untrained or padding
    position_ids: torch.Tensor  # int64 [3, B, L], the stored MRoPE positions
    mm_token_type_ids: torch.Tensor  # int64 [B, L]
    image_grid_thw: torch.Tensor  # int64 [N, 3], one row per occurrence, in token order
    images: list[torch.Tensor]  # unique uint8 H x W x 3 images; pixel math happens on the device
    image_index: list[int]  # occurrence -> images
    sample_ids: list[str]
    positions: list[int]  # stream positions of the samples, for resume checks
    num_tokens: int  # real tokens of real samples (no padding, no placeholder)
    num_trained: int  # tokens that carry a loss: labels[:, 1:] != IGNORE_INDEX

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    def to(self, device) -> "Batch":
        move = dict(non_blocking=True)
        return replace(self, input_ids=self.input_ids.to(device, **move),
                       attention_mask=self.attention_mask.to(device, **move), labels=self.labels.to(device, **move),
                       position_ids=self.position_ids.to(device, **move),
                       mm_token_type_ids=self.mm_token_type_ids.to(device, **move),
                       image_grid_thw=self.image_grid_thw.to(device, **move))


@dataclass(frozen=True)
class CollateSpec:
    pad_id: int
    image_token_id: int
    patch_size: int
    merge_size: int


def collate(samples: list[DecodedSample], spec: CollateSpec) -> Batch:
    """A micro-batch without images (or without samples) gets one placeholder image after row 0's last
    token: every rank must run the vision tower in every forward, or FSDP's per-block all-gathers would
    pair up across ranks in different orders and hang. Causal attention keeps it from touching any
    real token, and it carries no label."""
    lens = np.array([s.num_tokens for s in samples] or [1], dtype=np.int64)
    dummy = not any(s.image_index for s in samples)
    B, L = len(lens), int(lens.max()) + int(dummy and lens[0] == lens.max())
    # Right padding: the real tokens are exactly `valid`, and a boolean-mask assignment fills it in row-major
    # order, i.e. in the order of the concatenated samples (several times faster than row/col fancy indexing).
    valid = np.arange(L) < lens[:, None]

    ids = np.full((B, L), spec.pad_id, dtype=np.int64)
    mask = valid.astype(np.int64)
    labels = np.full((B, L), IGNORE_INDEX, dtype=np.int64)
    mm = np.zeros((B, L), dtype=np.int64)
    pos = np.zeros((3, B, L), dtype=np.int64)
    if samples:
        flat_ids = np.concatenate([s.input_ids for s in samples])
        flat_mm = np.concatenate([s.mm_token_type_ids for s in samples])
        if (flat_ids[flat_mm == 1] != spec.image_token_id).any():
            raise DataError(f"samples {[s.id for s in samples]} mark image tokens that are not the model's image "
                            f"token {spec.image_token_id}: the shards were built for another model family")
        ids[valid] = flat_ids
        flat_mask = np.concatenate([s.loss_mask for s in samples])
        labels[valid] = np.where(flat_mask == 1, flat_ids, IGNORE_INDEX)
        # labels[:, 1:] != IGNORE_INDEX, counted without a pass over B x L: all trained tokens but each row's first
        num_trained = int(np.count_nonzero(flat_mask)) - int(np.count_nonzero(flat_mask[np.cumsum(lens) - lens]))
        mm[valid] = flat_mm
        flat_pos = np.concatenate([s.position_ids for s in samples], axis=1)
        for k in range(3):  # per row: a leading slice makes numpy's mask assignment ~8x slower
            pos[k][valid] = flat_pos[k]
    else:
        num_trained = 0

    images: list = []  # uint8 H x W x 3, numpy or (from a DataLoader worker) tensors
    index: list[int] = []
    grids = [s.image_grid_thw for s in samples if len(s.image_grid_thw)]
    for s in samples:
        index.extend(len(images) + u for u in s.image_index)
        images.extend(s.images)
    if dummy:
        n = int(lens[0])
        ids[0, n], mask[0, n], mm[0, n] = spec.image_token_id, 1, 1
        pos[:, 0, n] = pos[:, 0, n - 1] + 1 if n else 0
        side = spec.patch_size * spec.merge_size
        images, index = [np.zeros((side, side, 3), dtype=np.uint8)], [0]
        grids = [np.array([[1, spec.merge_size, spec.merge_size]], dtype=np.int64)]

    return Batch(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                 labels=torch.from_numpy(labels), position_ids=torch.from_numpy(pos),
                 mm_token_type_ids=torch.from_numpy(mm),
                 image_grid_thw=torch.from_numpy(np.concatenate(grids).astype(np.int64)),
                 images=[torch.as_tensor(im) for im in images], image_index=index,
                 sample_ids=[s.id for s in samples], positions=[s.position for s in samples],
                 num_tokens=int(sum(s.num_tokens for s in samples)),
                 num_trained=num_trained)

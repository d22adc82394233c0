"""Shared memory between DataLoader workers and the training process: a pool of reusable slabs per worker, into which
a worker decodes a sample's images and frames, sent as one fd and offsets (SlabRef); the training process hands the
slab back once no tensor view of it is left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from trainer.data.decode import DecodedSample

SLABS_PER_WORKER = 8  # reusable shared-memory slabs; more samples in flight fall back to fresh segments


class SlabPool:
    """Shared-memory transport of decoded images from DataLoader workers to the training process.

    A worker decodes each sample's images straight into one slab (a shared-memory segment) and sends the slab as
    one fd. A fresh segment per sample costs page faults and zeroing of every byte (a trace of 12 screenshots is
    34 MB: ~20 ms, more than its decode), so slabs are reused: `flags[w, k]` (shared, made before the workers
    start) is 1 while slab k of worker w may still be referenced by the training process; the training process
    clears it only once its own mapping of that slab is gone (no tensor views left), and a worker writes only
    into slabs whose flag is 0. With all slabs busy a worker sends a fresh, unpooled segment instead."""

    def __init__(self, num_workers: int, slabs: int = 0):
        slabs = slabs or SLABS_PER_WORKER  # slabs are mapped on first use: a slot costs nothing until then
        self.flags = torch.zeros(max(num_workers, 1), slabs, dtype=torch.uint8).share_memory_()
        self.worker = -1  # set in each worker process
        self._slabs: list[torch.Tensor | None] = [None] * slabs  # this worker's own mappings
        self._slab: tuple[torch.Tensor, int] | None = None  # the slab of the sample being decoded, and its index
        self._held: list[tuple[StorageWeakRef, int, int]] = []  # training process: (slab mapping, worker, slab)
        self.fresh = self.reused = 0  # training process: samples that came in unpooled segments / in reused slabs
        self._seen: set[tuple[int, int]] = set()

    # --- worker side
    def views(self, sizes: list[int]) -> list[np.ndarray]:
        """decode_sample's `alloc`: one uint8 view per image and video frame, all in one slab of this worker."""
        self._slab = self._claim(sum(sizes))
        flat = self._slab[0].numpy()
        ends = np.cumsum([0, *sizes])
        return [flat[a:b] for a, b in zip(ends[:-1], ends[1:])]

    def _claim(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A uint8 tensor of at least nbytes in shared memory, and its slab index (-1: unpooled)."""
        if nbytes == 0:
            return _shared_bytes(0), -1
        flags = self.flags[self.worker].numpy()
        for k in range(len(flags)):
            if flags[k] == 0:
                slab = self._slabs[k]
                if slab is None or slab.numel() < nbytes:
                    slab = self._slabs[k] = _shared_bytes(nbytes * 5 // 4)  # headroom for later samples
                flags[k] = 1
                return slab, k
        return _shared_bytes(nbytes), -1

    def put(self, sample: DecodedSample) -> "SlabRef":
        """The sample as it crosses to the training process: its images as offsets into the slab they lie in."""
        slab, k = self._slab
        base = slab.data_ptr()
        layout = [(im.ctypes.data - base, *im.shape) for im in sample.images]
        frames = [[(f.ctypes.data - base, *f.shape) for f in v] for v in sample.videos]
        sample.images, sample.videos = [], []
        return SlabRef(sample, slab, self.worker, k, layout, frames)

    # --- training process side
    def get(self, item: "SlabRef") -> DecodedSample:
        """Frees the slabs whose views are all gone, then gives the sample its images as views of its slab."""
        for entry in list(self._held):
            if entry[0].expired():
                self.flags[entry[1], entry[2]] = 0
                self._held.remove(entry)
        slab, worker, k = item.slab, item.worker, item.k
        if k >= 0:
            self._held.append((StorageWeakRef(slab.untyped_storage()), worker, k))
            self.reused += (worker, k) in self._seen
            self._seen.add((worker, k))
        elif slab.numel():
            self.fresh += 1
        sample = item.sample
        sample.images = [slab[offset : offset + h * w * c].view(h, w, c) for offset, h, w, c in item.layout]
        sample.videos = [
            [slab[offset : offset + h * w * c].view(h, w, c) for offset, h, w, c in v] for v in item.frames
        ]
        return sample


def _shared_bytes(n: int) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))


@dataclass
class SlabRef:
    """What a worker sends: the sample without its images and frames, the slab that holds them, and where they lie."""

    sample: DecodedSample
    slab: torch.Tensor
    worker: int
    k: int
    layout: list[tuple[int, int, int, int]]  # (byte offset, H, W, 3) per unique image
    frames: list[list[tuple[int, int, int, int]]]  # per video, (byte offset, H, W, 3) per frame

"""Batches for one rank: its shards -> a sample stream split across DataLoader workers by position
(i % W == w, so the order is the same for any W) -> micro-batches (count or token budget) -> steps.
The stream is either the shards read in sequence (ShardSequence -> RankStream: no sample shuffle, one dataset, any
URL) or the epoch schedule of trainer/data/order.py read by random access from indexed shards (EpochSchedule ->
ScheduledStream: sample shuffle, mixtures). Position = samples consumed in the epoch; it is all a checkpoint needs to
resume exactly.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.config import Batching
from trainer.data.cache import CacheView, ShardCache
from trainer.data.collate import Batch, CollateSpec, collate
from trainer.data.decode import DecodedSample, OriginalResizer, decode_sample
from trainer.data.errors import DataError
from trainer.data.index import read_indexed
from trainer.data.integrity import check_unchanged
from trainer.data.order import RankSource, Schedule, schedule
from trainer.data.pack import Packer, collate_packed
from trainer.data.sources import ShardRef
from trainer.data.tars import iter_tar_samples
from trainer.data.vision import ImageSpec


def epoch_shards(shards: list[ShardRef], *, epoch: int, seed: int, shuffle_shards: bool) -> list[ShardRef]:
    """A rank's shard order for an epoch: manifest order, or a permutation fixed by (seed, epoch)."""
    order = list(shards)
    if shuffle_shards:
        random.Random(f"vlmprep-trainer:{seed}:{epoch}").shuffle(order)
    return order


class RankStream(IterableDataset):
    """The rank's shards concatenated (with stride=(r, R): only every R-th sample from r), from stream position
    `start` on. Worker w of W decodes only positions start + w, start + w + W, ...; the DataLoader's in-order
    round robin then restores the sequential order."""

    def __init__(self, shards: list[ShardRef], *, start: int, spec: ImageSpec, stride: tuple[int, int] = (0, 1),
                 signatures: dict[str, tuple[int, ...]] | None = None):
        self.shards, self.start, self.spec, self.stride = shards, start, spec, stride
        self.signatures = signatures or {}  # url -> file_signature when the run checked it: it must stay that file
        self.pool: SlabPool | None = None  # set by sample_loader when workers decode

    def __iter__(self) -> Iterator[DecodedSample]:
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info else (0, 1)
        r, R = self.stride
        resize = OriginalResizer(self.spec)
        pool = self.pool if info else None
        if pool is not None:
            pool.worker = w
        offset = 0  # index of the shard's first sample in the concatenation of all shards
        for shard in self.shards:
            if shard.num_samples is not None and (offset + shard.num_samples - r + R - 1) // R <= self.start:
                offset += shard.num_samples  # fully consumed before a resume: never opened
                continue

            def want(i: int, offset=offset) -> bool:
                g = offset + i
                return g % R == r and g // R >= self.start and (g // R - self.start) % W == w

            count, signature = 0, self.signatures.get(shard.url, ())
            if signature:  # before the shard is opened, and again once it is read through
                check_unchanged(os.stat(shard.url), signature, shard.url)
            for i, key, members in iter_tar_samples(shard.url, want):
                count += 1
                if members is not None:
                    sample = decode_sample(members, key=key, url=shard.url, spec=self.spec, resize_original=resize,
                                           alloc=pool.views if pool else None)
                    sample.position, sample.worker = (offset + i) // R, w
                    yield pool.put(sample) if pool else sample
            if signature:
                check_unchanged(os.stat(shard.url), signature, shard.url)
            if shard.num_samples is not None and count != shard.num_samples:
                raise DataError(f"{shard.url} holds {count} samples but the manifest says {shard.num_samples}: "
                                "truncated or replaced shard")
            offset += count


class ScheduledStream(IterableDataset):
    """A rank's epoch schedule from stream position `start` on, each sample read by its byte range from an indexed
    local shard: only the samples due are read and decoded, so host memory does not depend on how far the
    permutation reaches. Worker w of W reads positions start + w, start + w + W, ... as RankStream does."""

    MAX_OPEN = 64  # file handles a worker keeps open

    def __init__(self, sources: list[RankSource], order: Schedule, *, start: int, spec: ImageSpec,
                 cache: CacheView | None = None):
        """`cache`: remote shards are read from the rank's shard cache (trainer/data/cache.py), each once it is local;
        the reader's position goes back to the cache, which evicts what no reader needs any more."""
        self.sources, self.order, self.start, self.spec, self.cache = sources, order, start, spec, cache
        self.pool: SlabPool | None = None

    def __iter__(self) -> Iterator[DecodedSample]:
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info else (0, 1)
        resize = OriginalResizer(self.spec)
        pool = self.pool if info else None
        if pool is not None:
            pool.worker = w
        named = len(self.sources) > 1
        cache = self.cache
        files: dict[str, object] = {}
        try:
            for p in range(self.start + w, len(self.order), W):
                s = int(self.order.source[p])
                src = self.sources[s]
                k, i = int(self.order.shard[p]), int(self.order.sample[p])
                index = src.indexes[k]
                if cache is not None:
                    cache.at(w, p)
                    j = cache.flat(s, k)
                    for gone in [path for path, (_, g) in files.items() if cache.gone(g)] if cache.evicts else ():
                        files.pop(gone)[0].close()  # evicted: its disk space is freed once no handle holds it
                    cache.path(j)
                entry = files.get(index.path)
                if entry is None:
                    if len(files) >= self.MAX_OPEN:
                        files.pop(next(iter(files)))[0].close()
                    entry = files[index.path] = (open(index.path, "rb"), cache.flat(s, k) if cache else -1)
                check_unchanged(os.fstat(entry[0].fileno()), index.signature, src.shards[k].url)  # one fstat a sample
                key, members = read_indexed(index, i, entry[0])
                sample = decode_sample(members, key=key, url=src.shards[k].url, spec=self.spec,
                                       resize_original=resize, alloc=pool.views if pool else None)
                sample.position, sample.worker, sample.source = p, w, int(self.order.source[p])
                if named:
                    sample.id = f"{src.name}/{sample.id}"
                yield pool.put(sample) if pool else sample
            if cache is not None:
                cache.at(w, len(self.order))  # done: this reader holds no shard back
        finally:
            for f, _ in files.values():
                f.close()


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

    def put(self, sample: DecodedSample) -> "_SlabRef":
        """The sample as it crosses to the training process: its images as offsets into the slab they lie in."""
        slab, k = self._slab
        base = slab.data_ptr()
        layout = [(im.ctypes.data - base, *im.shape) for im in sample.images]
        frames = [[(f.ctypes.data - base, *f.shape) for f in v] for v in sample.videos]
        sample.images, sample.videos = [], []
        return _SlabRef(sample, slab, self.worker, k, layout, frames)

    # --- training process side
    def get(self, item: "_SlabRef") -> DecodedSample:
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
        sample.images = [slab[offset:offset + h * w * c].view(h, w, c) for offset, h, w, c in item.layout]
        sample.videos = [[slab[offset:offset + h * w * c].view(h, w, c) for offset, h, w, c in v] for v in item.frames]
        return sample


def _shared_bytes(n: int) -> torch.Tensor:
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))


@dataclass
class _SlabRef:
    """What a worker sends: the sample without its images and frames, the slab that holds them, and where they lie."""

    sample: DecodedSample
    slab: torch.Tensor
    worker: int
    k: int
    layout: list[tuple[int, int, int, int]]  # (byte offset, H, W, 3) per unique image
    frames: list[list[tuple[int, int, int, int]]]  # per video, (byte offset, H, W, 3) per frame


def _identity(x):
    return x


def sample_loader(stream: RankStream | ScheduledStream, *, num_workers: int, prefetch_factor: int,
                  held: int = 0) -> "SampleLoader":
    """`held`: samples the consumer keeps alive (a packing window); each worker gets slabs for its share of them."""
    kw = dict(prefetch_factor=prefetch_factor) if num_workers else {}
    slabs = SLABS_PER_WORKER + -(-held // max(num_workers, 1))
    stream.pool = SlabPool(num_workers, slabs) if num_workers else None  # made before the workers start: they share it
    return SampleLoader(DataLoader(stream, batch_size=None, num_workers=num_workers, collate_fn=_identity, **kw),
                        stream.pool)


@dataclass
class SampleLoader:
    """The rank's decoded samples in stream order; iterating starts the DataLoader's workers."""

    loader: DataLoader
    pool: SlabPool | None = None

    def __iter__(self) -> Iterator[DecodedSample]:
        for item in self.loader:
            yield self.pool.get(item) if isinstance(item, _SlabRef) else item


@dataclass
class MicroBatcher:
    """Groups the stream into micro-batches: `batching.micro_batch_size` samples, or as many as fit
    `batching.max_tokens_per_batch` (rows x padded length; a longer sample goes alone). Counts the samples it emitted
    in `consumed`."""

    samples: Iterator[DecodedSample]
    collate_spec: CollateSpec
    batching: Batching
    consumed: int = 0
    _pending: DecodedSample | None = None
    _done: bool = False

    def _next_sample(self) -> DecodedSample | None:
        if self._pending is not None:
            s, self._pending = self._pending, None
            return s
        if self._done:
            return None
        s = next(self.samples, None)
        self._done = s is None
        return s

    def next(self) -> Batch | None:
        """The next micro-batch, or None once the stream is exhausted."""
        group: list[DecodedSample] = []
        longest = 0
        max_tokens, size = self.batching.max_tokens_per_batch, self.batching.micro_batch_size
        while True:
            s = self._next_sample()
            if s is None:
                break
            if s.position != self.consumed + len(group):
                raise DataError(f"sample stream out of order: got position {s.position}, "
                                f"expected {self.consumed + len(group)}")
            longest_if = max(longest, s.num_tokens)
            if group and ((max_tokens and longest_if * (len(group) + 1) > max_tokens)
                          or (not max_tokens and len(group) >= size)):
                self._pending = s
                break
            group.append(s)
            longest = longest_if
            if not max_tokens and len(group) >= size:
                break
        if not group:
            return None
        self.consumed += len(group)
        return collate(group, self.collate_spec)


@dataclass
class ShardSequence:
    """The stream of one mode: the rank's shards read in sequence (RankStream: any URL, no index, no sample shuffle),
    their order per epoch shuffled with `shuffle_shards`; stride=(r, R): every rank reads all shards and keeps every
    R-th sample. `signatures`: url -> the file_signature of each shard as the run checked it (integrity.py)."""

    shards: list[ShardRef]
    spec: ImageSpec
    seed: int
    shuffle_shards: bool
    stride: tuple[int, int] = (0, 1)
    signatures: dict[str, tuple[int, ...]] | None = None

    def open(self, epoch: int, position: int, num_workers: int) -> RankStream:
        """The epoch's stream from `position` on."""
        shards = epoch_shards(self.shards, epoch=epoch, seed=self.seed, shuffle_shards=self.shuffle_shards)
        return RankStream(shards, start=position, spec=self.spec, stride=self.stride, signatures=self.signatures)

    def close(self) -> None:
        """Nothing to release."""


class EpochSchedule:
    """The stream of the other mode: the epoch schedule of trainer/data/order.py over the rank's indexed sources
    (ScheduledStream: sample shuffle in blocks of `shuffle_span` shards, mixtures), read by random access.
    `first`: epoch 0's schedule, when already made. `cache`: the rank's shard cache for the sources' remote shards
    (started per epoch, closed with the loader)."""

    def __init__(self, sources: list[RankSource], *, spec: ImageSpec, seed: int, shuffle: bool, shuffle_shards: bool,
                 shuffle_span: int, first: Schedule | None = None, cache: ShardCache | None = None):
        self.sources, self.spec, self.seed, self.cache = sources, spec, seed, cache
        self.shuffle, self.shuffle_shards, self.shuffle_span = shuffle, shuffle_shards, shuffle_span
        self._first = first

    def schedule(self, epoch: int) -> Schedule:
        """The shard and sample order of `epoch` over these datasets (the same on every rank)."""
        return schedule(self.sources, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                        shuffle_shards=self.shuffle_shards, shuffle_span=self.shuffle_span)

    def open(self, epoch: int, position: int, num_workers: int) -> ScheduledStream:
        """The epoch's stream from `position` on (the shard cache, if any, restarted at it)."""
        first, self._first = self._first, None  # used once, then freed
        order = first if first is not None and epoch == 0 else self.schedule(epoch)
        if self.cache is not None:
            self.cache.begin(order, position, num_workers)
        return ScheduledStream(self.sources, order, start=position, spec=self.spec,
                               cache=self.cache.view if self.cache else None)

    def close(self) -> None:
        """Stops the shard cache's fetches and lets its dir go."""
        if self.cache is not None:
            self.cache.end()


class StepLoader:
    """A rank's steps: grad_accum micro-batches each; an exhausted rank yields empty micro-batches (the
    'pad' remainder policy) so every rank runs the same forwards until all ranks are exhausted. With pack_to,
    a micro-batch is micro_batch_size packed rows (trainer/data/pack.py) instead of micro_batch_size samples."""

    def __init__(self, streams: ShardSequence | EpochSchedule, *, collate_spec: CollateSpec, batching: Batching,
                 num_workers: int, prefetch_factor: int):
        """`streams`: where each epoch's samples come from (the shards in sequence, or the epoch schedule)."""
        self.streams, self.collate_spec, self.batching = streams, collate_spec, batching
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.epoch = 0
        self._batcher: MicroBatcher | None = None
        self._packer: Packer | None = None
        self._loader: SampleLoader | None = None

    def start(self, epoch: int, position: int, pack_state: list[int] | None = None) -> None:
        """Continue `epoch` at stream `position`; a packing run continues from its packer state instead (the
        stream restarts at the oldest sample the state still holds)."""
        self._drop()  # the shard cache's fetcher restarts in open() (its dir stays this run's)
        self.epoch = epoch
        if pack_state:
            position = Packer.resume_start(pack_state)
        stream = self.streams.open(epoch, position, self.num_workers)
        pack_to, window = self.batching.pack_to, self.batching.pack_window
        self._loader = sample_loader(stream, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                                     held=window if pack_to else 0)
        if pack_to:
            self._packer = Packer(iter(self._loader), capacity=pack_to, window=window, state=pack_state or None)
            self._packer.next_pos = max(self._packer.next_pos, position)
        else:
            self._batcher = MicroBatcher(iter(self._loader), self.collate_spec, self.batching, consumed=position)

    @property
    def position(self) -> int:
        """Samples this rank has consumed in the current epoch (what a checkpoint saves)."""
        return self._packer.next_pos if self._packer else self._batcher.consumed

    @property
    def pack_state(self) -> list[int]:
        """The packer's carry-over (samples read but not yet placed in a row); [] when not packing."""
        return self._packer.state() if self._packer else []

    def next_step(self) -> list[Batch]:
        """The `grad_accum` micro-batches of the next optimizer step, on the host; past the end of this rank's data a
        micro-batch is empty (so every rank still takes the same number of collective steps)."""
        out = []
        for _ in range(self.batching.grad_accum):
            if self._packer:
                rows = [r for r in (self._packer.next_row() for _ in range(self.batching.micro_batch_size)) if r]
                mb = collate_packed(rows, self.collate_spec) if rows else None
            else:
                mb = self._batcher.next()
            out.append(mb if mb is not None else collate([], self.collate_spec))
        return out

    def _drop(self) -> None:
        # The last reference to the DataLoader iterator goes here, which stops its worker processes now.
        self._batcher = self._packer = self._loader = None

    def close(self) -> None:
        """Drops the DataLoader iterator (its worker processes stop now) and ends the streams (the run is over)."""
        self._drop()
        self.streams.close()

"""Streams: a rank's samples in one epoch's order, from a stream position on, split across DataLoader workers by
position (i % W == w, so the order is the same for any W), each decoded (decode.py). Two read paths behind one
protocol (Streams): the shards read in sequence (ShardSequence -> RankStream: no sample shuffle, one dataset, any
URL) or the epoch schedule of order.py read by random access from indexed shards (EpochSchedule -> ScheduledStream:
sample shuffle, mixtures). Position = samples consumed in the epoch; it is all a checkpoint needs to resume exactly.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Iterator, Protocol

from torch.utils.data import IterableDataset, get_worker_info

from trainer.data.cache import ShardCache
from trainer.data.cacheview import CacheView
from trainer.data.decode import DecodedSample, decode_sample
from trainer.data.errors import DataError
from trainer.data.index import read_indexed
from trainer.data.integrity import check_unchanged
from trainer.data.order import RankSource, Schedule, schedule
from trainer.data.originals import OriginalResizer
from trainer.data.shm import SlabPool
from trainer.data.sources import ShardRef
from trainer.data.tars import iter_tar_samples
from trainer.data.vision import ImageSpec


class Streams(Protocol):
    """Where a rank's samples come from, epoch by epoch: the shards in sequence (ShardSequence) or the epoch schedule
    by random access (EpochSchedule). StepLoader opens one stream per epoch (from a position, for a resume), hands it
    to its DataLoader workers, and closes the streams when the run is over."""

    def open(self, epoch: int, position: int, num_workers: int) -> RankStream | ScheduledStream:
        """The epoch's stream from stream position `position` on, read by `num_workers` DataLoader workers."""
        ...

    def close(self) -> None:
        """Releases what the streams hold (the shard cache's fetcher and dir)."""
        ...


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

    def __init__(
        self,
        shards: list[ShardRef],
        *,
        start: int,
        spec: ImageSpec,
        stride: tuple[int, int] = (0, 1),
        signatures: dict[str, tuple[int, ...]] | None = None,
    ):
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
                    sample = decode_sample(
                        members,
                        key=key,
                        url=shard.url,
                        spec=self.spec,
                        resize_original=resize,
                        alloc=pool.views if pool else None,
                    )
                    sample.position, sample.worker = (offset + i) // R, w
                    yield pool.put(sample) if pool else sample
            if signature:
                check_unchanged(os.stat(shard.url), signature, shard.url)
            if shard.num_samples is not None and count != shard.num_samples:
                raise DataError(
                    f"{shard.url} holds {count} samples but the manifest says {shard.num_samples}: "
                    "truncated or replaced shard"
                )
            offset += count


class ScheduledStream(IterableDataset):
    """A rank's epoch schedule from stream position `start` on, each sample read by its byte range from an indexed
    local shard: only the samples due are read and decoded, so host memory does not depend on how far the
    permutation reaches. Worker w of W reads positions start + w, start + w + W, ... as RankStream does."""

    MAX_OPEN = 64  # file handles a worker keeps open

    def __init__(
        self, sources: list[RankSource], order: Schedule, *, start: int, spec: ImageSpec, cache: CacheView | None = None
    ):
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
                sample = decode_sample(
                    members,
                    key=key,
                    url=src.shards[k].url,
                    spec=self.spec,
                    resize_original=resize,
                    alloc=pool.views if pool else None,
                )
                sample.position, sample.worker, sample.source = p, w, int(self.order.source[p])
                if named:
                    sample.id = f"{src.name}/{sample.id}"
                yield pool.put(sample) if pool else sample
            if cache is not None:
                cache.at(w, len(self.order))  # done: this reader holds no shard back
        finally:
            for f, _ in files.values():
                f.close()


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
    `first`: (epoch, its schedule), when already made. `cache`: the rank's shard cache for the sources' remote shards
    (started per epoch, closed with the loader)."""

    def __init__(
        self,
        sources: list[RankSource],
        *,
        spec: ImageSpec,
        seed: int,
        shuffle: bool,
        shuffle_shards: bool,
        shuffle_span: int,
        first: tuple[int, Schedule] | None = None,
        cache: ShardCache | None = None,
    ):
        self.sources, self.spec, self.seed, self.cache = sources, spec, seed, cache
        self.shuffle, self.shuffle_shards, self.shuffle_span = shuffle, shuffle_shards, shuffle_span
        self._first = first

    def schedule(self, epoch: int) -> Schedule:
        """The shard and sample order of `epoch` over these datasets (the same on every rank)."""
        return schedule(
            self.sources,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            shuffle_shards=self.shuffle_shards,
            shuffle_span=self.shuffle_span,
        )

    def open(self, epoch: int, position: int, num_workers: int) -> ScheduledStream:
        """The epoch's stream from `position` on (the shard cache, if any, restarted at it)."""
        first, self._first = self._first, None  # used once, then freed
        order = first[1] if first is not None and first[0] == epoch else self.schedule(epoch)
        if self.cache is not None:
            self.cache.begin(order, position, num_workers)
        return ScheduledStream(
            self.sources, order, start=position, spec=self.spec, cache=self.cache.view if self.cache else None
        )

    def close(self) -> None:
        """Stops the shard cache's fetches and lets its dir go."""
        if self.cache is not None:
            self.cache.end()

"""Data order: each source's samples on a rank -> a seeded per-epoch permutation (blocks of `shuffle_span` shards, every
sample once) -> several sources interleaved by trained-token weight -> the rank's epoch schedule, one
(source, shard, sample) per stream position. Pure functions of metadata (the shards' sample indexes), so every
DataLoader worker, a resumed run and the step predictor compute the same order without reading a sample.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from trainer.data.index import ShardIndex


@dataclass(frozen=True)
class RankSource:
    """One source as one rank reads it: its shards (all of them in stride mode) and their sample indexes."""

    name: str
    weight: float
    on_end: str
    shards: tuple  # ShardRef, in manifest order
    indexes: tuple[ShardIndex, ...]
    stride: tuple[int, int] = (0, 1)  # (rank, world): fewer shards than ranks, every rank keeps every world-th
    # Seeds this rank's own permutation when it owns its shards: ranks with equal sample counts would otherwise read
    # the same slots of their shards in lockstep (neighbouring shards, often one task of a sorted input, in one
    # global batch). -1 in stride mode, where all ranks must share one permutation.
    owner: int = -1

    # Made once per source: the schedule, the step predictor and every pass of a mixture read them.
    @cached_property
    def all_tokens(self) -> np.ndarray:
        """Every sample's token count, the shards' one after another (shard k's from shard_firsts[k])."""
        return np.concatenate([ix.tokens for ix in self.indexes] or [np.zeros(0, np.int64)])

    @cached_property
    def all_trained(self) -> np.ndarray:
        """Every sample's trained token count, laid out as all_tokens."""
        return np.concatenate([ix.trained for ix in self.indexes] or [np.zeros(0, np.int64)])

    @cached_property
    def shard_sizes(self) -> np.ndarray:
        """Each shard's sample count (int64; read, never written)."""
        return np.fromiter((ix.num_samples for ix in self.indexes), dtype=np.int64, count=len(self.indexes))

    @cached_property
    def shard_firsts(self) -> np.ndarray:
        """Where each shard's samples begin in all_tokens / all_trained."""
        return np.cumsum(self.shard_sizes) - self.shard_sizes


@dataclass(frozen=True)
class Schedule:
    """A rank's epoch: position p reads sample `sample[p]` of shard `shard[p]` of source `source[p]`."""

    source: np.ndarray  # int16
    shard: np.ndarray  # int32, index into that source's `shards`
    sample: np.ndarray  # int32, index in the shard

    def __len__(self) -> int:
        return len(self.source)

    def tokens(self, sources: list[RankSource]) -> np.ndarray:
        """The token count of each position of the epoch (from the sources' per-sample counts)."""
        if len(sources) == 1:
            return _counts_of(sources[0], "tokens", self.shard, self.sample)
        out = np.empty(len(self), dtype=np.int64)
        for s, src in enumerate(sources):
            at = np.flatnonzero(self.source == s)
            out[at] = _counts_of(src, "tokens", self.shard[at], self.sample[at])
        return out


def _rng(*parts) -> np.random.Generator:
    digest = hashlib.sha256(":".join(map(str, ("vlmprep-order",) + parts)).encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def pass_order(
    src: RankSource, *, seed: int, epoch: int, pass_no: int, shuffle: bool, shuffle_shards: bool, shuffle_span: int
) -> tuple[np.ndarray, np.ndarray]:
    """One pass over a source on this rank: (shard, sample) arrays. With shuffle, the shard order is permuted and
    the samples of each block of `shuffle_span` consecutive shards (0: all of them) are permuted together, so a shard's
    samples spread over its block; seeded by (seed, epoch, source name, pass, owning rank)."""
    counts = src.shard_sizes
    order = list(range(len(counts)))
    if shuffle:
        random.Random(f"vlmprep-order:{seed}:{epoch}:{src.name}:{pass_no}:{src.owner}").shuffle(order)
    elif shuffle_shards:  # the sequential reader's own shard order (data.epoch_shards)
        random.Random(
            f"vlmprep-trainer:{seed}:{epoch}" + (f":{src.name}:{pass_no}" if src.name or pass_no else "")
        ).shuffle(order)
    order = np.asarray(order, dtype=np.int64)
    sizes = counts[order]
    shard = np.repeat(order.astype(np.int32), sizes)
    sample = np.arange(len(shard), dtype=np.int32) - np.repeat((np.cumsum(sizes) - sizes).astype(np.int32), sizes)
    if shuffle:
        block = shuffle_span or max(len(order), 1)
        rng = _rng(seed, epoch, src.name, pass_no, src.owner, "samples")
        if block >= len(order):  # one block, the whole pass: no bounds, no copy back
            perm = rng.permutation(len(shard))
            shard, sample = shard[perm], sample[perm]
        else:
            bounds = np.concatenate(
                [[0], np.cumsum([sizes[i : i + block].sum() for i in range(0, len(order), block)])]
            ).astype(np.int64)
            for a, z in zip(bounds[:-1], bounds[1:]):
                perm = a + rng.permutation(z - a)
                shard[a:z], sample[a:z] = shard[perm], sample[perm]
    r, world = src.stride
    return shard[r::world], sample[r::world]


def schedule(
    sources: list[RankSource], *, seed: int, epoch: int, shuffle: bool, shuffle_shards: bool, shuffle_span: int
) -> Schedule:
    """The rank's epoch. One source: its pass. Several: weighted fair queuing on trained tokens: at every position
    the source whose next sample would end earliest in its own time ((trained so far + that sample's) / weight; a
    sample with no trained token counts as one) gives it, so each source's share of trained tokens tracks its
    weight to within about one sample. A source that runs out
    starts a fresh pass ('repeat') or leaves the mixture ('stop'); the epoch ends once every source has been read
    through once."""

    def one_pass(s: int, k: int):
        return pass_order(
            sources[s],
            seed=seed,
            epoch=epoch,
            pass_no=k,
            shuffle=shuffle,
            shuffle_shards=shuffle_shards,
            shuffle_span=shuffle_span,
        )

    if len(sources) == 1:
        shard, sample = one_pass(0, 0)
        return Schedule(np.zeros(len(shard), dtype=np.int16), shard, sample)
    # Each source's next sample ends at (its trained tokens so far + that sample's) / weight, independent of the
    # others, so the loop "take the source whose next sample ends earliest (ties: the lower source)" is a merge of
    # each source's sorted end times: one lexsort. Token counts are integers, so their running sums are exact in any
    # order. A 'repeat' source's passes continue its clock; the epoch ends with the item that completes the last
    # first pass.
    n = len(sources)
    cur = [one_pass(s, 0) for s in range(n)]
    live = [s for s in range(n) if len(cur[s][0])]
    if not live:
        return Schedule(np.zeros(0, np.int16), np.zeros(0, np.int32), np.zeros(0, np.int32))

    def clock(s: int, part: tuple[np.ndarray, np.ndarray], start: int = 0) -> np.ndarray:
        """A source's trained tokens once each sample of `part` is read (one for a sample with none), from `start`."""
        return start + np.cumsum(np.maximum(_counts_of(sources[s], "trained", *part), 1))

    clocks = [clock(s, cur[s]) for s in live]
    last = max(range(len(live)), key=lambda j: (float(clocks[j][-1]) / sources[live[j]].weight, live[j]))
    horizon = float(clocks[last][-1]) / sources[live[last]].weight
    keys, srcs, shards, samples = [], [], [], []
    for j, s in enumerate(live):
        parts, ticks = [cur[s]], [clocks[j]]
        while sources[s].on_end != "stop" and float(ticks[-1][-1]) / sources[s].weight <= horizon:
            parts.append(one_pass(s, len(parts)))  # a later pass, while this source has not passed the epoch's end
            ticks.append(clock(s, parts[-1], ticks[-1][-1]))
        keys.append(np.concatenate(ticks).astype(np.float64) / sources[s].weight)
        srcs.append(np.full(len(keys[-1]), s, dtype=np.int16))
        shards.append(np.concatenate([p[0] for p in parts]))
        samples.append(np.concatenate([p[1] for p in parts]))
    key, src = np.concatenate(keys), np.concatenate(srcs)
    within = np.concatenate([np.arange(len(k)) for k in keys])  # a source's own order where end times tie
    order = np.lexsort((within, src, key))
    end_at = sum(len(k) for k in keys[:last]) + len(clocks[last]) - 1  # the item that completes the last first pass
    order = order[: int(np.flatnonzero(order == end_at)[0]) + 1]
    return Schedule(
        src[order], np.concatenate(shards)[order].astype(np.int32), np.concatenate(samples)[order].astype(np.int32)
    )


# An epoch of a mixture ends when every source has been read through once, so weights far from the sources' own
# token shares stretch it: a source at weight 1e-9 is read through only after the others have repeated ~1e9 times.
# The schedule holds every position of the epoch, so such an epoch would never finish being predicted; it is refused
# beyond this many times the sources' own samples (and this many samples at the least).
MAX_EPOCH_STRETCH = 64
MIN_EPOCH_LIMIT = 1 << 20


@dataclass(frozen=True)
class EpochSize:
    """A rank's epoch of a mixture, estimated from the sources' counts alone (no schedule is built)."""

    positions: float  # samples the epoch reads
    limit: float  # the most an epoch may read (MAX_EPOCH_STRETCH x the sources' samples, at least MIN_EPOCH_LIMIT)
    last: int  # the source whose first pass ends the epoch
    passes: tuple[float, ...]  # passes over each source the epoch reads


def epoch_size(sources: list[RankSource]) -> EpochSize:
    """How long schedule() makes a rank's epoch, in O(sources): every source runs on its own clock (trained tokens /
    weight); the epoch ends when the slowest one finishes its first pass, by which time a 'repeat' source has read
    its weight x that time in trained tokens, a 'stop' source one pass."""
    samples = [sum(ix.num_samples for ix in src.indexes) for src in sources]
    live = [s for s in range(len(sources)) if samples[s]]
    limit = float(max(MAX_EPOCH_STRETCH * sum(samples), MIN_EPOCH_LIMIT))
    if len(sources) == 1 or not live:
        return EpochSize(float(sum(samples)), limit, 0, tuple(1.0 if n else 0.0 for n in samples))
    tokens = [float(np.maximum(src.all_trained, 1).sum()) for src in sources]
    clocks = [t / src.weight if src.weight > 0 else float("inf") for t, src in zip(tokens, sources)]
    last = max(live, key=lambda s: (clocks[s], -s))
    end = clocks[last]
    passes = tuple(
        0.0
        if not samples[s]
        else 1.0
        if sources[s].on_end == "stop" or s == last
        else max(1.0, end * sources[s].weight / tokens[s])
        for s in range(len(sources))
    )
    return EpochSize(sum(p * n for p, n in zip(passes, samples)), limit, last, passes)


def _counts_of(src: RankSource, field: str, shard: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """A per-sample count ('tokens' or 'trained') at (shard, sample) pairs, vectorized over one flat array."""
    return getattr(src, f"all_{field}")[src.shard_firsts[shard] + sample]

"""Batches for one rank: an epoch's sample stream (streams.py) -> decoded by DataLoader workers, in stream order
(sample_loader) -> micro-batches of micro_batch_size samples or a token budget (MicroBatcher), or packed rows
(pack.py) -> the grad_accum micro-batches of each optimizer step (StepLoader), empty ones past the end of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from torch.utils.data import DataLoader

from trainer.data.collate import Batch, CollateSpec, collate
from trainer.data.decode import DecodedSample
from trainer.data.errors import DataError
from trainer.data.pack import Packer, collate_packed
from trainer.data.shm import SLABS_PER_WORKER, SlabPool, SlabRef
from trainer.data.streams import RankStream, ScheduledStream, Streams
from trainer.options import Batching


def _identity(x):
    return x


def sample_loader(
    stream: RankStream | ScheduledStream, *, num_workers: int, prefetch_factor: int, held: int = 0
) -> "SampleLoader":
    """`held`: samples the consumer keeps alive (a packing window); each worker gets slabs for its share of them."""
    kw = dict(prefetch_factor=prefetch_factor) if num_workers else {}
    slabs = SLABS_PER_WORKER + -(-held // max(num_workers, 1))
    stream.pool = SlabPool(num_workers, slabs) if num_workers else None  # made before the workers start: they share it
    return SampleLoader(
        DataLoader(stream, batch_size=None, num_workers=num_workers, collate_fn=_identity, **kw), stream.pool
    )


@dataclass
class SampleLoader:
    """The rank's decoded samples in stream order; iterating starts the DataLoader's workers."""

    loader: DataLoader
    pool: SlabPool | None = None

    def __iter__(self) -> Iterator[DecodedSample]:
        for item in self.loader:
            yield self.pool.get(item) if isinstance(item, SlabRef) else item


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
                raise DataError(
                    f"sample stream out of order: got position {s.position}, expected {self.consumed + len(group)}"
                )
            longest_if = max(longest, s.num_tokens)
            if group and (
                (max_tokens and longest_if * (len(group) + 1) > max_tokens) or (not max_tokens and len(group) >= size)
            ):
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


class StepLoader:
    """A rank's steps: grad_accum micro-batches each; an exhausted rank yields empty micro-batches (the
    'pad' remainder policy) so every rank runs the same forwards until all ranks are exhausted. With pack_to,
    a micro-batch is micro_batch_size packed rows (trainer/data/pack.py) instead of micro_batch_size samples."""

    def __init__(
        self, streams: Streams, *, collate_spec: CollateSpec, batching: Batching, num_workers: int, prefetch_factor: int
    ):
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
        self._loader = sample_loader(
            stream, num_workers=self.num_workers, prefetch_factor=self.prefetch_factor, held=window if pack_to else 0
        )
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

    def swap(self, streams: Streams) -> None:
        """Read from `streams` from the next start() on (a --follow run's epoch at a newer version); the streams read
        so far are closed."""
        self._drop()
        self.streams.close()
        self.streams = streams

    def _drop(self) -> None:
        # The last reference to the DataLoader iterator goes here, which stops its worker processes now.
        self._batcher = self._packer = self._loader = None

    def close(self) -> None:
        """Drops the DataLoader iterator (its worker processes stop now) and ends the streams (the run is over)."""
        self._drop()
        self.streams.close()

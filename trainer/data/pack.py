"""Packing: a rank's sample stream -> rows of whole samples, at most T tokens each (best-fit decreasing over a
look-ahead window) -> one packed Batch per micro-batch, each sample isolated by its own positions restarting at 0.
The packer's state (stream position, window, rows formed but not yet taken) is a short int list for checkpoints.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

import numpy as np
import torch

from trainer.data.collate import Batch, CollateSpec, check_tokens, host_inputs, media, placeholders, video_fields
from trainer.data.decode import DecodedSample
from trainer.data.errors import DataError
from trainer.families import FAMILIES, packing_refusal

# Model types whose text model reads [4, B, L] position_ids (row 0: per-sample text positions) as packed
# sequences: the mask (sdpa/eager) and flash-attention's cu_seqlens are derived from the resets of row 0.
# Model types whose packed rows give each sample exactly its own logits (tests/trainer/test_pack.py per family).
PACKABLE_MODELS = tuple(t for f in FAMILIES if not f.pack for t in f.model_types)
# A row filled below this is held back for the next window (not at the stream's end): tail rows of a window
# are what leaves GPUs idle at a step. At most half the window is held back, so every window makes progress.
CARRY_BELOW = 0.95


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices into `lengths` grouped into bins of total <= capacity. Longest first (ties: lower index first),
    each into the bin it fills most tightly (ties: the older bin); deterministic for given lengths."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        assert n <= capacity, f"sample of {n} tokens cannot fit a row of {capacity}"
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


class Packer:
    """Rows of whole samples from a rank's stream. Reads up to `window` samples, packs them by best-fit
    decreasing, hands out the rows in a fixed pseudo-random order, and keeps samples of rows below CARRY_BELOW
    for the next window (unless the stream has ended: then everything goes, so no sample is dropped)."""

    def __init__(self, samples: Iterator[DecodedSample], *, capacity: int, window: int, state: list[int] | None = None):
        self.samples, self.capacity, self.window = samples, capacity, window
        self.next_pos = 0  # stream position of the next sample to read
        self._pending: list[DecodedSample] = []  # read, not in a row yet, in stream order
        self._ready: deque[list[DecodedSample]] = deque()
        self._done = False
        if state:
            self._restore(state)

    # --- checkpoint state: [T, W, next_pos, n, *pending positions, rows, (len, *positions) per row]
    def state(self) -> list[int]:
        """The packer's resumable state as flat ints: capacity, window, the next stream position, the samples read
        but not yet placed and the rows made but not yet taken (by stream position); `Packer(state=...)` restores it."""
        out = [
            self.capacity,
            self.window,
            self.next_pos,
            len(self._pending),
            *(s.position for s in self._pending),
            len(self._ready),
        ]
        for row in self._ready:
            out += [len(row), *(s.position for s in row)]
        return out

    @staticmethod
    def resume_start(state: list[int]) -> int:
        """Where the stream must restart to re-read every sample the state still holds."""
        return min([state[2], *_state_positions(state)])

    def _restore(self, state: list[int]) -> None:
        capacity, window, next_pos = state[:3]
        if (capacity, window) != (self.capacity, self.window):
            from trainer.config import ConfigError

            raise ConfigError(
                f"the checkpoint was packed with --pack-to {capacity} --pack-window {window}; "
                f"resume with the same values (got {self.capacity}, {self.window}) or use --no-resume"
            )
        wanted = set(_state_positions(state))
        self.next_pos = self.resume_start(state)
        got = {}
        while self.next_pos < next_pos:  # re-read from the oldest held sample; samples already taken are skipped
            s = self._read()
            if s is None:
                raise DataError(
                    f"stream ended at position {self.next_pos} while restoring packing state up to "
                    f"{next_pos}: the shards changed since the checkpoint"
                )
            if s.position in wanted:
                got[s.position] = s
        n = state[3]
        self._pending = [got[p] for p in state[4 : 4 + n]]
        k = 4 + n
        for _ in range(state[k]):
            m = state[k + 1]
            self._ready.append([got[p] for p in state[k + 2 : k + 2 + m]])
            k += 1 + m

    # --- rows
    def _read(self) -> DecodedSample | None:
        if self._done:
            return None
        s = next(self.samples, None)
        if s is None:
            self._done = True
            return None
        if s.position != self.next_pos:
            raise DataError(f"sample stream out of order: got position {s.position}, expected {self.next_pos}")
        if s.num_tokens > self.capacity:
            raise DataError(
                f"sample {s.id} has {s.num_tokens} tokens, more than --pack-to {self.capacity}: "
                "rebuild the shards with --seq-len <= the pack size or raise --pack-to"
            )
        self.next_pos += 1
        return s

    def next_row(self) -> list[DecodedSample] | None:
        """The next packed row, or None once the stream and the window are exhausted."""
        while not self._ready:
            while len(self._pending) < self.window and (s := self._read()) is not None:
                self._pending.append(s)
            if not self._pending:
                return None
            self._pack()
        return self._ready.popleft()

    def _pack(self) -> None:
        lengths = [s.num_tokens for s in self._pending]
        bins = best_fit_decreasing(lengths, self.capacity)
        keep: set[int] = set()
        if not self._done:
            limit = self.window // 2
            for b in sorted(range(len(bins)), key=lambda b: (sum(lengths[i] for i in bins[b]), b)):
                if sum(lengths[i] for i in bins[b]) >= CARRY_BELOW * self.capacity or len(keep) + len(bins[b]) > limit:
                    break
                keep.update(bins[b])
        rows = [[self._pending[i] for i in sorted(b)] for b in bins if not keep.intersection(b)]
        # Best-fit decreasing opens rows longest first, and the longest samples of a window are often related (the
        # late steps of one split trajectory): hand the rows out in a fixed pseudo-random order instead, so those
        # rows do not all land in one step. Keyed by stream position: deterministic, and resume keeps _ready as is.
        self._ready.extend(sorted(rows, key=lambda row: _mix(row[0].position)))
        self._pending = [s for i, s in enumerate(self._pending) if i in keep]


def _mix(position: int) -> int:
    """splitmix64 of a stream position: a fixed pseudo-random sort key."""
    z = (position + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _state_positions(state: list[int]) -> list[int]:
    n = state[3]
    out = list(state[4 : 4 + n])
    k = 4 + n
    for _ in range(state[k]):
        m = state[k + 1]
        out += state[k + 2 : k + 2 + m]
        k += 1 + m
    return out


def collate_packed(rows: list[list[DecodedSample]], spec: CollateSpec, *, isolate: bool = True) -> Batch:
    """Packed rows -> one Batch of a single flat row (rows laid end to end: no padding at all). position_ids are
    [4, 1, N]: row 0 the per-sample text positions 0..n-1, rows 1-3 the stored MRoPE rows, which also start at 0
    per sample. Each sample's first token is never a target (it would be predicted from the previous sample).
    `isolate=False` keeps text positions running across samples: the broken variant the parity test must catch."""
    samples = [s for row in rows for s in row]
    assert samples, "collate_packed needs at least one sample; empty micro-batches go through collate([])"
    lens = np.array([s.num_tokens for s in samples], dtype=np.int64)
    starts = np.cumsum(lens) - lens
    n = int(lens.sum())
    ids = np.concatenate([s.input_ids for s in samples])
    mm = np.concatenate([s.mm_token_type_ids for s in samples])
    check_tokens(ids, mm, samples, spec)
    loss = np.concatenate([s.loss_mask for s in samples])
    loss[starts] = 0
    pos = np.empty((4, n), dtype=np.int32)
    pos[1:] = np.concatenate([s.position_ids for s in samples], axis=1)
    pos[0] = np.arange(n) - np.repeat(starts, lens) if isolate else np.arange(n)
    images, index, grids, videos, vgrids, seconds = media(samples)
    # Same reason as in collate: every rank runs the same vision passes in every forward.
    extra, fill = placeholders(spec, image=not images, video=spec.videos and not videos)
    images, index, grids = fill.get("images", images), fill.get("index", index), fill.get("grids", grids)
    videos, vgrids, seconds = fill.get("videos", videos), fill.get("vgrids", vgrids), fill.get("seconds", seconds)
    for token, kind in extra:
        ids, mm, loss = np.append(ids, token), np.append(mm, kind), np.append(loss, 0)
        pos = np.concatenate([pos, pos[:, -1:] + 1], axis=1)  # continues the last sample, which never sees it
    image_rows = (0,) * len(index)  # one flat row
    vision, images = host_inputs(spec, samples, fill, ids[None], mm[None], (images, index, image_rows))
    return Batch(
        vision=vision,
        filler=len(extra),
        input_ids=torch.from_numpy(ids[None]),
        loss_mask=torch.from_numpy(loss[None]),
        lengths=torch.tensor([len(ids)]),
        position_ids=torch.from_numpy(pos[:, None]),
        mm_token_type_ids=torch.from_numpy(mm[None]),
        image_grid_thw=torch.from_numpy(np.concatenate(grids).astype(np.int64)),
        images=[torch.as_tensor(im) for im in images],
        image_index=index,
        **video_fields(videos, vgrids, seconds),
        sample_ids=[s.id for s in samples],
        positions=[s.position for s in samples],
        num_tokens=n,
        num_trained=int(np.count_nonzero(loss)),
        rows=len(rows),
        sources=tuple(s.source for s in samples),
        sample_tokens=tuple(s.num_tokens for s in samples),
        image_rows=image_rows,
    )


def empty_state(capacity: int, window: int) -> list[int]:
    """The state of a packer that has read nothing: what a checkpoint taken at an epoch's end holds."""
    return [capacity, window, 0, 0, 0]


def check_packing(*, pack_to: int, pack_window: int, manifest: dict | None, model_type: str, world: int = 1) -> str:
    """Start-up checks of --pack-to against the dataset and the model; returns the log line, whose fill expectation
    counts what one of `world` ranks reads (a window never holds more than a rank's epoch)."""
    from trainer.config import ConfigError

    refusal = packing_refusal(model_type)
    if refusal:
        raise ConfigError(refusal)
    if model_type not in PACKABLE_MODELS:
        raise ConfigError(
            f"--pack-to: model type {model_type!r} has no packed-sequence path this trainer has "
            f"verified (supported: {', '.join(PACKABLE_MODELS)}); train it without --pack-to"
        )
    seq_len = ((manifest or {}).get("config") or {}).get("seq_len")
    if seq_len is not None and int(seq_len) > pack_to:
        raise ConfigError(
            f"--pack-to {pack_to} is shorter than the dataset's seq_len {seq_len}: a sample could not "
            f"fit a row; use --pack-to >= {seq_len} or rebuild with --seq-len <= {pack_to}"
        )
    shards = (manifest or {}).get("shards") or []
    samples, tokens = sum(s["num_samples"] for s in shards), sum(s["num_tokens"] for s in shards)
    expect = "expected fill unknown without a manifest"
    if samples and tokens:
        per_rank = samples / world
        epoch = per_rank * tokens / samples / pack_to  # one rank's epoch, in rows' worth
        rows = min(pack_window, per_rank) * tokens / samples / pack_to
        expect = f"mean sample {tokens / samples:.0f} tokens, so a window holds {rows:.1f} rows' worth: "
        if epoch < 4:  # the whole epoch is its own last rows: only a bigger dataset (or fewer ranks) fills them
            expect += (
                f"expected a low fill (a rank's whole epoch is {epoch:.1f} rows' worth, all of them the "
                "epoch's last rows)"
            )
        elif rows >= 4:
            expect += f"expected fill >= {CARRY_BELOW:.2f} (except the epoch's last rows)"
        else:
            expect += f"expected a lower fill (raise --pack-window to {4 * pack_to * samples / tokens:.0f} or more)"
    return (
        f"trainer: packing whole samples into rows of <= {pack_to} tokens, best-fit decreasing over a window of "
        f"{pack_window} samples; rows under {CARRY_BELOW:.0%} full wait for the next window; {expect} "
        "(pack_fill per step in metrics.jsonl)"
    )

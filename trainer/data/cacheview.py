"""What the readers of a rank's shard cache (the training process or its DataLoader workers) share with its fetcher
(cache.py), in shared memory: each shard's state, each reader's position and the position it waits at, the
fetcher's heartbeat. A reader waits for a shard's file; a wait in which nothing moves for `stall_s` (no reader
advanced, the fetcher neither started, landed nor received a byte) ends in one line naming the shard and the
readers' positions, never in a silent hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.errors import DataError

MISSING, READY, FAILED = 0, 1, 2
MESSAGE_BYTES = 2048  # the failed fetch's line, shared with the readers
MAX_WORKERS = 256
POLL_S = 0.005
STALL_S = 600.0  # how long a reader waits on a shard while nothing moves before the run stops naming it


@dataclass
class CacheView:
    """Per shard (flat id over the sources) its file and state, per reader the position it reads next and the one it
    waits at; the fetcher's beat. Shared tensors, so that they cross to the DataLoader workers."""

    files: list[str]  # flat id -> local path (a local shard's own path)
    names: list[str]  # flat id -> the shard's URL, as a stall names it
    state: torch.Tensor  # uint8 [shards], shared: MISSING / READY / FAILED
    progress: torch.Tensor  # int64 [MAX_WORKERS], shared: each reader's next position (the end once done)
    waiting: torch.Tensor  # int64 [MAX_WORKERS], shared: the position each reader waits at for its shard, else -1
    beat: torch.Tensor  # int64 [1], shared: changes whenever the fetcher starts, lands or receives part of a shard
    offsets: list[int]  # source s, shard k -> flat id offsets[s] + k
    message: torch.Tensor  # uint8 [MESSAGE_BYTES], shared: the one-line error of the FAILED shards (UTF-8, 0-padded),
    # in memory, so that a fetcher that failed on a full disk can still tell the readers why
    evicts: bool = True  # False where every shard is local (hashed in place, never evicted): readers skip that check
    readers: int = 1  # how many readers the fetcher serves (set by ShardCache.begin)
    stall_s: float = STALL_S
    _me: tuple[int, int] = (0, 0)  # this process's reader and the position it last said it reads

    @classmethod
    def make(cls, files: list[str], names: list[str], offsets: list[int], *, evicts: bool, stall_s: float):
        """A view over these shards, its tensors in shared memory."""
        shared = [
            torch.zeros(len(files), dtype=torch.uint8),
            torch.zeros(MAX_WORKERS, dtype=torch.int64),
            torch.full((MAX_WORKERS,), -1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
        ]
        state, progress, waiting, beat = (t.share_memory_() for t in shared)
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8).share_memory_()
        return cls(files, names, state, progress, waiting, beat, offsets, message, evicts=evicts, stall_s=stall_s)

    def flat(self, source: int, shard: int) -> int:
        """Source `source`'s shard `shard` -> its flat id."""
        return self.offsets[source] + shard

    def at(self, worker: int, position: int) -> None:
        """Reader `worker` reads `position` next (what the fetcher evicts behind and fetches ahead of)."""
        self.progress[worker] = position
        self._me = (worker, position)

    def try_path(self, j: int) -> str | None:
        """Shard j's local file if the fetcher has it, else None, and the fetcher is told this reader waits for it
        (it fetches what a reader waits on whatever the slowest reader's position); a failed fetch raises here."""
        s = int(self.state[j])
        if s == READY:
            self.waiting[self._me[0]] = -1
            return self.files[j]
        if s == FAILED:
            message = bytes(self.message.numpy()).rstrip(b"\0").decode("utf-8", "replace")
            raise DataError(message or f"{self.files[j]}: the shard cache failed to fetch it")
        self.waiting[self._me[0]] = self._me[1]
        return None

    def path(self, j: int) -> str:
        """Shard j's local file, once the fetcher has it (waits); a failed fetch is raised here, as its one line,
        and so is a wait in which nothing moved for `stall_s`."""
        seen, since = None, time.monotonic()
        try:
            while (path := self.try_path(j)) is None:
                now = self._moves()
                if now != seen:
                    seen, since = now, time.monotonic()
                elif time.monotonic() - since > self.stall_s:
                    raise DataError(self._stalled(j))
                time.sleep(POLL_S)
            return path
        finally:
            self.waiting[self._me[0]] = -1

    def _moves(self) -> tuple[int, int]:
        return int(self.beat[0]), int(self.progress[: self.readers].sum())

    def _stalled(self, j: int) -> str:
        n = self.readers
        at = self.progress[:n].tolist()
        waits = [f"{w}@{p}" for w, p in enumerate(self.waiting[:n].tolist()) if p >= 0]
        return (
            f"{self.names[j]}: the shard cache has not made this shard ready in {self.stall_s:g} s and nothing moved "
            f"meanwhile (readers' next positions {at}, waiting (reader@position) {', '.join(waits) or 'none'}); "
            "a reader stopped or the cache is stuck: the run stops rather than wait forever, and a rerun resumes "
            "from the last checkpoint"
        )

    def gone(self, j: int) -> bool:
        """Whether shard j's local file is not there to read (evicted, not fetched yet, or failed)."""
        return int(self.state[j]) != READY

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(state, progress, waiting, beat, message) as numpy views of the shared memory: what the fetcher thread
        reads and writes, so that it runs no torch op (a torch op's first call in a thread initializes statics under
        locks that a fork must not copy held)."""
        return tuple(t.numpy() for t in (self.state, self.progress, self.waiting, self.beat, self.message))

"""What the readers of a rank's shard cache (the training process or its DataLoader workers) share with its fetcher
(cache.py), in shared memory: each shard's state, each reader's position and the position it waits at (the
fetcher fetches what a reader waits on, whatever the slowest reader's position).
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


@dataclass
class CacheView:
    """Per shard (flat id over the sources) its file and state, per reader the position it reads next and the one it
    waits at. Shared tensors, so that they cross to the DataLoader workers."""

    files: list[str]  # flat id -> local path (a local shard's own path)
    state: torch.Tensor  # uint8 [shards], shared: MISSING / READY / FAILED
    progress: torch.Tensor  # int64 [MAX_WORKERS], shared: each reader's next position (the end once done)
    waiting: torch.Tensor  # int64 [MAX_WORKERS], shared: the position each reader waits at for its shard, else -1
    offsets: list[int]  # source s, shard k -> flat id offsets[s] + k
    message: torch.Tensor  # uint8 [MESSAGE_BYTES], shared: the one-line error of the FAILED shards (UTF-8, 0-padded),
    # in memory, so that a fetcher that failed on a full disk can still tell the readers why
    evicts: bool = True  # False where every shard is local (hashed in place, never evicted): readers skip that check
    _me: tuple[int, int] = (0, 0)  # this process's reader and the position it last said it reads

    @classmethod
    def make(cls, files: list[str], offsets: list[int], *, evicts: bool):
        """A view over these shards, its tensors in shared memory."""
        shared = [
            torch.zeros(len(files), dtype=torch.uint8),
            torch.zeros(MAX_WORKERS, dtype=torch.int64),
            torch.full((MAX_WORKERS,), -1, dtype=torch.int64),
        ]
        state, progress, waiting = (t.share_memory_() for t in shared)
        message = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8).share_memory_()
        return cls(files, state, progress, waiting, offsets, message, evicts=evicts)

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
        """Shard j's local file, once the fetcher has it (waits); a failed fetch is raised here, as its one line."""
        try:
            while (path := self.try_path(j)) is None:
                time.sleep(POLL_S)
            return path
        finally:
            self.waiting[self._me[0]] = -1

    def gone(self, j: int) -> bool:
        """Whether shard j's local file is not there to read (evicted, not fetched yet, or failed)."""
        return int(self.state[j]) != READY

    def arrays(self) -> tuple[np.ndarray, ...]:
        """(state, progress, waiting, message) as numpy views of the shared memory: what the fetcher thread
        reads and writes, so that it runs no torch op (a torch op's first call in a thread initializes statics under
        locks that a fork must not copy held)."""
        return tuple(t.numpy() for t in (self.state, self.progress, self.waiting, self.message))

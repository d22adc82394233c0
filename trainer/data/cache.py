"""The rank's shard cache: its epoch schedule over remote shards -> each shard's reads, grouped per pass of its
source into intervals [first, last position] -> a fetcher thread that copies shards in the order of their intervals,
up to `prefetch` shards ahead of the read position, into --shard-cache, checked against the manifest's sha256, and
under --shard-cache-limit evicts a shard once no fetched interval of it reaches the slowest reader's position.
Local shards that this run dir has not hashed yet go through the same gate, in place: hashed in read order, ahead of
the readers, never copied, evicted or counted against the limit.
DataLoader workers wait for a shard's file and report their positions through shared memory (CacheView).
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer import locks
from trainer.config import cache_limit_bytes, default
from trainer.data.errors import DataError
from trainer.data.integrity import ShardCheck
from trainer.data.order import RankSource, Schedule
from trainer.data.sources import REMOTE_OR_PIPE
from trainer.data.storage import StorageError, fetch, sha256_file
from vlmprep_schemas.boundary import UnsafeWrite

MISSING, READY, FAILED = 0, 1, 2
MESSAGE_BYTES = 2048  # the failed fetch's line, shared with the readers
LOCK_NAME = "cache.lock"  # in the rank's cache dir, held by the run that uses it
SAVE_S = 30  # the record of hashed local shards is written at most this often while the cache hashes them
MAX_WORKERS = 256
POLL_S = 0.005


@dataclass
class CacheView:
    """What the readers (the training process or its DataLoader workers) share with the fetcher: per shard (flat
    id over the sources) its file and state, per worker the position it reads next."""

    files: list[str]  # flat id -> local path (a local shard's own path)
    state: torch.Tensor  # uint8 [shards], shared: MISSING / READY / FAILED
    progress: torch.Tensor  # int64 [MAX_WORKERS], shared: each reader's next position (the end once done)
    offsets: list[int]  # source s, shard k -> flat id offsets[s] + k
    message: torch.Tensor  # uint8 [MESSAGE_BYTES], shared: the one-line error of the FAILED shards (UTF-8, 0-padded),
    # in memory, so that a fetcher that failed on a full disk can still tell the readers why
    evicts: bool = True  # False where every shard is local (hashed in place, never evicted): readers skip that check

    def flat(self, source: int, shard: int) -> int:
        """Source `source`'s shard `shard` -> its flat id."""
        return self.offsets[source] + shard

    def at(self, worker: int, position: int) -> None:
        """Reader `worker` reads `position` next (what the fetcher evicts behind and fetches ahead of)."""
        self.progress[worker] = position

    def path(self, j: int) -> str:
        """Shard j's local file, once the fetcher has it (waits); a failed fetch is raised here, as its one line."""
        while True:
            s = int(self.state[j])
            if s == READY:
                return self.files[j]
            if s == FAILED:
                message = bytes(self.message.numpy()).rstrip(b"\0").decode("utf-8", "replace")
                raise DataError(message or f"{self.files[j]}: the shard cache failed to fetch it")
            time.sleep(POLL_S)

    def gone(self, j: int) -> bool:
        """Whether shard j's local file is not there to read (evicted, not fetched yet, or failed)."""
        return int(self.state[j]) != READY


def intervals(sources: list[RankSource], order: Schedule, start: int, gated: np.ndarray,
              offsets: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat shard, first, last position) of each gated shard's reads (remote, or local and not hashed yet) at or after
    `start`, one interval per pass of its source (a source that repeats reads a shard again in its next pass), sorted
    by first position."""
    n = len(order)
    if n <= start:
        return (np.zeros(0, np.int64),) * 3
    src = order.source.astype(np.int64)
    flat = np.asarray(offsets, dtype=np.int64)[src] + order.shard
    passes = np.zeros(n, dtype=np.int64)
    for s, rs in enumerate(sources):  # reads of source s so far // its reads per pass
        at = np.flatnonzero(src == s)
        total = sum(ix.num_samples for ix in rs.indexes)
        per_pass = max(len(range(rs.stride[0], total, rs.stride[1])), 1)
        passes[at] = np.arange(len(at)) // per_pass
    pos = np.arange(n, dtype=np.int64)
    keep = (pos >= start) & gated[flat]
    flat, passes, pos = flat[keep], passes[keep], pos[keep]
    key = flat * (passes.max(initial=0) + 1) + passes
    uniq, inverse = np.unique(key, return_inverse=True)
    first = np.full(len(uniq), n, dtype=np.int64)
    last = np.full(len(uniq), -1, dtype=np.int64)
    np.minimum.at(first, inverse, pos)
    np.maximum.at(last, inverse, pos)
    shard = np.zeros(len(uniq), dtype=np.int64)
    shard[inverse] = flat
    by = np.argsort(first, kind="stable")
    return shard[by], first[by], last[by]


class ShardCache:
    """Owns --shard-cache/rank-NNNNN for one rank: begin(schedule, start) starts a fetcher for that epoch from that
    position; close() stops it. Files that stay valid are kept across epochs and runs (re-checked by sha256 once).
    `check`: the rank's ShardCheck, whose deferred local shards are hashed here before a reader opens them."""

    def __init__(self, sources: list[RankSource], root: Path, *,
                 limit: int = cache_limit_bytes(default("shard_cache_limit")),
                 prefetch: int = default("shard_prefetch"), threads: int = 4, check: ShardCheck | None = None):
        self.sources, self.root, self.limit = sources, Path(root), limit
        self.prefetch, self.threads = max(prefetch, 1), max(threads, 1)
        self.shards = [sh for src in sources for sh in src.shards]
        self.offsets = list(np.cumsum([0] + [len(src.shards) for src in sources])[:-1].tolist())
        self.remote = np.array([sh.url.startswith(REMOTE_OR_PIPE) for sh in self.shards], dtype=bool)
        self.check = check
        deferred = check.deferred if check is not None else {}
        # what readers wait for: remote shards (fetched) and local ones this run dir has not hashed yet
        self.gated = self.remote | np.array([sh.url in deferred for sh in self.shards], dtype=bool)
        files = [ix.path for src in sources for ix in src.indexes]
        self.view = CacheView(files, torch.zeros(len(files), dtype=torch.uint8).share_memory_(),
                              torch.zeros(MAX_WORKERS, dtype=torch.int64).share_memory_(), self.offsets,
                              torch.zeros(MESSAGE_BYTES, dtype=torch.uint8).share_memory_(),
                              evicts=bool(self.remote.any()))
        self._lock = -1  # the rank's cache dir lock (root/LOCK_NAME), held from the first begin() to end()
        self.verified: set[int] = set()  # gated shards this process has fetched or hashed and checked
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: DataError | None = None
        self.fetched = self.evicted = self.hashed = 0
        self._saved = time.monotonic()
        self.fetch_order: list[int] = []  # shards (flat ids) in the order fetches started
        self.first_ready_s: float | None = None  # seconds from begin() until the first remote shard was local

    @property
    def size_bytes(self) -> int:
        """What the cache dir holds now (shard files and partial fetches): what --shard-cache-limit bounds."""
        return sum(p.stat().st_size for p in self.root.glob("*") if p.is_file())

    def begin(self, order: Schedule, start: int, num_workers: int) -> None:
        """Start fetching for the reads of `order` from position `start` on, by `num_workers` readers (stops a
        previous fetcher first; shards still verified in the cache dir are kept)."""
        self.close()
        self.root.mkdir(parents=True, exist_ok=True)
        if self._lock < 0:
            self._own()
        v = self.view
        v.message.zero_()
        for j, path in enumerate(v.files):
            ok = not self.gated[j] or (j in self.verified and (not self.remote[j] or os.path.isfile(path)))
            v.state[j] = READY if ok else MISSING
        v.progress.fill_(len(order))
        v.progress[:max(num_workers, 1)] = start
        self._stop.clear()
        plan = intervals(self.sources, order, start, self.gated, self.offsets)
        self._thread = threading.Thread(target=self._run, args=(plan, max(num_workers, 1)), daemon=True,
                                        name="shard-cache")
        self._thread.start()

    def _own(self) -> None:
        """One run per rank cache dir: two would continue each other's .part files and evict each other's shards."""
        try:
            self._lock, who = locks.take(self.root / LOCK_NAME)
        except UnsafeWrite as e:
            raise DataError(str(e)) from None
        if who:
            raise DataError(f"{self.root} is in use by another trainer ({who}): two runs on one shard cache dir would "
                            "continue each other's partial fetches; wait for it to end, or pass another --shard-cache")

    def end(self) -> None:
        """close(), and let the cache dir go (the run is over)."""
        self.close()
        locks.release(self.root / LOCK_NAME, self._lock)
        self._lock = -1

    def close(self) -> None:
        """Stop the fetcher thread (the files stay, for the next begin); record the local shards it hashed."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.check is not None:
            self.check.save()

    # --- the fetcher thread
    def _size(self, j: int) -> int:
        return self.shards[j].num_bytes or 0

    def _fetch(self, j: int) -> None:
        if not self.remote[j]:  # a local shard: hashed in place
            self.check.verify_deferred(self.shards[j].url)
            return
        sh, path = self.shards[j], Path(self.view.files[j])
        if path.is_file() and (sh.sha256 is None and sh.num_bytes in (None, path.stat().st_size)
                               or sh.sha256 is not None and sha256_file(path) == sh.sha256):
            return  # left by an earlier run (a resume): checked, not fetched again
        path.unlink(missing_ok=True)
        fetch(sh.url, path, size=sh.num_bytes, sha256=sh.sha256, stopped=self._stop.is_set)

    def _fail(self, j: int, message: str) -> None:
        """Shard j failed: every shard not yet local fails with its line, so no reader waits for a fetcher that
        stopped; the first reader to reach one raises it. Nothing is written to disk (it may be the full one)."""
        data = message.encode("utf-8")[:MESSAGE_BYTES]
        self.view.message.zero_()
        self.view.message[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.error = DataError(message)
        for k in range(len(self.view.files)):
            if int(self.view.state[k]) != READY:
                self.view.state[k] = FAILED

    def _run(self, plan: tuple[np.ndarray, np.ndarray, np.ndarray], readers: int) -> None:
        try:
            self._loop(plan, readers)
        except Exception as e:  # noqa: BLE001 - never leave a reader waiting on a dead thread
            self._fail(-1, f"the shard cache stopped: {type(e).__name__}: {e}")

    def _loop(self, plan: tuple[np.ndarray, np.ndarray, np.ndarray], readers: int) -> None:
        shard, first, last = (a.tolist() for a in plan)
        v, t0 = self.view, time.perf_counter()
        held: dict[int, int] = {}  # shard local or being fetched -> last position a fetched interval reads
        # What an earlier epoch or run left here counts against the limit until it is needed (checked then) or
        # evicted first.
        leftover = {j: self._size(j) for j, path in enumerate(v.files)
                    if self.remote[j] and (os.path.isfile(path) or os.path.isfile(path + ".part"))}
        used = sum(leftover.values())
        inflight: dict[Future, int] = {}
        i = 0
        with ThreadPoolExecutor(self.threads, thread_name_prefix="shard-fetch") as pool:
            while not self._stop.is_set():
                for f in [f for f in inflight if f.done()]:
                    j = inflight.pop(f)
                    e = f.exception()
                    if e is not None:
                        self._fail(j, str(e) if isinstance(e, (StorageError, DataError))
                                   else f"{self.shards[j].url}: fetch failed: {type(e).__name__}: {e}")
                        return
                    if self._stop.is_set():
                        return
                    self.verified.add(j)
                    v.state[j] = READY
                    if self.remote[j]:
                        self.fetched += 1
                        if self.first_ready_s is None:
                            self.first_ready_s = time.perf_counter() - t0
                    else:
                        self.hashed += 1
                        if time.monotonic() - self._saved > SAVE_S:  # a kill loses at most this much hashing
                            self.check.save()
                            self._saved = time.monotonic()
                if i == len(shard) and not inflight:
                    return
                pos = int(v.progress[:readers].min())
                ahead = i - bisect.bisect_right(first, pos)  # fetched intervals that no reader has reached yet
                while i < len(shard) and len(inflight) < self.threads and (first[i] <= pos or ahead < self.prefetch):
                    j = shard[i]
                    if not self.remote[j]:  # a local shard to hash: no copy, no limit, never evicted
                        if int(v.state[j]) != READY and j not in inflight.values():
                            inflight[pool.submit(self._fetch, j)] = j
                            self.fetch_order.append(j)
                    elif j in held:
                        held[j] = max(held[j], last[i])
                    else:
                        used -= leftover.pop(j, 0)
                        need = self._size(j)
                        if self.limit and used + need > self.limit:
                            for k in list(leftover):
                                used -= self._evict(k, leftover)
                            busy = set(inflight.values())
                            for k in sorted((k for k, z in held.items() if z < pos and k not in busy), key=held.get):
                                if used + need <= self.limit:
                                    break
                                used -= self._evict(k, held)
                        if self.limit and used + need > self.limit:
                            if first[i] <= pos and not inflight and all(z >= pos for z in held.values()):
                                self._fail(j, f"{self.shards[j].url}: needed now, but --shard-cache-limit "
                                              f"({self.limit} bytes for this rank) is full of {len(held)} shards "
                                              "still being read: raise the limit or lower --shuffle-span")
                                return
                            break
                        used += need
                        held[j] = last[i]
                        if int(v.state[j]) != READY:
                            inflight[pool.submit(self._fetch, j)] = j
                            self.fetch_order.append(j)
                    ahead += first[i] > pos
                    i += 1
                if inflight:
                    wait(list(inflight), timeout=0.05, return_when=FIRST_COMPLETED)
                else:
                    time.sleep(POLL_S)

    def _evict(self, j: int, table: dict) -> int:
        self.view.state[j] = MISSING
        Path(self.view.files[j]).unlink(missing_ok=True)
        Path(self.view.files[j] + ".part").unlink(missing_ok=True)
        self.verified.discard(j)
        self.evicted += 1
        del table[j]
        return self._size(j)


def remote_shards(sources: list[RankSource]) -> bool:
    """Whether any shard of the rank's sources is remote (a URL or a pipe), so that a shard cache is needed."""
    return any(sh.url.startswith(REMOTE_OR_PIPE) for src in sources for sh in src.shards)

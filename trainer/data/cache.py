"""The rank's shard cache: its epoch schedule over remote shards -> each shard's reads, grouped per pass of its
source into intervals [first, last position] -> a fetcher thread that copies shards in the order of their intervals,
up to `prefetch` shards ahead of the read position and every one a reader waits on, into --shard-cache, checked
against the manifest's sha256, and under --shard-cache-limit evicts a shard once no fetched interval of it reaches the
slowest reader's position. Local shards that this run dir has not hashed yet go through the same gate, in place:
hashed in read order, ahead of the readers, never copied, evicted or counted against the limit.
DataLoader workers wait for a shard's file and report their positions through shared memory (cacheview.py); the
fetcher's threads step through a ForkGate (forks.py), so that forking those workers never copies a lock they hold.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer import locks
from trainer.config import cache_limit_bytes, default
from trainer.data.cacheview import FAILED, MESSAGE_BYTES, MISSING, POLL_S, READY, STALL_S, CacheView
from trainer.data.errors import DataError
from trainer.data.forks import ForkGate
from trainer.data.integrity import ShardCheck
from trainer.data.order import RankSource, Schedule
from trainer.data.sources import REMOTE_OR_PIPE
from trainer.data.storage import StorageError, fetch, sha256_file
from vlmprep_schemas.boundary import UnsafeWrite, state_dir

LOCK_NAME = "cache.lock"  # in the rank's cache dir, held by the run that uses it
SAVE_S = 30  # the record of hashed local shards is written at most this often while the cache hashes them


def intervals(
    sources: list[RankSource], order: Schedule, start: int, gated: np.ndarray, offsets: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


@dataclass
class _Pass:
    """One fetcher pass over an epoch's plan from a start position, by `readers` readers: its intervals (flat shard,
    first and last position, in order of first), the next one to admit, and what the cache holds meanwhile."""

    shard: list[int]
    first: list[int]
    last: list[int]
    readers: int
    t0: float  # when the pass began (first_ready_s counts from it)
    leftover: dict[int, int]  # shard left by an earlier epoch or run -> its bytes, until needed or evicted
    used: int  # bytes counted against the limit
    held: dict[int, int] = field(default_factory=dict)  # shard local or being fetched -> last position it is read at
    inflight: dict[Future, int] = field(default_factory=dict)  # fetch -> its shard
    i: int = 0  # the next interval to admit


class ShardCache:
    """Owns --shard-cache/rank-NNNNN for one rank: begin(schedule, start) starts a fetcher for that epoch from that
    position; close() stops it. Files that stay valid are kept across epochs and runs (re-checked by sha256 once).
    `check`: the rank's ShardCheck, whose deferred local shards are hashed here before a reader opens them.
    `stall_s`: how long a reader waits while nothing moves before it stops the run naming its shard."""

    def __init__(
        self,
        sources: list[RankSource],
        root: Path,
        *,
        limit: int = cache_limit_bytes(default("shard_cache_limit")),
        prefetch: int = default("shard_prefetch"),
        threads: int = 4,
        check: ShardCheck | None = None,
        stall_s: float = STALL_S,
    ):
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
        self.view = CacheView.make(
            files, [sh.url for sh in self.shards], self.offsets, evicts=bool(self.remote.any()), stall_s=stall_s
        )
        # the fetcher's side of the shared memory, as numpy views (its thread runs no torch op)
        self._state, self._progress, self._waiting, self._beat, self._message = self.view.arrays()
        self._gate = ForkGate()  # the fetcher's threads step through it: a fork never copies them mid-step
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
        p = self.plan(order, start, num_workers)
        self._thread = threading.Thread(target=self._run, args=(p,), daemon=True, name="shard-cache")
        self._thread.start()

    def plan(self, order: Schedule, start: int, num_workers: int) -> _Pass:
        """What begin() starts its fetcher thread on (the thread steps it: step()): the readers' shared state
        reset for `order` from `start` on, and the pass over its intervals. Stops a previous fetcher first."""
        self.close()
        try:  # the rank's dir: a link planted at its name is refused, never fetched into or evicted from
            state_dir(self.root)
        except UnsafeWrite as e:
            raise DataError(str(e)) from None
        if self._lock < 0:
            self._own()
        v, readers = self.view, max(num_workers, 1)
        self._message[:] = 0
        for j, path in enumerate(v.files):
            ok = not self.gated[j] or (j in self.verified and (not self.remote[j] or os.path.isfile(path)))
            self._state[j] = READY if ok else MISSING
        self._progress.fill(len(order))
        self._progress[:readers] = start
        self._waiting.fill(-1)
        v.readers = readers
        self._stop.clear()
        shard, first, last = (a.tolist() for a in intervals(self.sources, order, start, self.gated, self.offsets))
        # What an earlier epoch or run left here counts against the limit until it is needed (checked then) or
        # evicted first.
        leftover = {
            j: self._size(j)
            for j, path in enumerate(v.files)
            if self.remote[j] and (os.path.isfile(path) or os.path.isfile(path + ".part"))
        }
        t0 = time.perf_counter()
        return _Pass(shard, first, last, readers, t0=t0, leftover=leftover, used=sum(leftover.values()))

    def _own(self) -> None:
        """One run per rank cache dir: two would continue each other's .part files and evict each other's shards."""
        try:
            self._lock, who = locks.take(self.root / LOCK_NAME)
        except UnsafeWrite as e:
            raise DataError(str(e)) from None
        if who:
            raise DataError(
                f"{self.root} is in use by another trainer ({who}): two runs on one shard cache dir would "
                "continue each other's partial fetches; wait for it to end, or pass another --shard-cache"
            )

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

    def _task(self, j: int) -> None:
        with self._gate.step():  # a pool thread: its fetch or hash, parked between chunks while the process forks
            self._fetch(j)

    def _breathe(self) -> None:
        """Between two chunks of a fetch or a hash: readers see the fetcher move; a fork waiting for it happens."""
        self._beat[0] += 1
        self._gate.breathe()

    def _fetch(self, j: int) -> None:
        if not self.remote[j]:  # a local shard: hashed in place
            self.check.verify_deferred(self.shards[j].url, between=self._breathe)
            return
        sh, path = self.shards[j], Path(self.view.files[j])
        if path.is_file() and (
            sh.sha256 is None
            and sh.num_bytes in (None, path.stat().st_size)
            or sh.sha256 is not None
            and sha256_file(path, between=self._breathe) == sh.sha256
        ):
            return  # left by an earlier run (a resume): checked, not fetched again
        path.unlink(missing_ok=True)
        fetch(
            sh.url,
            path,
            size=sh.num_bytes,
            sha256=sh.sha256,
            stopped=lambda: self._breathe() or self._stop.is_set(),
        )

    def _fail(self, j: int, message: str) -> None:
        """Shard j failed: every shard not yet local fails with its line, so no reader waits for a fetcher that
        stopped; the first reader to reach one raises it. Nothing is written to disk (it may be the full one)."""
        data = message.encode("utf-8")[:MESSAGE_BYTES]
        self._message[:] = 0
        self._message[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.error = DataError(message)
        self._state[self._state != READY] = FAILED

    def _run(self, p: _Pass) -> None:
        try:
            self._loop(p)
        except Exception as e:  # noqa: BLE001 - never leave a reader waiting on a dead thread
            self._fail(-1, f"the shard cache stopped: {type(e).__name__}: {e}")

    def _loop(self, p: _Pass) -> None:
        """The fetcher thread: steps the pass until it is done (or the cache stops), each step inside the fork gate,
        waiting between steps outside it."""
        with ThreadPoolExecutor(self.threads, thread_name_prefix="shard-fetch") as pool:
            while not self._stop.is_set():
                with self._gate.step():
                    if not self.step(p, pool):
                        return
                if p.inflight:
                    wait(list(p.inflight), timeout=0.05, return_when=FIRST_COMPLETED)
                else:
                    time.sleep(POLL_S)

    def step(self, p: _Pass, pool) -> bool:
        """One step of the fetcher: land the finished fetches, then admit the intervals due (a reader is at or past
        their first position, or waits at one) and those within `prefetch` of the slowest reader, evicting by the
        policy where the limit asks for room. False once the pass is done, or the cache failed. `pool`: what runs
        the fetches (submit(fn, j) -> Future)."""
        if not self._land(p) or (p.i == len(p.shard) and not p.inflight):
            return False
        pos = int(self._progress[: p.readers].min())
        due = max(pos, int(self._waiting[: p.readers].max()))  # a reader waits there: nothing else may fetch it
        return self._admit(p, pos, due, pool)

    # --- landing: fetches (and hashes) that finished
    def _land(self, p: _Pass) -> bool:
        """Marks each finished fetch READY for the readers; False where one failed (every waiting reader is told) or
        the cache is stopping."""
        for f in [f for f in p.inflight if f.done()]:
            j = p.inflight.pop(f)
            e = f.exception()
            if e is not None:
                self._fail(
                    j,
                    str(e)
                    if isinstance(e, (StorageError, DataError))
                    else f"{self.shards[j].url}: fetch failed: {type(e).__name__}: {e}",
                )
                return False
            if self._stop.is_set():
                return False
            self.verified.add(j)
            self._state[j] = READY
            self._beat[0] += 1
            if self.remote[j]:
                self.fetched += 1
                if self.first_ready_s is None:
                    self.first_ready_s = time.perf_counter() - p.t0
            else:
                self.hashed += 1
                if time.monotonic() - self._saved > SAVE_S:  # a kill loses at most this much hashing
                    self.check.save()
                    self._saved = time.monotonic()
        return True

    # --- admission: which intervals start fetching now
    def _admit(self, p: _Pass, pos: int, due: int, pool) -> bool:
        """Starts the fetches of the next intervals while a fetch thread is free and each is due (starts at or before
        `due`: the slowest reader's position `pos`, or where a reader waits) or within `prefetch` intervals of the
        readers; a remote shard only where the limit holds it. False where a shard the slowest reader needs now
        cannot fit (the cache fails, naming it)."""
        ahead = p.i - bisect.bisect_right(p.first, pos)  # fetched intervals that no reader has reached yet
        while p.i < len(p.shard) and len(p.inflight) < self.threads and (p.first[p.i] <= due or ahead < self.prefetch):
            j = p.shard[p.i]
            if not self.remote[j]:  # a local shard to hash: no copy, no limit, never evicted
                if self._state[j] != READY and j not in p.inflight.values():
                    self._submit(p, j, pool)
            elif j in p.held:
                p.held[j] = max(p.held[j], p.last[p.i])
            elif not self._hold(p, j, pos, pool):
                if p.first[p.i] <= pos and not p.inflight and all(z >= pos for z in p.held.values()):
                    self._fail(
                        j,
                        f"{self.shards[j].url}: needed now, but --shard-cache-limit ({self.limit} bytes "
                        f"for this rank) is full of {len(p.held)} shards still being read: raise the limit "
                        "or lower --shuffle-span",
                    )
                    return False
                return True  # no room yet: readers move on, and evictable shards with them
            ahead += p.first[p.i] > pos
            p.i += 1
        return True

    def _hold(self, p: _Pass, j: int, pos: int, pool) -> bool:
        """Counts remote shard j against the limit for the interval at p.i (room made by the eviction policy first)
        and fetches it unless it is still local; False where it does not fit."""
        p.used -= p.leftover.pop(j, 0)
        need = self._size(j)
        if self.limit and p.used + need > self.limit:
            self._make_room(p, need, pos)
        if self.limit and p.used + need > self.limit:
            return False
        p.used += need
        p.held[j] = p.last[p.i]
        if self._state[j] != READY:
            self._submit(p, j, pool)
        return True

    def _submit(self, p: _Pass, j: int, pool) -> None:
        p.inflight[pool.submit(self._task, j)] = j
        self.fetch_order.append(j)
        self._beat[0] += 1

    # --- the eviction policy
    def _make_room(self, p: _Pass, need: int, pos: int) -> None:
        """Frees room for `need` more bytes: what an earlier epoch or run left first, then the shards no reader needs
        any more (every fetched interval of theirs ends before the slowest reader's position, and none is being
        fetched), the one whose last read lies furthest back first."""
        for k in list(p.leftover):
            p.used -= self._evict(k, p.leftover)
        busy = set(p.inflight.values())
        for k in sorted((k for k, z in p.held.items() if z < pos and k not in busy), key=p.held.get):
            if p.used + need <= self.limit:
                break
            p.used -= self._evict(k, p.held)

    def _evict(self, j: int, table: dict) -> int:
        self._state[j] = MISSING
        Path(self.view.files[j]).unlink(missing_ok=True)
        Path(self.view.files[j] + ".part").unlink(missing_ok=True)
        self.verified.discard(j)
        self.evicted += 1
        del table[j]
        return self._size(j)


def remote_shards(sources: list[RankSource]) -> bool:
    """Whether any shard of the rank's sources is remote (a URL or a pipe), so that a shard cache is needed."""
    return any(sh.url.startswith(REMOTE_OR_PIPE) for src in sources for sh in src.shards)

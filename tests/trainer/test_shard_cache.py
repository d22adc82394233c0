"""The shard cache's promises to its readers (trainer/data/cache.py, cacheview.py, forks.py): no reader waits on a
shard that nothing will fetch, whatever the worker count, the positions and the cache limit; a wait in which
nothing moves ends in one line naming the shard and the readers' positions; and DataLoader workers are never forked
while one of the cache's threads is mid-step (a lock it holds would stay held in the worker forever)."""

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.trainer.conftest import deadline
from trainer.config import DataSpec
from trainer.data.errors import DataError
from trainer.data.order import schedule
from trainer.data.sources import plan_shards, resolve_data


@pytest.fixture(scope="module")
def memory_sources(dataset, tmp_path_factory):
    """The fixture dataset as a remote one (fsspec's memory://): the rank's sources, their cache dir, and the
    biggest shard's size."""
    import fsspec

    from trainer.data.pipeline import rank_sources

    fs = fsspec.filesystem("memory")
    for p in Path(dataset).rglob("*"):
        if p.is_file() and "tasks" not in p.parts:
            fs.pipe(f"memory://cache-props/{p.relative_to(dataset)}", p.read_bytes())
    root = tmp_path_factory.mktemp("cache-props")
    ds = resolve_data("memory://cache-props")
    sources, _ = rank_sources(
        (DataSpec(path="memory://cache-props"),), [ds], [plan_shards(ds.shards, 1)], rank=0, world=1, cache=root
    )
    return sources, root, max(s.num_bytes for s in sources[0].shards)


class _ManualPool:
    """The fetcher's pool, run by hand: a fetch starts when the test says (in-process, no threads)."""

    def __init__(self):
        self.jobs: list = []

    def submit(self, fn, *args):
        f = Future()
        self.jobs.append((f, fn, args))
        return f

    def run(self, k: int) -> None:
        f, fn, args = self.jobs.pop(k % len(self.jobs))
        try:
            fn(*args)
            f.set_result(None)
        except Exception as e:  # noqa: BLE001 - the fetcher lands it as a failed fetch
            f.set_exception(e)


class _Readers:
    """`workers` readers of a schedule from `start` as ScheduledStream splits it (reader w reads start + w,
    start + w + W, ...), each through the cache's view: at() then try_path(), reading on only once the shard is
    local. A reader in `stuck` stops for good at the position given (a worker that hangs, or that the DataLoader
    never asks for more): it keeps its position, and what it has not read yet stays needed."""

    def __init__(self, view, order, start: int, workers: int, stuck: dict[int, int]):
        self.view, self.order, self.n, self.W = view, order, len(order), workers
        self.pos = [start + w for w in range(workers)]
        self.stuck = stuck
        self.failed: set[int] = set()
        for w in range(workers):
            self._done_if_past(w)

    def _done_if_past(self, w: int) -> None:
        if self.pos[w] >= self.n:
            self.view.at(w, self.n)  # done: this reader holds no shard back

    def live(self, w: int) -> bool:
        return self.pos[w] < self.n and self.pos[w] < self.stuck.get(w, self.n) and w not in self.failed

    def shard(self, w: int) -> int:
        p = self.pos[w]
        return self.view.flat(int(self.order.source[p]), int(self.order.shard[p]))

    def act(self, w: int) -> bool:
        """Reader w reads on while its shards are local; whether it moved."""
        moved = False
        while self.live(w):
            self.view.at(w, self.pos[w])
            try:
                if self.view.try_path(self.shard(w)) is None:
                    break
            except DataError:  # the cache failed: the reader raises its line (the run stops)
                self.failed.add(w)
                break
            self.pos[w] += self.W
            self._done_if_past(w)
            moved = True
        return moved


def _settle(cache, p, pool, readers: _Readers, fetching: list[bool]) -> None:
    """Runs everything that can run until nothing moves: readers read, the fetcher steps, fetches finish."""
    for _ in range(10_000):
        moved = any([readers.act(w) for w in range(readers.W)])
        if fetching[0]:
            before = (p.i, len(pool.jobs), len(p.inflight), p.used, len(p.held))
            fetching[0] = cache.step(p, pool)
            moved |= (p.i, len(pool.jobs), len(p.inflight), p.used, len(p.held)) != before or not fetching[0]
        while pool.jobs:
            pool.run(0)
            moved = True
        if not moved:
            return
    raise AssertionError("the simulation did not settle")


CASES = st.fixed_dictionaries(
    {
        "workers": st.integers(1, 4),
        "start": st.integers(0, 17),
        "limit_shards": st.sampled_from([0, 1, 2, 3]),  # 0: no limit
        "prefetch": st.integers(1, 4),
        "span": st.sampled_from([0, 1, 2]),
        "seed": st.integers(0, 3),
        "stuck": st.dictionaries(st.integers(0, 3), st.integers(0, 17), max_size=3),  # reader -> where it stops
        "script": st.lists(st.integers(0, 63), max_size=60),
    }
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(case=CASES)
def test_no_reader_waits_on_a_shard_that_nothing_will_fetch(memory_sources, case):
    """Readers at any positions, in any interleaving with the fetcher and its fetches, some of them stopping for
    good (a hung worker, or one the DataLoader holds back): once nothing else can move, every reader still going
    has read to its end, or the cache failed with one line naming a shard (the limit cannot hold what is read at
    once). Only under a limit can a stopped reader keep what others need waiting (it still needs the shards it is
    in); such a wait ends in the reader's stall line, naming the shard and the positions."""
    from trainer.data.cache import ShardCache

    workers, start, limit_shards, stuck = case["workers"], case["start"], case["limit_shards"], case["stuck"]
    sources, root, biggest = memory_sources
    for f in [*root.glob("*.tar"), *root.glob("*.part")]:
        f.unlink()
    order = schedule(sources, seed=case["seed"], epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=case["span"])
    cache = ShardCache(sources, root, limit=limit_shards * biggest, prefetch=case["prefetch"], stall_s=0.01)
    pool = _ManualPool()
    p = cache.plan(order, start, workers)
    stuck = {w: at for w, at in stuck.items() if w < workers}
    readers = _Readers(cache.view, order, start, workers, stuck)
    fetching = [True]
    try:
        for a in case[
            "script"
        ]:  # an interleaving: a reader reads on, the fetcher steps, or one of its fetches finishes
            kind, who = a % 3, a // 3
            if kind == 0:
                readers.act(who % workers)
            elif kind == 1 and fetching[0]:
                fetching[0] = cache.step(p, pool)
            elif kind == 2 and pool.jobs:
                pool.run(who)
        _settle(cache, p, pool, readers, fetching)
        going = [w for w in range(workers) if readers.live(w)]
        if cache.error is not None:  # only a limit can fail: it cannot hold what the readers need at once
            assert limit_shards and "\n" not in str(cache.error) and "memory://cache-props/shard-" in str(cache.error)
            return
        if not going:
            return
        waits = {w: readers.shard(w) for w in going}
        assert limit_shards and stuck, (
            f"readers {going} wait on shards {waits} that nothing will fetch (positions {readers.pos}, "
            f"stuck {stuck}, limit {limit_shards} shards)"
        )
        w = going[0]
        cache.view.at(w, readers.pos[w])
        with pytest.raises(DataError) as e:
            cache.view.path(waits[w])
        line = str(e.value)
        assert line.startswith(f"{cache.shards[waits[w]].url}: the shard cache has not made this shard ready")
        assert f"readers' next positions {cache.view.progress[:workers].tolist()}" in line and "\n" not in line
    finally:
        cache.end()


def test_a_wait_in_which_nothing_moves_ends_in_one_line_naming_the_shard_and_the_positions(memory_sources):
    """Two readers, room for one shard: reader 0 stops inside the first shard, which it still needs, so reader 1
    waits for another one that cannot fit. The fetcher thread idles, nothing moves, and after the bound reader 1's
    wait ends in one line; a wait that sees the fetcher work is not cut short."""
    from trainer.data.cache import ShardCache

    sources, root, biggest = memory_sources
    for f in [*root.glob("*.tar"), *root.glob("*.part")]:
        f.unlink()
    order = schedule(sources, seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
    flat = [int(k) for k in order.shard]  # one source: flat id = shard
    # reader 1's first position in another shard than reader 0's first
    q = next(p for p in range(1, len(order), 2) if flat[p] != flat[0])
    cache = ShardCache(sources, root, limit=biggest, prefetch=1, stall_s=0.5)
    view = cache.view
    try:
        cache.begin(order, 0, 2)
        view.at(0, 0)
        view.path(flat[0])  # reader 0 holds its shard (and reads no further)
        view.at(1, q)
        t0 = time.monotonic()
        with deadline(60), pytest.raises(DataError) as e:
            view.path(flat[q])
        waited = time.monotonic() - t0
    finally:
        cache.end()
    line = str(e.value)
    assert line == (
        f"{cache.shards[flat[q]].url}: the shard cache has not made this shard ready in 0.5 s and nothing moved "
        f"meanwhile (readers' next positions [0, {q}], waiting (reader@position) 1@{q}); a reader stopped or the "
        "cache is stuck: the run stops rather than wait forever, and a rerun resumes from the last checkpoint"
    )
    assert 0.5 <= waited < 5


def test_a_stall_in_a_dataloader_worker_stops_the_run_with_its_line(dataset, tmp_path, monkeypatch):
    """Through the run's loader (2 DataLoader workers, local shards not hashed yet): a fetcher that never admits
    anything leaves the workers waiting; after the bound the worker's line is what the run prints (train.py's
    one-line error), not a hang."""
    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.config import TrainConfig
    from trainer.data import cache as cache_module
    from trainer.data.collate import CollateSpec
    from trainer.data.integrity import RECORD, ShardCheck
    from trainer.train import _one_line

    monkeypatch.setattr(cache_module.ShardCache, "_admit", lambda self, p, pos, due, pool: True)
    cfg = TrainConfig(data=str(dataset), tiny_random="qwen2-vl", num_workers=2, micro_batch_size=1, out=str(tmp_path))
    data = open_data_of(cfg)
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
    )
    check = ShardCheck(tmp_path / "shard-cache" / "rank-00000" / RECORD)
    loader, _, _ = make_loader_of(cfg, data, collate_spec=spec, check=check)
    cache = loader.streams.cache
    cache.view.stall_s = 1.0  # the workers are forked after start(): they read it from the view
    order = loader.streams.schedule(0)
    first = cache.shards[cache.view.flat(int(order.source[0]), int(order.shard[0]))].url
    try:
        loader.start(0, 0)
        with deadline(120), pytest.raises(DataError) as e:
            loader.next_step()
    finally:
        loader.close()
    line = _one_line(e.value)
    assert line.startswith(f"{first}: the shard cache has not made this shard ready in 1 s and nothing moved")
    assert "readers' next positions [0, 1]" in line and "\n" not in line


def test_dataloader_workers_are_never_forked_while_a_cache_thread_is_mid_step(dataset, tmp_path, monkeypatch):
    """The resumed run that hung: the shard cache's threads were working (hashing the local shards a resume has not
    hashed yet, a torch op in the fetcher) while the DataLoader forked its workers, and a worker inherited a lock
    held mid-step (glibc's atexit lock) and waited on it forever in torch.set_num_threads. Here each hash chunk
    counts itself busy for 0.5 s (a lock held inside a library call); the workers are forked while a hash is under
    way, and each checks the busy count it inherited: 0, as the fork waited for the hashing threads to park."""
    import hashlib as real_hashlib

    import trainer.data.integrity as integrity
    import trainer.data.streams as streams
    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.config import TrainConfig
    from trainer.data.collate import CollateSpec

    busy = {"n": 0}
    lock, started = threading.Lock(), threading.Event()

    class SlowSha256:
        def __init__(self):
            self.h = real_hashlib.sha256()

        def update(self, data):
            with lock:
                busy["n"] += 1
            started.set()
            time.sleep(0.5)
            self.h.update(data)
            with lock:
                busy["n"] -= 1

        def hexdigest(self):
            return self.h.hexdigest()

    class Hashlib:
        sha256 = SlowSha256

    real_read = streams.read_indexed

    def read(index, i, f=None):  # in a worker: what the fork copied of the parent's threads
        if busy["n"]:
            raise RuntimeError(f"forked while {busy['n']} shard-cache thread(s) were mid-step")
        return real_read(index, i, f)

    monkeypatch.setattr(integrity, "hashlib", Hashlib)
    monkeypatch.setattr(streams, "read_indexed", read)
    cfg = TrainConfig(data=str(dataset), tiny_random="qwen2-vl", num_workers=2, micro_batch_size=1, out=str(tmp_path))
    data = open_data_of(cfg)
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
    )
    loader, _, _ = make_loader_of(cfg, data, collate_spec=spec)
    assert len(loader.streams.cache.check.deferred) == 5  # a first start: every local shard is hashed by the cache
    try:
        loader.start(0, 0)
        assert started.wait(30)
        batches = loader.next_step()  # forks the two workers now, while a hash is under way
    finally:
        loader.close()
    assert sum(b.num_samples for b in batches) == 1

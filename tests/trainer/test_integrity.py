"""trainer/data/integrity.py on its own: a shard's sha256 is checked once per file version (the record keyed by stat
spares a resume the hashing; any rewrite makes it hash again), a mismatch names the shard; the per-step manifest
watch lets a byte-identical rewrite pass and stops on another shard list or a removed manifest. Live runs:
test_run_safety.py."""

import hashlib
import json
import os
import shutil
import types

import pytest

from trainer.data import integrity
from trainer.data.errors import DataError
from trainer.data.integrity import RECORD, DatasetWatch, ShardCheck
from trainer.data.sources import resolve_data


@pytest.fixture
def counted(monkeypatch):
    hashed = []

    class Sha:
        def __init__(self):
            self.h = hashlib.sha256()

        def update(self, b):
            self.h.update(b)

        def hexdigest(self):
            hashed.append(1)
            return self.h.hexdigest()

    monkeypatch.setattr(integrity, "hashlib", types.SimpleNamespace(sha256=Sha))
    return hashed


def test_a_shard_is_hashed_once_per_version_of_the_file(tmp_path, counted):
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(b"x" * 5000)
    want = hashlib.sha256(shard.read_bytes()).hexdigest()
    record = tmp_path / "cache" / RECORD
    check = ShardCheck(record)
    sig = check.verify(str(shard), url=str(shard), want=want)
    check.save()
    assert len(counted) == 1 and sig == integrity.file_signature(os.stat(shard))
    ShardCheck(record).verify(str(shard), url=str(shard), want=want)  # a resume: from the record
    assert len(counted) == 1
    os.utime(shard)  # rewritten (here: only touched): hashed again
    ShardCheck(record).verify(str(shard), url=str(shard), want=want)
    assert len(counted) == 2
    ShardCheck(record, enabled=False).verify(str(shard), url=str(shard), want="0" * 64)  # off: not hashed
    ShardCheck(record).verify(str(shard), url=str(shard), want=None)  # no manifest sha256: nothing to check
    assert len(counted) == 2


def test_a_shard_whose_bytes_differ_from_the_manifest_is_named(tmp_path):
    shard = tmp_path / "shard-000000.tar"
    shard.write_bytes(b"x" * 5000)
    with pytest.raises(
        DataError,
        match=rf"^{shard}: sha256 [0-9a-f]{{16}}\.\.\., but its manifest lists 0{{16}}\.\.\.: "
        r"the shard changed after it was built .*vlmprep verify",
    ):
        ShardCheck(None).verify(str(shard), url=str(shard), want="0" * 64)


def test_the_manifest_watch_passes_the_same_dataset_rewritten_and_stops_on_another(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    watch = DatasetWatch([resolve_data(str(data))])
    manifest = data / "manifest.json"
    watch.check()
    text = manifest.read_text()
    manifest.unlink()
    manifest.write_text(text)  # a build run again with the same result: another file, the same shard list
    watch.check()
    m = json.loads(text)
    m["shards"][1]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(m))
    with pytest.raises(DataError, match=rf"^{manifest} changed or was removed while this run reads it"):
        watch.check()
    manifest.write_text(text)
    os.utime(manifest, ns=(0, 0))
    watch.check()
    manifest.unlink()
    with pytest.raises(DataError, match=r"changed or was removed"):
        watch.check()


def test_a_scheduled_run_hashes_its_local_shards_ahead_of_the_readers_not_before_step_1(
    dataset, tmp_path, monkeypatch, capsys
):
    """With the sample shuffle, a run dir's first start only stats its local shards; the shard cache's gate hashes
    each, in read order, ahead of the readers. Step 1 waits for its own shards' hashes, not the rank's whole share;
    no sample is read from a shard before its hash matched; each is hashed once per run dir (the record, written as
    the cache closes, spares a resume); a shard whose bytes differ stops the run, naming it, when the run reaches it,
    with nothing read from it."""
    import threading
    import time

    import trainer.data.streams
    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.config import TrainConfig
    from trainer.data.collate import CollateSpec

    hashed, reads, lock = [], [], threading.Lock()
    real_hash, real_read = ShardCheck._hash, trainer.data.streams.read_indexed

    def slow_hash(self, path, *, url, want, **kw):  # 0.1 s a shard: what a large shard's hash costs, in small
        time.sleep(0.1)
        sig = real_hash(self, path, url=url, want=want, **kw)
        with lock:
            hashed.append(path)
        return sig

    def read(index, i, f=None):
        with lock:
            assert index.path in hashed, f"read {index.path} before its sha256 was checked"
            reads.append(index.path)
        return real_read(index, i, f)

    monkeypatch.setattr(ShardCheck, "_hash", slow_hash)
    monkeypatch.setattr(trainer.data.streams, "read_indexed", read)

    def run(data_dir, out, steps=None):
        cfg = TrainConfig(
            data=str(data_dir),
            tiny_random="qwen2-vl",
            num_workers=0,
            micro_batch_size=2,
            out=str(out),
            shard_prefetch=1,
        )
        data = open_data_of(cfg)
        spec = CollateSpec(
            pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
        )
        check = ShardCheck(out / "shard-cache" / "rank-00000" / RECORD)
        loader, total, _ = make_loader_of(cfg, data, collate_spec=spec, check=check)
        at_start, at_first = len(hashed), None
        try:
            loader.start(0, 0)
            for _ in range(steps or total):
                loader.next_step()
                at_first = len(hashed) if at_first is None else at_first
        finally:
            loader.close()
        return at_start, at_first

    n = len(resolve_data(str(dataset)).shards)
    at_start, at_first = run(dataset, tmp_path / "r")
    assert at_start == 0 and 1 <= at_first < n, (at_start, at_first)
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == n and len(reads) >= 2 * n
    assert "local shard(s) on rank 0 not yet hashed by this run dir" in capsys.readouterr().err
    run(dataset, tmp_path / "r", steps=2)  # a resume: the record vouches for every shard
    assert len(hashed) == n

    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    victim = sorted(bad.glob("shard-*.tar"))[2]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    reads.clear()
    with pytest.raises(DataError, match=rf"^{victim}: sha256 .*but its manifest lists"):
        run(bad, tmp_path / "r2")
    assert str(victim) not in reads  # nothing read from it


def test_a_shard_in_two_sources_of_a_mixture_is_hashed_once(dataset, tmp_path, monkeypatch):
    """The same dataset named twice in a mixture (two sources, one set of files): the shard cache's gate passes each
    shard of both sources, reaching a file from both at once or one after the other, and hashes the file once."""
    import threading
    import time

    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.config import DataSpec, TrainConfig
    from trainer.data.collate import CollateSpec

    hashed, lock, real_hash = [], threading.Lock(), ShardCheck._hash

    def slow_hash(self, path, *, url, want, **kw):  # slow enough that both sources' gates reach a shard while it hashes
        time.sleep(0.05)
        with lock:
            hashed.append(path)
        return real_hash(self, path, url=url, want=want, **kw)

    monkeypatch.setattr(ShardCheck, "_hash", slow_hash)
    cfg = TrainConfig(
        data=(
            DataSpec(name="a", path=str(dataset), weight=0.5),
            DataSpec(name="b", path=str(dataset), weight=0.5, on_end="stop"),
        ),
        tiny_random="qwen2-vl",
        num_workers=0,
        micro_batch_size=2,
        out=str(tmp_path / "r"),
        shard_prefetch=64,
    )  # the gate runs through the whole schedule, no reader needed
    data = open_data_of(cfg)
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
    )
    check = ShardCheck(tmp_path / "r" / "shard-cache" / "rank-00000" / RECORD)
    loader, _, _ = make_loader_of(cfg, data, collate_spec=spec, check=check)
    n = len(resolve_data(str(dataset)).shards)
    assert len(check.deferred) == n
    cache = loader.streams.cache
    try:
        loader.start(0, 0)
        cache._thread.join(timeout=60)
        assert not cache._thread.is_alive() and cache.error is None
    finally:
        loader.close()
    assert cache.hashed == 2 * n  # both sources' shards passed the gate...
    assert sorted(hashed) == sorted(set(hashed)) and len(hashed) == n, hashed  # ...each file hashed once


def test_each_rank_checks_only_its_own_shards_and_a_missing_or_cut_one_fails_at_start_up(
    dataset, tmp_path, monkeypatch
):
    """Opening a dataset stats none of its shards (every rank stat-ing every shard is 10^5 files x 512 ranks of
    metadata calls on a shared filesystem); each rank's start-up stats its own, and a missing or cut copy of one of
    them stops that rank's start-up with one line naming it, before a step."""
    from tests.trainer.conftest import open_data_of
    from trainer.config import TrainConfig
    from trainer.data.pipeline import rank_sources

    data = tmp_path / "ds"
    shutil.copytree(dataset, data)
    stats, real_stat = [], os.stat

    def counted(path, *a, **kw):
        if str(path).endswith(".tar") and str(data) in str(path):
            stats.append(os.path.basename(str(path)))
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", counted)
    world = 2
    cfg = TrainConfig(data=str(data), tiny_random="qwen2-vl", out=str(tmp_path / "r"))

    def start(rank):
        stats.clear()
        d = open_data_of(cfg, world)
        assert stats == []  # no shard stat-ed by opening the dataset
        rank_sources(
            d.specs,
            d.datasets,
            d.plans,
            rank=rank,
            world=world,
            cache=tmp_path / "c",
            check=ShardCheck(None),
            defer=True,
        )
        return d

    d = start(0)
    shards, plan = d.datasets[0].shards, d.plans[0]
    assert len(shards) > world and not plan.stride
    mine = {r: sorted(shards[i].name for i in plan.per_rank[r]) for r in range(world)}
    assert sorted(stats) == mine[0]
    start(1)
    assert sorted(stats) == mine[1]

    (data / mine[1][0]).unlink()  # rank 1's: rank 0 starts, rank 1 does not
    start(0)
    with pytest.raises(DataError, match=rf"^{data / mine[1][0]}: listed in its manifest but cannot be read \("):
        start(1)
    cut = data / mine[0][-1]
    size = cut.stat().st_size
    with open(cut, "r+b") as f:
        f.truncate(size - 512)
    with pytest.raises(
        DataError,
        match=rf"^{cut}: {size - 512} bytes but its manifest says {size}; the shard is "
        "truncated or was modified",
    ):
        start(0)

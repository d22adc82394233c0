"""trainer/integrity.py on its own: a shard's sha256 is checked once per file version (the record keyed by stat
spares a resume the hashing; any rewrite makes it hash again), a mismatch names the shard; the per-step manifest
watch lets a byte-identical rewrite pass and stops on another shard list or a removed manifest. Live runs:
test_run_safety.py."""
import hashlib
import json
import os
import shutil
import types

import pytest

from trainer import integrity
from trainer.integrity import RECORD, DatasetWatch, ShardCheck
from trainer.shards import DataError, resolve_data


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
    with pytest.raises(DataError, match=rf"^{shard}: sha256 [0-9a-f]{{16}}\.\.\., but its manifest lists 0{{16}}\.\.\.: "
                                        r"the shard changed after it was built .*vlmprep verify"):
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

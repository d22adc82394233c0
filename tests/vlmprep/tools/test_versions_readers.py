"""Readers of a version (`DIR@vN`, `DIR@TAG`, a URL's too: issue 55.2's parser, docs/datasets-that-grow.md): verify,
stats, the webdataset and HF clients and the URL copy read the version named, and refuse in one line a hostile
versioned dataset: a symlink planted at versions/ or at a record, a FIFO as a record (never waited on), a record whose
shard sizes lie or that names a file outside the dataset; `build --append` refuses the same without changing a
thing."""

import json
import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.clients.hf import iterable_dataset
from vlmprep.clients.wds import shard_urls
from vlmprep.config import BuildConfig
from vlmprep.shards.manifest import ShardFormatError, open_dataset
from vlmprep.shards.remote import FetchError, cache_dir, fetch_dataset
from vlmprep.tools.stats import compute_stats
from vlmprep.tools.verify import verify_dataset
from vlmprep_schemas.versions import Tag, tag_file, version_name

OPTS = dict(processor="tiny:qwen2-vl", seq_len=512, max_reject_fraction=1.0, min_turn_coverage=0.0, progress=False)


def _records(path: Path, ids: list[str]) -> Path:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    path.write_text("".join(json.dumps({"id": i, "messages": chat}) + "\n" for i in ids))
    return path


@pytest.fixture(scope="module")
def versioned(tmp_path_factory):
    """A text-only dataset of 2 versions (2 samples, then 1 more), with a tag `first` on version 1."""
    d = tmp_path_factory.mktemp("versioned")
    out = d / "ds"
    build(BuildConfig(inputs=(str(_records(d / "a.jsonl", ["a", "b"])),), out=str(out), **OPTS))
    build(BuildConfig(inputs=(str(_records(d / "c.jsonl", ["c"])),), out=str(out), append=True, **OPTS))
    import hashlib

    sha = hashlib.sha256((out / version_name(1)).read_bytes()).hexdigest()
    (out / "versions" / "tags").mkdir()
    (out / tag_file("first")).write_bytes(Tag("first", 1, sha, "2026-01-01T00:00:00Z").to_bytes())
    return out


def test_each_reader_reads_the_version_named(versioned, tmp_path, monkeypatch):
    for ref, n in ((versioned, 3), (f"{versioned}@v2", 3), (f"{versioned}@v1", 2), (f"{versioned}@first", 2)):
        assert not verify_dataset(Path(str(ref)))
        assert compute_stats(Path(str(ref)))["samples"] == n
        assert len(shard_urls(ref)) == (2 if n == 3 else 1)
        assert len(list(iterable_dataset(ref))) == n
    fs, bucket, url = _in_memory(versioned, tmp_path, monkeypatch)
    try:
        for ref, n in ((url, 3), (f"{url}@v1", 2), (f"{url}@first", 2)):
            copy = fetch_dataset(ref)
            assert copy == cache_dir(ref) and compute_stats(copy)["samples"] == n and not verify_dataset(copy)
        with pytest.raises(FetchError, match=r"@v7: no such version \(the latest is v2"):
            fetch_dataset(f"{url}@v7")
    finally:
        fs.rm(f"/{bucket}", recursive=True)
    r = CliRunner().invoke(app, ["verify", f"{versioned}@v1"])
    assert r.exit_code == 0 and f"OK {versioned}@v1" in r.output


def _in_memory(d: Path, tmp_path: Path, monkeypatch):
    """The dataset copied into a memory:// bucket of its own, and a cache of this test's: (fs, bucket, its URL)."""
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))
    bucket = f"ver-{uuid.uuid4().hex[:10]}"
    fs = fsspec.filesystem("memory")
    for p in d.rglob("*"):
        if p.is_file() and ".vlmprep.lock" not in p.name:
            fs.pipe_file(f"/{bucket}/ds/{p.relative_to(d).as_posix()}", p.read_bytes())
    return fs, bucket, f"memory://{bucket}/ds"


def _plant(d: Path, how: str) -> str:
    """Make dataset copy `d` hostile; the reference that reads it."""
    record = d / version_name(2)
    if how == "versions-link":
        shutil.rmtree(d / "versions")
        elsewhere = d.parent / "elsewhere"
        elsewhere.mkdir(exist_ok=True)
        os.symlink(elsewhere, d / "versions")
    elif how == "record-link":
        outside = d.parent / "outside.json"
        outside.write_bytes(record.read_bytes())
        record.unlink()
        os.symlink(outside, record)
    elif how == "record-fifo":
        record.unlink()
        os.mkfifo(record)
    elif how in ("lying-size", "outside-name"):
        m = json.loads(record.read_text())
        if how == "lying-size":
            m["shards"][0]["bytes"] += 1
        else:
            m["shards"][0]["name"] = "../shard-000000.tar"
        record.write_text(json.dumps(m))
    return f"{d}@v2"


HOSTILE = ["versions-link", "record-link", "record-fifo", "lying-size", "outside-name"]


@pytest.mark.parametrize("how", HOSTILE)
def test_a_hostile_version_is_refused_in_one_line_by_every_reader(versioned, tmp_path, how):
    d = tmp_path / "ds"
    shutil.copytree(versioned, d, symlinks=True)
    ref = _plant(d, how)
    found = verify_dataset(Path(ref))
    assert found and all("\n" not in str(v) for v in found)
    if how == "lying-size":  # a readable record that lies: verify names the shard; the readers read what it lists
        assert [str(v) for v in found] == [
            f"shard-000000.tar: size {(d / 'shard-000000.tar').stat().st_size} != manifest {(d / 'shard-000000.tar').stat().st_size + 1}"
        ]
        return
    for read in (compute_stats, shard_urls, iterable_dataset, open_dataset):
        with pytest.raises(ShardFormatError) as e:
            read(ref)
        msg = str(e.value)
        assert "\n" not in msg and any(w in msg for w in ("outside", "not a plain file", "not a plain .tar")), msg
        assert how != "outside-name" or version_name(2) in msg  # the record that names it
    r = CliRunner().invoke(app, ["stats", ref])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output


@pytest.mark.parametrize("how", ["versions-link", "record-fifo", "outside-name"])
def test_an_append_to_a_hostile_dataset_is_refused_in_one_line_changing_nothing(versioned, tmp_path, how):
    d = tmp_path / "ds"
    shutil.copytree(versioned, d, symlinks=True)
    _plant(d, how)
    before = sorted(str(p) for p in d.rglob("*"))
    new = _records(tmp_path / "n.jsonl", ["n"])
    r = CliRunner().invoke(
        app,
        ["build", "--append", "--in", str(new), "--out", str(d), "--processor", "tiny:qwen2-vl", "--seq-len", "512"],
    )
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 2, r.output  # the reading line, the error
    assert sorted(str(p) for p in d.rglob("*")) == before


def test_a_hostile_record_at_a_url_is_refused_before_any_shard_is_fetched(versioned, tmp_path, monkeypatch):
    fs, bucket, url = _in_memory(versioned, tmp_path, monkeypatch)
    try:
        m = json.loads(fs.cat_file(f"/{bucket}/ds/{version_name(2)}"))
        m["shards"][1]["bytes"] += 7
        fs.pipe_file(f"/{bucket}/ds/{version_name(2)}", json.dumps(m).encode())
        with pytest.raises(FetchError, match="but the manifest lists") as e:
            fetch_dataset(f"{url}@v2")
        assert "\n" not in str(e.value)
        m["shards"][1]["name"] = "/etc/passwd.tar"
        fs.pipe_file(f"/{bucket}/ds/{version_name(2)}", json.dumps(m).encode())
        with pytest.raises(FetchError, match="not a relative path inside the dataset|not a plain .tar"):
            fetch_dataset(f"{url}@v2")
        fs.pipe_file(f"/{bucket}/ds/{tag_file('first')}", b"{" * 10000)
        with pytest.raises(FetchError, match="first.json"):
            fetch_dataset(f"{url}@first")
    finally:
        fs.rm(f"/{bucket}", recursive=True)

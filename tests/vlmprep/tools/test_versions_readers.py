"""Readers of a version (`DIR@vN`, `DIR@TAG`, a URL's too: issue 55.2's parser, docs/datasets-that-grow.md): verify,
stats (its per-input rejects and reject table: every version's rejects file up to it), inspect, the webdataset, HF
and energon clients, the Collator and the URL copy read the version named, and refuse in one line a hostile
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


def _records(path: Path, ids: list[str], bad: str = "") -> Path:
    """Records of these ids; `bad`: a line that is no JSON record after them (an invalid_json reject)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    path.write_text("".join(json.dumps({"id": i, "messages": chat}) + "\n" for i in ids) + bad)
    return path


@pytest.fixture(scope="module")
def versioned(tmp_path_factory):
    """A text-only dataset of 2 versions (2 samples and an invalid_json reject, then 1 more and a duplicate_id
    reject of `a`), with a tag `first` on version 1."""
    d = tmp_path_factory.mktemp("versioned")
    out = d / "ds"
    build(BuildConfig(inputs=(str(_records(d / "a.jsonl", ["a", "b"], "{not json\n")),), out=str(out), **OPTS))
    build(BuildConfig(inputs=(str(_records(d / "c.jsonl", ["c", "a"])),), out=str(out), append=True, **OPTS))
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


def test_inspect_and_the_collator_read_the_version_named(versioned):
    """inspect (samples, --id, --only rejected: that version's rejects files) and the Collator take DIR@vN / DIR@TAG
    through the one resolver; a missing version is one line."""
    from vlmprep.clients.collate import Collator
    from vlmprep.config import InspectConfig
    from vlmprep.tools.inspector import select

    def seen(ref, **kw):
        return [
            (r["reason"], r["id"]) if isinstance(r, dict) else r.id
            for r in select(InspectConfig(path=ref, limit=10, **kw))[0]
        ]

    assert seen(f"{versioned}@v1") == seen(f"{versioned}@first") == ["a", "b"]
    assert seen(str(versioned)) == seen(f"{versioned}@v2") == ["a", "b", "c"]
    assert seen(f"{versioned}@v1", id="c") == [] and seen(f"{versioned}@v2", id="c") == ["c"]
    assert seen(f"{versioned}@v1", only="rejected") == [("invalid_json", None)]
    assert seen(str(versioned), only="rejected") == [("invalid_json", None), ("duplicate_id", "a")]
    r = CliRunner().invoke(app, ["inspect", f"{versioned}@v1", "--limit", "5"])
    assert r.exit_code == 0 and "hello there" in r.output, r.output
    for bad in ("@v9", "@nope", "@1x"):
        r = CliRunner().invoke(app, ["inspect", f"{versioned}{bad}"])
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
        assert "no such version" in r.output or "no version or tag" in r.output or "neither a version" in r.output
    assert (
        Collator(f"{versioned}@v1").processor_dir == str(versioned / "processor") == Collator(versioned).processor_dir
    )
    assert Collator(f"{versioned}@first").image_format == Collator(versioned).image_format
    with pytest.raises(ShardFormatError, match=r"@v9: no such version"):
        Collator(f"{versioned}@v9")


def test_the_rejects_of_a_version_are_every_earlier_versions_files_and_its_own(versioned, tmp_path, monkeypatch):
    """stats' per-input rejects and its reject table read rejects.jsonl and each later version's file up to the
    version named (the table: a version column); a URL's copy holds them too."""
    import pyarrow.parquet as pq

    for ref, want in ((f"{versioned}@v1", {"invalid_json": 1}), (versioned, {"invalid_json": 1, "duplicate_id": 1})):
        st = compute_stats(Path(str(ref)))
        assert st["rejects"] == want and not st["mismatches"], st["mismatches"]
        r = CliRunner().invoke(app, ["stats", str(ref), "--rejects", str(tmp_path / "r.parquet")])
        assert r.exit_code == 0, r.output
        rows = pq.read_table(tmp_path / "r.parquet").to_pylist()
        assert [(x["version"], x["reason"]) for x in rows] == [(1, "invalid_json"), (2, "duplicate_id")][: len(want)]
    fs, bucket, url = _in_memory(versioned, tmp_path, monkeypatch)
    try:
        st = compute_stats(fetch_dataset(url))
        assert st["rejects"] == {"invalid_json": 1, "duplicate_id": 1} and not st["mismatches"], st["mismatches"]
    finally:
        fs.rm(f"/{bucket}", recursive=True)


@pytest.mark.slow  # energon's index and loader set-up (~10 s), as the other energon loader tests
def test_energon_reads_a_version_through_its_split_config(versioned, tmp_path):
    """prepare(DIR@v1) indexes the shards with the latest's and writes split.v000001.json (split.yaml stays the
    latest's): energon's loader given split_config(DIR@v1) yields version 1's samples, plain DIR the latest's; an
    append drops the version's split config with energon's other index files."""
    pytest.importorskip("megatron.energon")
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from megatron.energon.errors import reraise_exception

    from vlmprep.clients.energon import prepare, split_config
    from vlmprep.clients.energon_meta import write_energon_meta

    d = tmp_path / "ds"
    shutil.copytree(versioned, d)
    assert prepare(f"{d}@first") == 2 and split_config(f"{d}@first") == split_config(f"{d}@v1") == "split.v000001.json"
    assert split_config(d) == "split.yaml"

    def ids(split):
        wc = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
        ds = get_train_dataset(
            d,
            split_config=split,
            worker_config=wc,
            batch_size=None,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            repeat=False,
        )
        return sorted(s.id for s in get_savable_loader(ds))

    assert ids("split.v000001.json") == ["a", "b"] and ids("split.yaml") == ["a", "b", "c"]
    write_energon_meta(d)  # what an append's merge does
    assert sorted(p.name for p in (d / ".nv-meta").iterdir()) == ["dataset.yaml"]


def test_stats_since_a_version_says_what_the_later_versions_added(versioned, tmp_path, monkeypatch):
    """`stats DIR@vN --since vM` (or a tag): per input file, records, samples, rejects, coverage and tokens of what
    versions M+1..N added, the totals N has beyond M (= the sum of their `added`), the sample and reject tables
    restricted to them with a version column; a URL reads the same; a bad --since is one line, nothing written."""
    import pyarrow.parquet as pq

    d = tmp_path / "ds"
    shutil.copytree(versioned, d)
    build(
        BuildConfig(inputs=(str(_records(tmp_path / "e.jsonl", ["e", "f"], "[]\n")),), out=str(d), append=True, **OPTS)
    )
    records = [json.loads((d / version_name(n)).read_text()) for n in (1, 2, 3)]
    for since, first in (("v1", 2), ("first", 2), ("v2", 3)):
        st = compute_stats(Path(f"{d}@v3"), since=since)
        added = [r["version"]["added"]["totals"] for r in records[first - 1 :]]
        assert not st["mismatches"], st["mismatches"]
        assert st["samples"] == sum(a["samples"] for a in added) and st["records"] == sum(a["records"] for a in added)
        assert st["tokens"] == sum(a["tokens"] for a in added) and (st["since"], st["version"]) == (first - 1, 3)
        assert [i["path"] for i in st["inputs"]] == [
            i["path"] for r in records[first - 1 :] for i in r["version"]["added"]["inputs"]
        ]
    st = compute_stats(Path(f"{d}@v3"), since="v1")
    assert [(Path(i["path"]).name, i["records"], i["samples"], i["rejects"]) for i in st["inputs"]] == [
        ("c.jsonl", 2, 1, {"duplicate_id": 1}),
        ("e.jsonl", 3, 2, {"not_an_object": 1}),
    ]
    assert st["rejects"] == {"duplicate_id": 1, "not_an_object": 1}
    assert (
        st["inputs"][0]["coverage"] == 0.5 and st["turns"]["input_assistant_turns"] == 4
    )  # the duplicate lost its turn
    r = CliRunner().invoke(
        app,
        [
            "stats",
            f"{d}@v3",
            "--since",
            "v1",
            "--samples",
            str(tmp_path / "s.parquet"),
            "--rejects",
            str(tmp_path / "r.parquet"),
        ],
    )
    assert r.exit_code == 0 and f"dataset {d}@v3 (what v2..v3 added since v1): 3 samples" in r.output, r.output
    samples = pq.read_table(tmp_path / "s.parquet").to_pylist()
    assert [(x["id"], x["version"]) for x in samples] == [("c", 2), ("e", 3), ("f", 3)]
    rejects = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [x["version"] for x in rejects] == [2, 3] and rejects[0]["reason"] == "duplicate_id"
    for bad, says in (
        ("v3", "is not a version before v3"),
        ("v9", "no such version"),
        ("v0", "pass an earlier version"),
        ("", "pass an earlier version"),
    ):
        r = CliRunner().invoke(app, ["stats", f"{d}@v3", "--since", bad, "--samples", str(tmp_path / "x.parquet")])
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and says in r.output, (bad, r.output)
        assert not (tmp_path / "x.parquet").exists()
    fs, bucket, url = _in_memory(d, tmp_path, monkeypatch)
    try:
        r = CliRunner().invoke(app, ["stats", f"{url}@v3", "--since", "first", "--json"])
        assert r.exit_code == 0, r.output
        got = json.loads(r.output[r.output.index("{") :])
        assert (got["samples"], got["since"], got["rejects"]) == (3, 1, st["rejects"])
    finally:
        fs.rm(f"/{bucket}", recursive=True)

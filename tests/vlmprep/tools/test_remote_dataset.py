"""verify, stats and inspect of a dataset URL (vlmprep/shards/remote.py): the dataset is copied into the cache and read
there, with the same output as on the local dir; a damaged file, a manifest naming a path outside the dataset, a URL
with credentials and a missing dataset are each one line. No network: fsspec's memory:// store and a loopback server.
"""

import json
import os
import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from tests.support.range_server import RangeServer
from vlmprep.builder.pipeline import build
from vlmprep.cli import app
from vlmprep.config import BuildConfig
from vlmprep.shards import remote
from vlmprep.shards.remote import cache_dir

ROOT = Path(__file__).resolve().parents[3]
TOOLS = str(ROOT / "vlmprep" / "templates" / "qwen2_vl_tools.jinja")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A dataset of 2 shards with sample indexes, a dataset index, a processor dir and one reject."""
    import zstandard

    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("remote")
    write_traces(
        d / "t.jsonl.zst",
        n=4,
        seed=2,
        min_images=1,
        max_images=2,
        width=160,
        height=100,
        overlong_fraction=0.0,
        text_only_fraction=0.25,
    )
    raw = zstandard.ZstdDecompressor().decompress((d / "t.jsonl.zst").read_bytes(), max_output_size=1 << 30)
    (d / "t.jsonl").write_bytes(raw + b"{broken json\n")
    build(
        BuildConfig(
            inputs=(str(d / "t.jsonl"),),
            out=str(d / "ds"),
            samples_per_shard=2,
            seq_len=4096,
            progress=False,
            chat_template=TOOLS,
            max_reject_fraction=1.0,
            processor="tiny:qwen2-vl",  # Qwen2-VL's classes over a small vocabulary: each read loads it fast
        )
    )
    assert (d / "ds" / "rejects.jsonl").read_text().strip() and (d / "ds" / "samples.index.npy").is_file()
    return d / "ds"


def _upload(src: Path, prefix: str) -> None:
    fs = fsspec.filesystem("memory")
    for p in sorted(src.rglob("*")):
        if p.is_file():
            fs.pipe_file(f"/{prefix}/{p.relative_to(src).as_posix()}", p.read_bytes())


@pytest.fixture
def store(built):
    """(the dataset's memory:// URL, its path in the memory filesystem): a bucket of its own per test, so neither the
    store nor the cache (one dir per URL) is shared with another test."""
    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    _upload(built, f"{bucket}/ds")
    yield f"memory://{bucket}/ds", f"/{bucket}/ds"
    fsspec.filesystem("memory").rm(f"/{bucket}", recursive=True)
    shutil.rmtree(cache_dir(f"memory://{bucket}/ds"), ignore_errors=True)


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "TERM": "dumb"})


def one_error(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


COMMANDS = [
    ("verify",),
    ("verify", "--quick"),
    ("stats",),
    ("stats", "--json"),
    ("inspect", "--limit", "1"),
    ("inspect", "--only", "rejected"),
    ("inspect", "--index", "2", "--tokens"),
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_a_url_reads_as_the_local_dir(built, store, args):
    url, _ = store
    local, there = run(args[0], str(built), *args[1:]), run(args[0], url, *args[1:])
    assert local.exit_code == 0 and there.exit_code == 0, there.output
    assert there.stdout.replace(url, str(built)) == local.stdout
    assert there.stderr.splitlines() == [
        f"vlmprep {args[0]}: copying {url} into {cache_dir(url)} (files already "
        "there with the manifest's sha256 are kept)"
    ]


def test_a_url_over_http_reads_as_the_local_dir(built, tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))
    shutil.copytree(built, tmp_path / "www" / "ds")
    with RangeServer(tmp_path / "www") as srv:
        for args in (("verify",), ("stats", "--json"), ("inspect", "--limit", "2")):
            url = f"{srv.url}/ds/"
            local, there = run(args[0], str(built), *args[1:]), run(args[0], url, *args[1:])
            assert there.exit_code == 0, there.output
            assert there.stdout.replace(url, str(built)) == local.stdout
    copy = cache_dir(f"{srv.url}/ds")
    assert copy.parent == tmp_path / "cache" / "datasets"
    assert sorted(p.name for p in copy.iterdir() if p.is_file()) == sorted(
        [p.name for p in built.iterdir() if p.is_file() and p.name != "plan.json"] + [".fetch.lock", ".stamps.json"]
    )


def test_the_cache_is_under_vlmprep_cache_one_dir_per_url(monkeypatch, tmp_path):
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path))
    assert cache_dir("s3://b/ds") == cache_dir("s3://b/ds/") != cache_dir("s3://b/ds2")
    assert cache_dir("s3://b/ds").parent == tmp_path / "datasets" and len(cache_dir("s3://b/ds").name) == 16
    monkeypatch.delenv("VLMPREP_CACHE")
    assert cache_dir("s3://b/ds").parent == Path.home() / ".cache" / "vlmprep" / "datasets"


def test_a_file_the_copy_has_is_not_fetched_again_while_its_object_is_unchanged(store, monkeypatch):
    """A second verify reads the shards the copy holds (their objects' stamps unchanged in the store) without fetching
    them; a shard damaged in the copy is fetched again; one removed from the store since is refused, never read from
    the copy (before: verify said OK from the copy of a shard the store no longer had)."""
    url, path = store
    assert run("verify", url).exit_code == 0
    fetched, chunks = [], remote._Store.chunks
    monkeypatch.setattr(
        remote._Store, "chunks", lambda self, name, limit: fetched.append(name) or chunks(self, name, limit)
    )
    assert run("verify", url).exit_code == 0
    assert not [n for n in fetched if n.endswith((".tar", ".npy"))], fetched
    copy = cache_dir(url) / "shard-000001.tar"
    copy.write_bytes(b"\0" + copy.read_bytes()[1:])  # the copy damaged: fetched again
    assert run("verify", url).exit_code == 0 and fetched.count("shard-000001.tar") == 1, fetched
    fsspec.filesystem("memory").rm(f"{path}/shard-000000.tar")  # gone from the store: the copy's is not read
    res = run("verify", url)
    assert res.exit_code == 1 and res.output.splitlines()[-1] == (
        f"error: cannot read {url}/shard-000000.tar: no such file or object, but the manifest lists it"
    ), res.output


def test_verify_of_a_bucket_whose_shard_changed_since_the_copy_was_fetched_refuses_it(built, tmp_path, monkeypatch):
    """moto's S3 server: `vlmprep verify s3://...` passes and leaves its copy in the cache; then one shard is changed
    in the bucket (same size): verify fetches it again, since its ETag is not the one the copy was fetched at, and
    refuses it naming it (before: OK, from the cached copy)."""
    import contextlib

    import s3fs

    from tests.trainer.test_remote import s3_server

    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))
    with contextlib.contextmanager(s3_server.__wrapped__)():
        fs = s3fs.S3FileSystem()
        fs.mkdir("verify-stale")
        for p in sorted(built.rglob("*")):
            if p.is_file():
                fs.pipe(f"verify-stale/ds/{p.relative_to(built).as_posix()}", p.read_bytes())
        url = "s3://verify-stale/ds"
        first = run("verify", url)
        data = fs.cat_file("verify-stale/ds/shard-000001.tar")
        fs.pipe("verify-stale/ds/shard-000001.tar", data[:-1] + bytes([data[-1] ^ 1]))
        again = run("verify", url)
    assert first.exit_code == 0 and "OK" in first.output, first.output
    assert again.exit_code == 1 and again.output.splitlines()[-1] == (
        f"error: {url}/shard-000001.tar: its sha256 differs from the manifest's: changed or damaged in storage; "
        "refusing it"
    ), again.output


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_shard_in_the_store_fails_naming_it(store, damage):
    url, path = store
    fs = fsspec.filesystem("memory")
    data = fs.cat_file(f"{path}/shard-000001.tar")
    fs.pipe_file(f"{path}/shard-000001.tar", b"\xff" + data[1:] if damage == "flip" else data[:-512])
    res = run("verify", url)
    says = {
        "flip": "its sha256 differs from the manifest's",
        "cut": f"{len(data) - 512} bytes, but the manifest lists {len(data)}",
    }[damage]
    assert res.exit_code == 1 and res.output.splitlines()[-1] == (
        f"error: {url}/shard-000001.tar: {says}: changed or damaged in storage; refusing it"
    ), res.output
    assert not any(p.name.startswith("shard-000001.tar") for p in cache_dir(url).iterdir())  # nor its .part


@pytest.mark.parametrize("edit", ["shard", "index", "processor", "absolute"])
def test_a_manifest_naming_a_file_outside_the_dataset_is_refused(store, edit, tmp_path):
    url, path = store
    fs = fsspec.filesystem("memory")
    bucket = path.rsplit("/", 1)[0]
    fs.pipe_file(f"{bucket}/evil.tar", b"x")
    fs.pipe_file(f"{bucket}/evil/tokenizer.json", b"{}")
    m = json.loads(fs.cat_file(f"{path}/manifest.json"))
    if edit == "shard":
        m["shards"][0]["name"] = "../evil.tar"
    elif edit == "index":
        m["shards"][0]["index"]["name"] = "../evil.tar.index.npy"
    elif edit == "processor":
        m["processor"]["dir"] = "../evil"
    else:
        m["sample_index"]["name"] = "/tmp/evil.index.npy"
    fs.pipe_file(f"{path}/manifest.json", json.dumps(m).encode())
    line = one_error(run("verify", url))
    assert line.startswith(f"error: {url}/manifest.json: ") and "refusing to read it" in line, line
    assert not cache_dir(url).exists()  # refused before anything is written
    assert not list(cache_dir(url).parent.parent.rglob("*evil*"))


def test_a_manifest_past_the_reader_limit_is_refused_unread(store, monkeypatch, tmp_path):
    import dataclasses

    url, _ = store
    monkeypatch.setattr(remote, "LIMITS", dataclasses.replace(remote.LIMITS, manifest_bytes=1000))
    assert one_error(run("stats", url)) == (
        f"error: {url}/manifest.json is more than 1000 bytes, more than a reader accepts; refusing it"
    )
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "manifest.json").write_text("{}")
    with RangeServer(tmp_path / "www") as srv:  # a GET whose body never ends: read no further than the limit
        srv.server.endless.add("manifest.json")
        line = one_error(run("verify", srv.url))
    assert line.startswith(f"error: {srv.url}/manifest.json "), line
    assert srv.server.sent < 64 << 20


@pytest.mark.parametrize(
    "url", ["memory://user:hunter2@bkt/ds", "s3://AKIAEXAMPLE:hunter2@bucket/ds", "https://me:hunter2@example.com/ds"]
)
@pytest.mark.parametrize("command", ["verify", "stats", "inspect"])
def test_a_url_with_credentials_is_refused_without_them(command, url):
    line = one_error(run(command, url))
    assert "hunter2" not in line and "credentials in it" in line and "AKIA" not in line, line


@pytest.mark.parametrize("command", ["verify", "stats", "inspect"])
def test_a_missing_dataset_is_one_line_naming_the_url(command):
    """Before, `vlmprep verify http://host/ds` looked for the local path `http:/host/ds`; then URLs were refused."""
    url = f"memory://none-{uuid.uuid4().hex[:8]}/ds"
    assert one_error(run(command, url)) == (
        f"error: {url}: no manifest.json there: not a vlmprep dataset, or not a "
        "finished one (a build writes its manifest last), or not at this URL"
    )
    assert one_error(run(command, "ftp://host/ds")).startswith(
        "error: ftp://host/ds: not a dataset location this vlmprep reads"
    )


def test_a_refused_connection_is_one_line_not_a_missing_dataset():
    line = one_error(run("verify", "http://127.0.0.1:9/ds"))
    assert line.startswith("error: cannot read http://127.0.0.1:9/ds/manifest.json: Cannot connect"), line


def test_inspect_of_one_shard_fetches_that_shard_alone(built, store):
    url, _ = store
    args = ("--shard", "shard-000001", "--limit", "1")
    there = run("inspect", url, *args)
    assert there.exit_code == 0 and there.stdout == run("inspect", str(built), *args).stdout
    copy = cache_dir(url)
    assert (copy / "shard-000001.tar").is_file() and not (copy / "shard-000000.tar").exists()
    assert not (copy / "samples.index.npy").exists()
    assert run("verify", url).exit_code == 0  # then the rest, for a command that reads it all
    assert (copy / "shard-000000.tar").is_file()


def test_an_older_copys_files_are_removed(built, store):
    url, path = store
    assert run("verify", url).exit_code == 0
    stale = cache_dir(url) / "shard-000009.tar"
    stale.write_bytes(b"x")  # an older manifest's shard: verify would call it unlisted
    (cache_dir(url) / "shard-000000.tar.part").write_bytes(b"x")  # a killed run's
    res = run("verify", url)
    assert res.exit_code == 0, res.output
    assert not stale.exists() and not (cache_dir(url) / "shard-000000.tar.part").exists()


def test_inspect_reads_raw_input_at_a_url_where_it_is(built, store):
    url, path = store
    raw = built.parent / "t.jsonl"
    fsspec.filesystem("memory").pipe_file(f"{path}/t.jsonl", raw.read_bytes())
    args = ("--chat-template", TOOLS, "--limit", "2")
    there, local = run("inspect", f"{url}/t.jsonl", *args), run("inspect", str(raw), *args)
    assert there.exit_code == 0, there.output
    assert there.stdout.replace(f"{url}/t.jsonl", str(raw)) == local.stdout
    assert not os.path.exists(cache_dir(f"{url}/t.jsonl"))

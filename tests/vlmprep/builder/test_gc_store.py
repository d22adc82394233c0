"""`vlmprep versions`, `tag` and `gc` on a dataset in a bucket (issue 55.5), against moto's S3 server on loopback:
the same listing, tags and removals as a local dir (kept versions still verify from the bucket, the lease gone
after); a gc or tag from elsewhere meanwhile (the lease held), a store that ignores conditional writes and a tag that
exists are refused in one line with nothing changed; a corrupt record in the bucket is refused before any delete."""

import json

import pytest

from tests.trainer import test_remote
from tests.vlmprep.builder.test_append import cfg, invoke
from tests.vlmprep.builder.test_gc import _batch, one_line_error
from tests.vlmprep.builder.test_store_out import _objects, bucket  # noqa: F401 - a bucket per test, its own stage
from vlmprep.builder.catalog import LEASE_NAME
from vlmprep.builder.pipeline import build
from vlmprep.shards.remote import fetch_dataset
from vlmprep.tools.verify import verify_dataset
from vlmprep_schemas.versions import tag_file, version_name

s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """This test's own dataset cache (the copies fetch_dataset makes)."""
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def grown(bucket, tmp_path):  # noqa: F811
    """A dataset of 3 versions in the test's bucket: (fs, its key prefix, its URL)."""
    fs, name = bucket
    url = f"s3://{name}/ds"
    build(cfg([_batch(tmp_path / "b1.jsonl", 1)], url))
    for k in (2, 3):
        build(cfg([_batch(tmp_path / f"b{k}.jsonl", k)], url, append=True))
    return fs, f"{name}/ds", url


def test_versions_tag_and_gc_in_a_bucket(grown):
    fs, prefix, url = grown
    r = invoke("versions", url)
    assert r.exit_code == 0 and "3 versions, the latest v3" in r.output, r.output
    r = invoke("tag", f"{url}@v1", "first")
    assert r.exit_code == 0 and f"tagged v1 as first: {url}@first reads it" in r.output, r.output
    before = _objects(fs, prefix)
    one_line_error(invoke("tag", f"{url}@v2", "first"), "tag 'first' exists (it names v1", "--force")
    assert _objects(fs, prefix) == before
    r = invoke("gc", url, "--keep", "1")
    assert r.exit_code == 0 and "removed v2 (1 record" in r.output and "v1 (tag first)" in r.output, r.output
    now = _objects(fs, prefix)
    gone = {version_name(2), "samples.v000002.index.npy"}
    assert set(before) - set(now) == gone and all(now[k] == before[k] for k in now)
    assert LEASE_NAME not in now and not any(".probe-" in k for k in now)
    doc = json.loads(invoke("versions", url, "--json").output)
    assert doc["removed"] == [2] and doc["versions"][0]["tags"] == ["first"]
    for ref in (f"{url}@first", url):
        assert not verify_dataset(fetch_dataset(ref)), ref
    with pytest.raises(Exception, match="no longer kept there"):
        fetch_dataset(f"{url}@v2")
    r = invoke("tag", url, "first", "--delete")
    assert r.exit_code == 0 and tag_file("first") not in _objects(fs, prefix)


def test_a_held_lease_refuses_gc_and_tag_in_one_line(grown):
    fs, prefix, url = grown
    fs.pipe(f"{prefix}/{LEASE_NAME}", json.dumps({"host": "other", "pid": 7, "since": "then"}).encode())
    before = _objects(fs, prefix)
    for args in (["gc", url, "--keep", "1"], ["tag", url, "x"]):
        one_line_error(invoke(*args), "in use by another gc or tag", '"host": "other"', f"remove {url}/{LEASE_NAME}")
    assert _objects(fs, prefix) == before


def test_a_store_that_ignores_conditional_writes_is_refused(grown, monkeypatch):
    import s3fs

    fs, prefix, url = grown
    before = _objects(fs, prefix)
    real = s3fs.S3FileSystem._pipe_file

    async def ignoring(self, path, data, mode="overwrite", **kw):  # a store that drops If-None-Match
        return await real(self, path, data, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring)
    s3fs.S3FileSystem.clear_instance_cache()
    for args in (["gc", url, "--keep", "1"], ["tag", url, "x"]):
        one_line_error(invoke(*args), "this store ignores conditional writes")
    monkeypatch.undo()
    s3fs.S3FileSystem.clear_instance_cache()
    assert _objects(fs, prefix) == before


def test_a_corrupt_record_in_a_bucket_is_refused_before_any_delete(grown):
    fs, prefix, url = grown
    fs.pipe(f"{prefix}/{version_name(1)}", b"{not json")
    before = _objects(fs, prefix)
    for args in (["versions", url], ["gc", url, "--keep", "1"]):
        one_line_error(invoke(*args), version_name(1), "restore it from a copy")
    assert _objects(fs, prefix) == before
    one_line_error(invoke("versions", url.rsplit("/", 1)[0] + "/nothing"), "not a vlmprep dataset")

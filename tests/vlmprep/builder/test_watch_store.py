"""`vlmprep watch` with its location and --out in a bucket (issue 55.4), against moto's S3 server on loopback: an
empty prefix is nothing new, each cycle commits what landed as one version, exactly once; one watcher per dataset (a
lease object created exclusively): of two started at once exactly one runs and commits, the other is refused in one
line; a live lease of another host is refused, an expired one (or one whose process on this host is gone) taken
over; a bucket that ignores conditional writes is refused before anything is written."""

import json
import socket
import time

import pytest

from tests.support.watching import check_exactly_once, invoke, records, traces, two_watchers, watch_args
from tests.trainer import test_remote
from tests.vlmprep.builder.test_store_out import _objects, bucket  # noqa: F401 - a bucket per test, its own stage
from vlmprep.shards.remote import fetch_dataset
from vlmprep.tools.verify import verify_dataset

s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped
LEASE = ".vlmprep.watch.lease"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))


def _reader(fs, prefix):
    def read(name):
        fs.invalidate_cache()
        return fs.cat_file(f"{prefix}/{name}") if fs.exists(f"{prefix}/{name}") else None

    return read


def _drop(fs, name, k):
    fs.pipe(f"{name}/in/obj-{k:03d}.jsonl.zst", traces(k))
    return f"s3://{name}/in/obj-{k:03d}.jsonl.zst"


def _verify(url):
    return lambda n: verify_dataset(fetch_dataset(f"{url}@v{n}"))


def test_each_cycle_commits_what_landed_in_the_bucket_as_one_version(bucket):  # noqa: F811
    fs, name = bucket
    location, url = f"s3://{name}/in/", f"s3://{name}/ds"
    res = invoke(*watch_args(location, url, "--once"))
    assert res.exit_code == 0 and "nothing new; no dataset yet" in res.output, res.output
    landed = [_drop(fs, name, 0)]
    res = invoke(*watch_args(location, url, "--once"))
    assert "v1 committed: 1 object, 3 records" in res.output, res.output
    landed += [_drop(fs, name, 1), _drop(fs, name, 2)]
    res = invoke(*watch_args(location, url, "--once"))
    assert "v2 committed: 2 objects, 6 records" in res.output, res.output
    assert "nothing new; latest v2" in invoke(*watch_args(location, url, "--once")).output
    check_exactly_once(_reader(fs, f"{name}/ds"), landed, _verify(url))
    assert not [k for k in _objects(fs, f"{name}/ds") if k.startswith(LEASE)]  # released at exit
    # a built object replaced in the bucket (another ETag): reported with both stamps, not rebuilt
    fs.pipe(f"{name}/in/obj-001.jsonl.zst", traces(1, n=4))
    res = invoke(*watch_args(location, url, "--once"))
    assert f"{landed[1]} changed after it was built (bytes " in res.output and ', etag "' in res.output, res.output
    assert "nothing new; latest v2" in res.output


@pytest.mark.slow  # ~20 s on 2 cores; make test keeps test_watch_service's two local watchers (the race) and the live
# lease refused below (the bucket's lease) (make test-all runs it)
def test_of_two_watchers_started_at_once_exactly_one_runs_and_commits(bucket, tmp_path):  # noqa: F811
    fs, name = bucket
    location, url = f"s3://{name}/in/", f"s3://{name}/ds"
    two_watchers(location, url, lambda k: _drop(fs, name, k), _reader(fs, f"{name}/ds"), _verify(url), tmp_path)


def _lease(fs, name, n, **note):
    body = {"command": "vlmprep watch", "pid": 4242, "host": "other-host", "since": "then", "ttl": 60.0, **note}
    fs.pipe(f"{name}/ds/{LEASE}-{n:06d}", json.dumps(body).encode())


def test_a_live_lease_is_refused_and_an_expired_one_taken_over(bucket):  # noqa: F811
    fs, name = bucket
    location, url = f"s3://{name}/in/", f"s3://{name}/ds"
    _drop(fs, name, 0)
    _lease(fs, name, 3, renewed=time.time())
    res = invoke(*watch_args(location, url, "--once"))
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1, res.output
    assert res.output.startswith(
        f"error: --out {url} is watched already by `vlmprep watch` (pid 4242 on other-host, since then) (its lease "
        f"{LEASE}-000003); one watcher per dataset"
    )
    assert not fs.exists(f"{name}/ds/manifest.json")
    _lease(fs, name, 3, renewed=time.time() - 120)  # expired: not renewed within its 60 s
    res = invoke(*watch_args(location, url, "--once"))
    assert res.exit_code == 0 and "v1 committed" in res.output, res.output
    assert "taking over the lease of `vlmprep watch` (pid 4242 on other-host, since then)" in res.output
    assert "(it expired)" in res.output
    _lease(fs, name, 7, host=socket.gethostname(), pid=2**22 + 7, renewed=time.time())  # this host, no such process
    _drop(fs, name, 1)
    res = invoke(*watch_args(location, url, "--once"))
    assert "(its process is gone)" in res.output and "v2 committed" in res.output, res.output
    fs.invalidate_cache()
    assert not [k for k in fs.find(f"{name}/ds") if LEASE in k]  # the old leases and its own, removed
    assert len(records(_reader(fs, f"{name}/ds"))) == 2


def test_a_bucket_that_ignores_conditional_writes_is_refused_before_anything_is_written(bucket, monkeypatch):  # noqa: F811
    import s3fs

    fs, name = bucket
    _drop(fs, name, 0)
    real = s3fs.S3FileSystem._pipe_file

    async def ignoring(self, path, data, mode="overwrite", **kw):  # a store that drops If-None-Match
        return await real(self, path, data, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        res = invoke(*watch_args(f"s3://{name}/in/", f"s3://{name}/ds", "--once"))
    finally:
        monkeypatch.undo()
        s3fs.S3FileSystem.clear_instance_cache()
    assert res.exit_code == 1 and len(res.output.strip().splitlines()) == 1
    assert "this store ignores conditional writes" in res.output
    fs.invalidate_cache()
    assert not fs.exists(f"{name}/ds")


def test_a_changed_object_in_the_bucket_is_rebuilt_into_a_version_that_replaces_its_samples(bucket, tmp_path):  # noqa: F811
    from tests.vlmprep.builder.test_rebuild import samples
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    fs, name = bucket
    location, url = f"s3://{name}/in/", f"s3://{name}/ds"
    landed = [_drop(fs, name, 0), _drop(fs, name, 1)]
    assert "v1 committed" in invoke(*watch_args(location, url, "--once")).output
    mine = lambda k: k.startswith("shard-0") or k in ("samples.index.npy", "rejects.jsonl")  # noqa: E731 - v1's files
    v1 = {k: fs.cat_file(f"{name}/ds/{k}") for k in _objects(fs, f"{name}/ds") if mine(k)}
    assert len(v1) == 8
    fs.pipe(f"{name}/in/obj-000.jsonl.zst", traces(0, n=4, seed=9))  # another ETag, size and content
    landed.append(_drop(fs, name, 2))
    res = invoke(*watch_args(location, url, "--once", "--on-change", "rebuild"))
    assert res.exit_code == 0, res.output
    assert f"{landed[0]} changed after it was built" in res.output and "(--on-change rebuild)" in res.output
    assert "v2 committed: 2 objects (1 rebuilt, 3 samples replaced)" in res.output, res.output
    recs = check_exactly_once(_reader(fs, f"{name}/ds"), landed, _verify(url))
    assert [i["path"] for i in recs[1]["version"]["removed"]["inputs"]] == [landed[0]]
    for k, data in v1.items():  # every object of version 1 as it was
        assert fs.cat_file(f"{name}/ds/{k}") == data, k
    fresh = tmp_path / "fresh"
    opts = dict(processor="tiny:qwen2-vl", seq_len=2048, samples_per_shard=2, chat_template="qwen2_vl_tools")
    build(BuildConfig(inputs=tuple(landed), out=str(fresh), max_reject_fraction=1.0, min_turn_coverage=0.0, **opts))
    assert samples(fetch_dataset(f"{url}@v2")) == samples(fresh)
    res = invoke(*watch_args(location, url, "--once", "--on-change", "rebuild"))
    assert "nothing new; latest v2" in res.output, res.output

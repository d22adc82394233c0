"""`vlmprep build --append` with --out in a bucket (issue 55.1), against moto's S3 server on loopback: a dataset
built before versions becomes version 1 (its ids derived once); appends with --tasks 2 and as --task-index runs +
`vlmprep merge URL` (nothing shared but the bucket) give the versions of one local build, version by version, with
version 1's objects unchanged; the commit is a conditional create (a bucket that ignores If-None-Match is refused,
and of two appends of one version exactly one commits: another plan's claim is refused, a record created meanwhile
wins)."""

import pytest

from tests.trainer import test_remote
from tests.vlmprep.builder.test_append import batches, cfg, samples, single  # noqa: F401 - fixtures
from tests.vlmprep.builder.test_store_out import _objects, bucket  # noqa: F401 - a bucket per test, its own stage
from vlmprep.builder.pipeline import build, build_task, merge
from vlmprep.builder.store import STAGE_ENV
from vlmprep.builder.workers import BuildError
from vlmprep.shards.remote import fetch_dataset
from vlmprep.shards.versions import CommitConflict
from vlmprep_schemas.versions import version_name

s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """This test's own dataset cache (the copies fetch_dataset makes)."""
    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))


def _dataset(objects: dict) -> dict:
    """The dataset's objects: not the build's state (plan, tasks), which the next build replaces, nor manifest.json."""
    return {k: v for k, v in objects.items() if k not in ("plan.json", "manifest.json") and not k.startswith("tasks/")}


def test_appends_into_a_bucket_equal_one_local_build(bucket, batches, single, tmp_path, monkeypatch, capsys):  # noqa: F811
    fs, name = bucket
    url = f"s3://{name}/ds"
    build(cfg(batches[:1], url))
    # a dataset built before versions: no versions/ at all (today's builds write version 1's id file)
    fs.rm(f"{name}/ds/versions", recursive=True)
    v1 = _objects(fs, f"{name}/ds")
    build(cfg(batches[1:2], url, append=True, tasks=2, workers=2))
    assert "deriving versions/v000001.ids from its shards (once)" in capsys.readouterr().err
    # version 3 planned on one machine, each task run on another, merged on a third: nothing shared but the bucket
    for who in ("planner", "task0", "task1", "merger"):
        monkeypatch.setenv(STAGE_ENV, str(tmp_path / who))
        if who == "planner":
            res = build(cfg(batches[2:], url, append=True, tasks=2, plan_only=True))
            assert res.plan.version == 3
        elif who == "merger":
            merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
        else:
            build_task(url, int(who[-1]))
    now = _objects(fs, f"{name}/ds")
    assert {k: now[k] for k in _dataset(v1)} == _dataset(v1)  # nothing of version 1 changed
    assert now["versions/v000001.json"] == v1["manifest.json"]  # version 1: the manifest it had, byte for byte
    assert now["manifest.json"] == now["versions/v000003.json"]
    want = samples(single)
    for n in (1, 2, 3):
        got = samples(fetch_dataset(f"{url}@v{n}"))
        assert got == want[: 3 * n], f"version {n}"
    from tests.vlmprep.builder.test_append import open_dataset

    copy = fetch_dataset(url)
    assert open_dataset(copy)[1].totals == open_dataset(single)[1].totals
    from vlmprep.tools.verify import verify_dataset

    assert not verify_dataset(copy)


def test_a_bucket_that_ignores_conditional_writes_is_refused(bucket, batches, monkeypatch):  # noqa: F811
    import s3fs

    fs, name = bucket
    url = f"s3://{name}/ds"
    build(cfg(batches[:1], url))
    before = _objects(fs, f"{name}/ds")
    real = s3fs.S3FileSystem._pipe_file

    async def ignoring(self, path, data, mode="overwrite", **kw):  # a store that drops If-None-Match
        return await real(self, path, data, **kw)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", ignoring)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before binds the real one at its start
    with pytest.raises(BuildError, match="this store ignores conditional writes") as e:
        build(cfg(batches[1:2], url, append=True))
    assert "\n" not in str(e.value)
    assert _objects(fs, f"{name}/ds") == before  # nothing written, the probe removed
    monkeypatch.undo()
    s3fs.S3FileSystem.clear_instance_cache()


def test_two_appends_of_one_version_in_a_bucket_commit_once(bucket, batches, monkeypatch):  # noqa: F811
    fs, name = bucket
    url = f"s3://{name}/ds"
    build(cfg(batches[:1], url))
    # another machine's append of other inputs claimed version 2 first: refused before anything of this one goes up
    fs.pipe(f"{name}/ds/versions/v000002.claim", b'{"plan": "' + b"0" * 64 + b'", "host": "other", "pid": 7}')
    before = _objects(fs, f"{name}/ds")
    with pytest.raises(BuildError, match=r"version 2 is being built by another append \(pid 7 on other"):
        build(cfg(batches[1:2], url, append=True))
    after = _objects(fs, f"{name}/ds")
    assert after.pop("versions/v000001.json") == after["manifest.json"]  # version 1 recorded, as it is
    assert after == before
    fs.rm(f"{name}/ds/versions/v000002.claim")
    # and where a record of version 2 lands between this append's claim and its commit, that record wins
    import vlmprep.builder.pipeline as pipeline

    real = pipeline.version_record

    def racing(out, plan, *rest):
        data = real(out, plan, *rest)
        fs.pipe(f"{name}/ds/{version_name(plan.version)}", b"{}")
        return data

    monkeypatch.setattr(pipeline, "version_record", racing)
    with pytest.raises(CommitConflict, match="version 2 was committed by another build meanwhile"):
        build(cfg(batches[1:2], url, append=True))
    fs.invalidate_cache()
    assert fs.cat_file(f"{name}/ds/versions/v000002.json") == b"{}"
    assert fs.cat_file(f"{name}/ds/manifest.json") == fs.cat_file(f"{name}/ds/versions/v000001.json")

"""Datasets bigger than a node: the build's sample index (the trainer starts from it, never from tar headers), remote
shards through fsspec (memory://, a registered hf://, a local S3 server, loopback HTTP with Range support) and the
bounded shard cache (fetch order, eviction under the limit, sha256 refusal), in process; the trainer CLI runs over
HTTP (10x the cache limit, shuffled and mixed, kill + resume) and S3 (no credential printed) are slow."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.trainer.conftest import (
    ROOT,
    build_dataset,
    kill_at_step,
    read_metrics,
    run_trainer,
    trainer_cmd,
    trainer_env,
)
from trainer.config import ConfigError, DataSpec, TrainConfig, cache_limit_bytes
from trainer.data.errors import DataError
from trainer.data.index import index_shard, load_index, read_indexed
from trainer.data.order import schedule
from trainer.data.sources import plan_shards, resolve_data
from trainer.data.streams import ScheduledStream


def _sources(data: str, cache: Path, **kw):
    from trainer.data.pipeline import rank_sources

    ds = resolve_data(data)
    return rank_sources((DataSpec(path=data),), [ds], [plan_shards(ds.shards, 1)], rank=0, world=1, cache=cache)


def _older(dataset: Path, old: Path, *, sidecars: bool = False) -> Path:
    """A copy of dataset as an older vlmprep built it: no sample index files, none in the manifest (`sidecars`: the
    shards' own index files kept, as the vlmprep before the dataset's sample index wrote them)."""
    shutil.copytree(dataset, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / manifest.pop("sample_index")["name"]).unlink()
    for s in manifest["shards"] if not sidecars else ():
        (old / s.pop("index")["name"]).unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    return old


def test_the_sidecar_index_is_the_one_derived_from_the_tar(dataset):
    for s in resolve_data(str(dataset)).shards:
        assert s.index is not None and s.index.url.endswith(".tar.index.npy")
        built = load_index(s, Path(s.index.url).read_bytes(), path=s.url)
        derived = index_shard(s.url, expect=s.num_samples)
        for field in ("starts", "ends", "tokens", "trained"):
            np.testing.assert_array_equal(getattr(built, field), getattr(derived, field))
        assert read_indexed(built, built.num_samples - 1)[0] == read_indexed(derived, derived.num_samples - 1)[0]


def test_start_up_reads_only_the_index_and_an_older_dataset_is_derived(dataset, tmp_path, monkeypatch):
    """With sidecars no tar is opened at start-up; without (an older build) every shard is indexed from its tar."""
    import trainer.data.index

    def no_tar(*a, **kw):
        raise AssertionError("start-up opened a shard")

    with monkeypatch.context() as m:
        m.setattr(trainer.data.index, "index_shard", no_tar)
        sources, derived = _sources(str(dataset), tmp_path / "c")
    assert derived == 0 and sum(ix.num_samples for ix in sources[0].indexes) == 18
    held = sum(a.nbytes for ix in sources[0].indexes for a in (ix.starts, ix.ends, ix.tokens, ix.trained))
    assert held / 18 <= 100  # the index's host memory per sample (the bound; 32 bytes today)
    old = _older(dataset, tmp_path / "old")
    again, derived = _sources(str(old), tmp_path / "c")
    assert derived == 5
    for a, b in zip(sources[0].indexes, again[0].indexes):
        np.testing.assert_array_equal(a.starts, b.starts)
        np.testing.assert_array_equal(a.trained, b.trained)


def test_an_older_dataset_trains_with_a_one_line_note(dataset, tmp_path, capsys):
    """A dataset an older vlmprep built (no sample index files) still starts and takes a step, its index derived from
    the tars; rank 0 says so in one line."""
    from tests.trainer.conftest import make_loader_of, open_data_of
    from trainer.data.collate import CollateSpec
    from trainer.data.integrity import ShardCheck

    old = _older(dataset, tmp_path / "old")
    cfg = TrainConfig(data=str(old), tiny_random="qwen2-vl", num_workers=0, micro_batch_size=2, out=str(tmp_path / "r"))
    data = open_data_of(cfg)
    spec = CollateSpec(
        pad_id=0, image_token_id=151655, patch_size=data.image.patch_size, merge_size=data.image.merge_size
    )
    loader, total, _ = make_loader_of(cfg, data, collate_spec=spec, check=ShardCheck(None))
    try:
        loader.start(0, 0)
        assert sum(b.num_samples for b in loader.next_step()) == 2 and total == 9
    finally:
        loader.close()
    notes = [ln for ln in capsys.readouterr().err.splitlines() if "no sample index" in ln]
    assert notes == [
        "trainer: note: 5 shard(s) on rank 0 have no sample index (an older vlmprep built them): indexed "
        "from every tar header and sample meta, as before; rebuild with this vlmprep for a start-up that "
        "does not grow with the sample count"
    ]


def test_start_up_reads_the_one_dataset_index_file(dataset, tmp_path, monkeypatch):
    """Where the manifest lists the dataset's sample index (every build since it was added), start-up opens that
    one file, no tar and no sidecar: each rank reads its own shards' rows (ranks whose shards are not contiguous;
    every rank all shards when fewer shards than ranks), each shard's vouched for by its sidecar's sha256 in the
    manifest, so the whole file is never hashed; 32 bytes a sample kept."""
    import trainer.data.index
    from trainer.data.pipeline import rank_sources
    from vlmprep.shards.manifest import ShardEntry
    from vlmprep.shards.reader import load_sample_index

    manifest = json.loads((dataset / "manifest.json").read_text())
    whole = np.load(dataset / manifest["sample_index"]["name"], allow_pickle=False)
    np.testing.assert_array_equal(
        whole, np.concatenate([load_sample_index(dataset, ShardEntry.from_json(s)) for s in manifest["shards"]])
    )
    ds = resolve_data(str(dataset))
    want = {s.name: load_index(s, Path(s.index.url).read_bytes(), path=s.url) for s in ds.shards}

    def unread(*a, **kw):
        raise AssertionError("start-up read a tar or a sidecar")

    def whole(*a, **kw):
        raise AssertionError("start-up hashed the whole dataset index, not the rank's rows")

    monkeypatch.setattr(trainer.data.index, "index_shard", unread)
    monkeypatch.setattr(trainer.data.index, "load_index", unread)
    monkeypatch.setattr(trainer.data.index, "_check_whole", whole)
    for world in (1, 3, 8):
        plan = plan_shards(ds.shards, world)
        for rank in range(world):
            sources, derived = rank_sources(
                (DataSpec(path=str(dataset)),), [ds], [plan], rank=rank, world=world, cache=tmp_path / "c"
            )
            assert derived == 0 and [s.name for s in sources[0].shards] == [
                ds.shards[i].name for i in (range(len(ds.shards)) if plan.stride else plan.per_rank[rank])
            ]
            for s, ix in zip(sources[0].shards, sources[0].indexes):
                assert ix.path == s.url and ix.signature  # local shards: stat-checked on every read
                for field in ("starts", "ends", "tokens", "trained"):
                    np.testing.assert_array_equal(getattr(ix, field), getattr(want[s.name], field))
            held = sum(a.nbytes for ix in sources[0].indexes for a in (ix.starts, ix.ends, ix.tokens, ix.trained))
            assert held <= 32 * sum(ix.num_samples for ix in sources[0].indexes)
    # shards listed out of manifest order (each once), or one named twice (a pattern): each still gets its own rows
    for shards in (ds.shards[::-1], ds.shards[1:] + ds.shards[:1], ds.shards + ds.shards[2:3]):
        got = trainer.data.index.dataset_indexes(ds.index, shards, rows=ds.index_rows, cache=tmp_path / "c")
        assert [ix.path for ix in got] == [s.url for s in shards]
        for s, ix in zip(shards, got):
            for field in ("starts", "ends", "tokens", "trained"):
                np.testing.assert_array_equal(getattr(ix, field), getattr(want[s.name], field))


def test_a_dataset_index_that_is_not_the_manifests_or_not_the_shards_is_refused(dataset, tmp_path):
    import hashlib

    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    path = bad / "samples.index.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"samples\.index\.npy: the sample index is not the one the manifest lists"):
        _sources(str(bad), tmp_path / "c")
    # the rows of one shard changed (its sidecar's sha256 no longer vouches for them): the whole file is hashed, refused
    rows = np.load(dataset / "samples.index.npy")
    rows["num_tokens"][3] += 1
    np.save(path, rows, allow_pickle=False)
    with pytest.raises(DataError, match=r"samples\.index\.npy: the sample index is not the one the manifest lists"):
        _sources(str(bad), tmp_path / "c")
    # cut short: refused before a row is trusted
    path.write_bytes((dataset / "samples.index.npy").read_bytes()[:-48])
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["sample_index"]["bytes"] = path.stat().st_size
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DataError, match=r"samples\.index\.npy: not a sample index \.npy .*header is not the one of 17 rows"
    ):
        _sources(str(bad), tmp_path / "c")
    shutil.copy(dataset / "manifest.json", bad / "manifest.json")
    # bytes the manifest vouches for, but a byte range outside its shard: refused, naming the shard, before any seek
    rows = np.load(dataset / "samples.index.npy")
    rows["end"][7] = 10**9
    np.save(path, rows, allow_pickle=False)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["sample_index"].update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    shard = next(
        s["name"]
        for s, a in zip(manifest["shards"], np.cumsum([s["num_samples"] for s in manifest["shards"]]))
        if a > 7
    )
    with pytest.raises(
        DataError, match=f"rows of {shard}\\): the sample index does not describe {shard} .*byte ranges"
    ):
        _sources(str(bad), tmp_path / "c")


def test_an_index_that_is_not_the_manifests_or_not_the_shards_is_refused(dataset, tmp_path):
    bad = _older(dataset, tmp_path / "bad", sidecars=True)
    side = bad / "shard-000002.tar.index.npy"
    side.write_bytes(side.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(DataError, match=r"shard-000002\.tar\.index\.npy: the sample index is not the one the manifest"):
        _sources(str(bad), tmp_path / "c")
    # bytes the manifest vouches for, but ranges outside the shard: refused before any seek
    rows = np.load(dataset / "shard-000002.tar.index.npy")
    rows["end"][-1] = 10**9
    np.save(side, rows, allow_pickle=False)
    manifest = json.loads((bad / "manifest.json").read_text())
    import hashlib

    entry = manifest["shards"][2]["index"]
    entry.update(bytes=side.stat().st_size, sha256=hashlib.sha256(side.read_bytes()).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="does not describe shard-000002.tar .*byte ranges"):
        _sources(str(bad), tmp_path / "c")


def test_cache_limit_sizes_and_the_span_that_fits(tmp_path):
    from trainer.data.datasets import RunData
    from trainer.data.pipeline import read_plan
    from trainer.options import DataOptions

    def fit_span(cfg, data):  # the span the run writes into its config.toml
        return read_plan(DataOptions.of(cfg), data, rank=0).shuffle_span

    assert cache_limit_bytes("50GB") == 50 * 10**9 and cache_limit_bytes("1.5GiB") == 3 << 29
    assert cache_limit_bytes("2000") == 2000 and cache_limit_bytes("") == 0
    for bad in ("lots", "-1GB", "5 PB"):
        with pytest.raises(ConfigError, match="shard_cache_limit"):
            TrainConfig(data="x", tiny_random="qwen2-vl", shard_cache_limit=bad)
    from trainer.data.sources import DataSource, ShardRef

    shards = tuple(ShardRef(f"https://h/d/s{i}.tar", f"s{i}.tar", 10, 100, 1000) for i in range(40))
    data = RunData(
        (DataSpec(path="https://h/d"),), [DataSource(shards, None, None)], [plan_shards(shards, 1)], None, "x"
    )
    cfg = TrainConfig(data="https://h/d", tiny_random="qwen2-vl", shard_cache_limit="8000", out=str(tmp_path))
    assert fit_span(cfg, data) == 4  # the block read and the next one fetched: 2 x 4 x 1000 bytes
    with pytest.raises(ConfigError, match="--shuffle-span 9 .* pass --shuffle-span 4"):
        fit_span(TrainConfig(**{**cfg.__dict__, "shuffle_span": 9}), data)
    with pytest.raises(ConfigError, match="less than one shard per dataset"):
        fit_span(TrainConfig(**{**cfg.__dict__, "shard_cache_limit": "999"}), data)
    assert fit_span(TrainConfig(**{**cfg.__dict__, "shard_cache_limit": ""}), data) == 0


def test_intervals_are_per_pass_and_sorted_by_first_read(dataset):
    from trainer.data.cache import intervals

    sources, _ = _sources(str(dataset), Path("/nonexistent"))
    order = schedule(sources, seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
    shard, first, last = intervals(sources, order, 0, np.ones(5, bool), [0])
    assert sorted(shard.tolist()) == list(range(5)) and (np.diff(first) > 0).all()
    # span 1: each shard is read in one run of positions, so its interval holds just its own samples
    assert ((last - first + 1) == np.array([sources[0].indexes[k].num_samples for k in shard])).all()
    later, _, _ = intervals(sources, order, 10, np.ones(5, bool), [0])
    assert len(later) < 5  # shards read before position 10 are not fetched again


def _to_memory(dataset: Path, base: str, corrupt: str = "") -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in dataset.rglob("*"):
        if p.is_file() and "tasks" not in p.parts:
            data = p.read_bytes()
            if p.name == corrupt:
                data = bytes([data[0] ^ 1]) + data[1:]
            fs.pipe(f"{base}/{p.relative_to(dataset)}", data)


def _read_all(sources, order, image_spec, cache, *, on_sample=lambda: None) -> list[str]:
    cache.begin(order, 0, 0)
    ids = []
    try:
        for s in ScheduledStream(sources, order, start=0, spec=image_spec, cache=cache.view):
            ids.append(s.id)
            on_sample()
    finally:
        cache.close()
    return ids


def test_a_memory_fs_dataset_streams_through_a_bounded_cache_in_schedule_order(dataset, image_spec, tmp_path):
    """fsspec's generic path: the sample indexes are fetched (sha256-checked), the shards are fetched in the order
    the schedule reads them and evicted once read, the cache never holding more than the limit; the samples are
    the local dataset's, in the same order."""
    from trainer.data.cache import ShardCache

    _to_memory(dataset, "memory://scale-ds")
    remote, _ = _sources("memory://scale-ds", tmp_path / "cache")
    local, _ = _sources(str(dataset), tmp_path / "unused")
    biggest = max(s.num_bytes for s in remote[0].shards)
    orders = [schedule(s, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1) for s in (remote, local)]
    cache = ShardCache(remote, tmp_path / "cache", limit=2 * biggest, prefetch=1)
    sizes = []
    ids = _read_all(remote, orders[0], image_spec, cache, on_sample=lambda: sizes.append(cache.size_bytes))
    want = [s.id for s in ScheduledStream(local, orders[1], start=0, spec=image_spec)]
    assert ids == want and len(ids) == 18
    assert max(sizes) <= 2 * biggest + 4096 and cache.fetched == 5 and cache.evicted >= 2
    firsts = [int(np.flatnonzero(orders[0].shard == k)[0]) for k in range(5)]
    assert cache.fetch_order == sorted(range(5), key=firsts.__getitem__)


def test_a_remote_shard_whose_bytes_differ_from_the_manifest_is_refused_naming_it(dataset, image_spec, tmp_path):
    from trainer.data.cache import ShardCache

    _to_memory(dataset, "memory://scale-bad", corrupt="shard-000003.tar")
    remote, _ = _sources("memory://scale-bad", tmp_path / "cache")
    order = schedule(remote, seed=1, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=1)
    with pytest.raises(DataError) as e:
        _read_all(remote, order, image_spec, ShardCache(remote, tmp_path / "cache"))
    assert str(e.value).startswith("memory://scale-bad/shard-000003.tar: its bytes do not match the manifest's sha256")
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").glob("*shard-000003.tar")) + list((tmp_path / "cache").glob("*.part"))


def test_hf_urls_resolve_through_fsspec(dataset, tmp_path):
    """hf:// goes through fsspec's protocol registry (huggingface_hub's HfFileSystem in use; no Hub here, so a
    memory filesystem registered as hf stands in): manifest, processor config, sample indexes."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class FakeHub(MemoryFileSystem):
        protocol = ("hf",)
        store: dict = {}
        pseudo_dirs = [""]

        @classmethod
        def _strip_protocol(cls, path):
            return "/" + str(path).removeprefix("hf://").strip("/")

    fsspec.register_implementation("hf", FakeHub, clobber=True)
    try:
        fs = FakeHub()
        for p in dataset.rglob("*"):
            if p.is_file() and "tasks" not in p.parts:
                fs.pipe(f"datasets/team/agent@main/v1/{p.relative_to(dataset)}", p.read_bytes())
        ds = resolve_data("hf://datasets/team/agent@main/v1")
        assert ds.shards[0].url == "hf://datasets/team/agent@main/v1/shard-000000.tar"
        sources, derived = _sources("hf://datasets/team/agent@main/v1", tmp_path / "c")
        assert derived == 0 and sum(ix.num_samples for ix in sources[0].indexes) == 18
        from trainer.data.processors import load_image_processor_config

        assert load_image_processor_config(ds.processor)["patch_size"] == 14
    finally:
        from huggingface_hub import HfFileSystem

        fsspec.register_implementation("hf", HfFileSystem, clobber=True)


def test_a_url_with_credentials_in_it_is_refused_without_echoing_them():
    for url in ("https://alice:hunter2@example.test/ds", "s3://AKIA:hunter2@bucket/ds"):
        with pytest.raises(DataError) as e:
            resolve_data(url)
        assert "hunter2" not in str(e.value) and "credentials" in str(e.value)


@pytest.fixture(scope="module")
def s3_server():
    """moto's server mode: a real HTTP server on loopback implementing the S3 REST API (s3fs talks to it over
    HTTP exactly as to S3). Credentials reach s3fs only through the standard AWS_* environment."""
    moto_server = pytest.importorskip("moto.server", reason="pip install 'moto[s3]' flask flask-cors")
    pytest.importorskip("s3fs")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    # fsspec caches filesystem instances by their arguments: one made for an earlier module's server (same worker)
    # would still point at that server's port, long closed.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    host, port = srv.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "scale-test-key",
        "AWS_SECRET_ACCESS_KEY": "scale-secret-0123456789",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        srv.stop()


def _to_s3(dataset: Path, bucket: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    for p in dataset.rglob("*"):
        if p.is_file() and "tasks" not in p.parts:
            fs.pipe(f"{bucket}/ds/{p.relative_to(dataset)}", p.read_bytes())
    fs.invalidate_cache()
    return f"s3://{bucket}/ds"


def test_s3_urls_resolve_and_stream_from_a_local_s3_server(s3_server, dataset, image_spec, tmp_path):
    from trainer.data.cache import ShardCache

    url = _to_s3(dataset, "scale-bucket")
    sources, derived = _sources(url, tmp_path / "cache")
    assert derived == 0 and sources[0].shards[0].url == f"{url}/shard-000000.tar"
    order = schedule(sources, seed=0, epoch=0, shuffle=True, shuffle_shards=True, shuffle_span=2)
    ids = _read_all(sources, order, image_spec, ShardCache(sources, tmp_path / "cache"))
    assert len(ids) == len(set(ids)) == 18
    with pytest.raises(DataError) as e:
        resolve_data("s3://no-such-bucket/ds")
    assert s3_server["AWS_SECRET_ACCESS_KEY"] not in str(e.value) and "no-such-bucket" in str(e.value)


def test_a_fetch_a_kill_cut_short_continues_with_a_range_read(dataset, tmp_path):
    """The loopback server answers Range requests: a .part left behind is continued, not fetched again, and the
    whole file is still checked against the manifest's sha256."""
    from tests.support.range_server import RangeServer
    from trainer.data.storage import fetch

    shard = resolve_data(str(dataset)).shards[1]
    dest = tmp_path / "copy.tar"
    Path(str(dest) + ".part").write_bytes(Path(shard.url).read_bytes()[:50_000])
    with RangeServer(dataset) as srv:
        fetch(f"{srv.url}/{shard.name}", dest, size=shard.num_bytes, sha256=shard.sha256)
        ranges = [r for m, p, r, _ in srv.log if m == "GET" and p.endswith(shard.name)]
    assert dest.read_bytes() == Path(shard.url).read_bytes() and not Path(str(dest) + ".part").exists()
    assert ranges and all(r and r.startswith("bytes=") for r in ranges) and ranges[0].startswith("bytes=50000-")


def test_a_nodes_ranks_fetch_the_remote_dataset_index_once(dataset, tmp_path):
    """8 ranks of one node start at once over HTTP: the dataset's sample index (48 bytes a sample of the whole
    dataset) is fetched once into the shard cache's shared dir, under a file lock, not once per rank; each rank gets
    its own shards' rows from it. A resume fetches nothing; a dataset rebuilt at the same URL gets its own copy."""
    import hashlib
    import threading

    from tests.support.range_server import RangeServer
    from trainer.data.pipeline import rank_sources

    local = resolve_data(str(dataset))
    want = {s.name: load_index(s, Path(s.index.url).read_bytes(), path=s.url) for s in local.shards}
    served = tmp_path / "served"
    shutil.copytree(dataset, served)
    root = tmp_path / "shard-cache"
    with RangeServer(served) as srv:
        ds = resolve_data(srv.url + "/")
        plan = plan_shards(ds.shards, 8)
        got, errors = {}, []

        def rank(r: int) -> None:
            try:
                got[r] = rank_sources(
                    (DataSpec(path=srv.url),), [ds], [plan], rank=r, world=8, cache=root / f"rank-{r:05d}"
                )[0][0]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def start_all() -> None:
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        start_all()
        fetched = [p for m, p, _, _ in srv.log if m == "GET" and p.endswith("samples.index.npy")]
        assert not errors and len(fetched) == 1
        for src in got.values():
            for s, ix in zip(src.shards, src.indexes):
                np.testing.assert_array_equal(ix.tokens, want[s.name].tokens)
                np.testing.assert_array_equal(ix.starts, want[s.name].starts)
        assert [p.name for p in (root / "indexes").iterdir() if p.suffix == ".npy"]
        assert not any(p.name.endswith(".npy") for r in range(8) for p in (root / f"rank-{r:05d}").glob("*"))
        srv.log.clear()
        start_all()  # a resume
        assert not errors and not [p for m, p, _, _ in srv.log if m == "GET" and p.endswith("samples.index.npy")]
        # rebuilt at the same URL (other rows, so another sha256 in its manifest): fetched again, into a copy of its own
        manifest = json.loads((served / "manifest.json").read_text())
        rows = np.load(served / "samples.index.npy")
        rows["id"][0] ^= 1
        np.save(served / "samples.index.npy", rows, allow_pickle=False)
        data = (served / "samples.index.npy").read_bytes()
        manifest["sample_index"]["sha256"] = hashlib.sha256(data).hexdigest()
        (served / "manifest.json").write_text(json.dumps(manifest))
        ds = resolve_data(srv.url + "/")
        srv.log.clear()
        start_all()
        assert not errors and len([p for m, p, _, _ in srv.log if m == "GET" and p.endswith("samples.index.npy")]) == 1
        assert len([p for p in (root / "indexes").iterdir() if p.suffix == ".npy"]) == 2


def test_a_store_that_sends_more_than_the_manifests_size_is_cut_off_past_it(tmp_path, monkeypatch):
    """An endless (or too long) answer: the fetch stops reading one byte past the listed size, refuses the file with
    one line and leaves nothing in the cache (not a disk filled first)."""
    import io

    import trainer.data.storage
    from trainer.data.storage import StorageError, fetch

    class Endless(io.RawIOBase):
        sent = 0

        def readable(self):
            return True

        def readinto(self, b):
            if Endless.sent > 64 << 20:
                raise AssertionError("read on past the listed size")
            Endless.sent += len(b)
            b[:] = b"\0" * len(b)
            return len(b)

    monkeypatch.setattr(trainer.data.storage, "open_url", lambda url: io.BufferedReader(Endless()))
    dest = tmp_path / "copy.tar"
    with pytest.raises(
        StorageError,
        match=r"https://example\.invalid/shard-000000\.tar: fetched 10001 bytes but the "
        r"manifest says 10000",
    ):
        fetch("https://example.invalid/shard-000000.tar", dest, size=10_000, sha256="0" * 64)
    assert Endless.sent <= 10_001 + io.DEFAULT_BUFFER_SIZE and list(tmp_path.iterdir()) == []


# --- the trainer CLI over loopback servers (slow)


def _small_shards(tmp_path: Path) -> Path:
    """24 one-sample shards of near-equal size (one image each): a dataset many times a small cache."""
    from scripts.demo_traces import write_traces

    traces = tmp_path / "one-image.jsonl.zst"
    write_traces(
        traces,
        n=24,
        seed=5,
        min_images=1,
        max_images=1,
        width=224,
        height=160,
        overlong_fraction=0.0,
        text_only_fraction=0.0,
    )
    return build_dataset(traces, tmp_path / "small", samples_per_shard=1)


def _train_polling(args: list, out: Path, cache_dir: Path, server) -> tuple[subprocess.CompletedProcess, int, int]:
    """Run the trainer; poll its shard cache's size (every file in it) and count the shard GETs the server had
    answered when the first step's metrics row appeared. Returns (process, peak cache bytes, GETs by step 1)."""
    peak, by_first = 0, None
    proc = subprocess.Popen(
        trainer_cmd([*args, "--out", out], 1),
        cwd=ROOT,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 900
    while proc.poll() is None:
        assert time.monotonic() < deadline, "trainer did not finish"
        if cache_dir.is_dir():
            peak = max(
                peak,
                sum(p.stat().st_size for p in cache_dir.glob("*") if p.is_file() and not p.name.endswith(".index.npy")),
            )
        if by_first is None and (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size:
            by_first = sum(1 for m, p, *_ in server.log if m == "GET" and p.endswith(".tar"))
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    return subprocess.CompletedProcess(proc.args, 0, stdout, stderr), peak, by_first


@pytest.mark.slow  # two trainer runs over loopback HTTP: ~3 min on 2 cores
def test_a_dataset_10x_the_cache_limit_trains_shuffled_and_mixed_every_sample_once(tmp_path):
    from tests.support.range_server import RangeServer

    small = _small_shards(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    for name in ("a", "b"):
        (served / name).symlink_to(small)
    shards = json.loads((small / "manifest.json").read_text())["shards"]
    total, biggest = sum(s["bytes"] for s in shards), max(s["bytes"] for s in shards)
    limit = max(total // 10, 2 * biggest)
    assert total >= 9 * limit, (total, limit)
    ids = {s["id"] for s in map(json.loads, (small / "tasks" / "task-00000.samples.jsonl").read_text().splitlines())}
    with RangeServer(served) as srv:
        common = ["--shard-cache-limit", str(limit), "--num-workers", 2, "--micro-batch-size", 2, "--seed", 4]
        proc, peak, by_first = _train_polling(
            ["--data", f"{srv.url}/a/", *common], tmp_path / "one", tmp_path / "one" / "shard-cache" / "rank-00000", srv
        )
        got = [i for m in read_metrics(tmp_path / "one") for i in m["sample_ids"]]
        assert sorted(got) == sorted(ids) and len(got) == 24 and got != sorted(got)  # once each, shuffled
        assert peak <= limit + biggest, (peak, limit)
        # Step 1 before the last shard is fetched: streaming, not fetch-all-first. (The prefetcher runs on while step 1
        # computes, as far as the cache limit lets it, so how far it got by then depends on the box's load.)
        assert by_first is not None and by_first < len(shards), by_first
        assert "remote shards stream through" in proc.stderr
        srv.log.clear()
        mix = [
            "--data",
            f"name=a,path={srv.url}/a/,weight=0.7,on_end=stop",
            "--data",
            f"name=b,path={srv.url}/b/,weight=0.3,on_end=stop",
        ]
        proc, peak, _ = _train_polling(
            [*mix, *common], tmp_path / "mix", tmp_path / "mix" / "shard-cache" / "rank-00000", srv
        )
        got = [i for m in read_metrics(tmp_path / "mix") for i in m["sample_ids"]]
        for name in ("a", "b"):
            mine = [i.split("/", 1)[1] for i in got if i.startswith(f"{name}/")]
            assert sorted(mine) == sorted(ids), name
        assert peak <= limit + biggest, (peak, limit)


@pytest.mark.slow  # a reference run, a killed run and its resume over loopback HTTP: ~3 min on 2 cores
def test_killed_and_resumed_over_http_with_a_small_cache_replays_bit_exactly(tmp_path):
    from tests.support.range_server import RangeServer

    small = _small_shards(tmp_path)
    shards = json.loads((small / "manifest.json").read_text())["shards"]
    limit = max(sum(s["bytes"] for s in shards) // 10, 2 * max(s["bytes"] for s in shards))
    with RangeServer(small) as srv:
        args = [
            "--data",
            f"{srv.url}/",
            "--shard-cache-limit",
            str(limit),
            "--micro-batch-size",
            2,
            "--save-every",
            2,
            "--seed",
            9,
        ]
        run_trainer([*args, "--out", tmp_path / "ref", "--num-workers", 1], timeout=600)
        ref = read_metrics(tmp_path / "ref")
        out = tmp_path / "killed"
        kill_at_step([*args, "--num-workers", 2], out, 5, tmp_path / "killed.log")
        proc = run_trainer([*args, "--out", out, "--num-workers", 3], timeout=600)
        assert "resumed from" in proc.stderr
    got = read_metrics(out)
    keys = ("step", "epoch", "sample_ids", "loss", "grad_norm")
    assert [[m[k] for k in keys] for m in got] == [[m[k] for k in keys] for m in ref]  # bit-exact


@pytest.mark.slow  # one trainer CLI run per case: ~1 min on 2 cores
def test_the_trainer_refuses_a_corrupted_remote_shard_with_one_line(dataset, tmp_path):
    from tests.support.range_server import RangeServer

    with RangeServer(dataset) as srv:
        srv.server.corrupt.add("shard-000001.tar")
        proc = subprocess.run(
            trainer_cmd(["--data", f"{srv.url}/", "--out", tmp_path / "run", "--num-workers", 2], 1),
            cwd=ROOT,
            env=trainer_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"trainer: error: {srv.url}/shard-000001.tar: its bytes do not match the manifest's sha256")


@pytest.mark.slow  # one trainer CLI run against the local S3 server: ~1 min on 2 cores
def test_training_from_s3_never_prints_or_stores_the_credentials(s3_server, dataset, tmp_path):
    url = _to_s3(dataset, "scale-train")
    out = tmp_path / "run"
    proc = run_trainer(["--data", url, "--out", out, "--max-steps", 2, "--num-workers", 1], timeout=600)
    secret, key = s3_server["AWS_SECRET_ACCESS_KEY"], s3_server["AWS_ACCESS_KEY_ID"]
    written = [
        p.read_text(errors="replace")
        for p in out.rglob("*")
        if p.is_file() and p.suffix in (".json", ".toml", ".jsonl", ".txt")
    ]
    for text in (proc.stdout, proc.stderr, *written):
        assert secret not in text and key not in text
    assert len(read_metrics(out)) == 2 and json.loads((out / "run.json").read_text())["data_source"] == url


def test_opening_a_manifest_costs_no_path_resolution_per_shard(dataset, tmp_path, monkeypatch):
    """Opening a dataset of many shards is O(shards) with a small constant: the names are checked against one
    listing of the dir (only symlinks resolved), not with two realpath walks each (8 s for 10^4 shards before)."""
    import os

    import vlmprep_schemas.boundary as boundary

    manifest = json.loads((dataset / "manifest.json").read_text())
    big = tmp_path / "big"
    shutil.copytree(dataset / "processor", big / "processor")
    entry, shards = manifest["shards"][0], []
    for k in range(2000):
        name = f"shard-{k:06d}.tar"
        with open(big / name, "wb") as f:
            f.truncate(entry["bytes"])
        shards.append({**entry, "name": name, "index": {**entry["index"], "name": name + ".index.npy"}})
    (big / "shard-000001.tar.index.npy").symlink_to(dataset / "shard-000000.tar.index.npy")  # a link out: refused
    manifest.pop("sample_index")
    (big / "manifest.json").write_text(json.dumps({**manifest, "shards": shards}))
    calls = []
    real = os.path.realpath
    monkeypatch.setattr(boundary.os.path, "realpath", lambda p, *a, **kw: calls.append(p) or real(p, *a, **kw))
    with pytest.raises(DataError, match=r"sample index 'shard-000001\.tar\.index\.npy' resolves to .* outside"):
        resolve_data(str(big))
    assert len(calls) <= 8, calls[:10]  # the manifest's and the link's own checks, not 4 per shard
    (big / "shard-000001.tar.index.npy").unlink()
    calls.clear()
    assert len(resolve_data(str(big)).shards) == 2000 and len(calls) <= 16  # the processor dir's own files


@pytest.mark.parametrize("shift", ["into_its_data", "to_its_second_member"])
def test_an_index_row_that_starts_inside_its_sample_blames_the_index_not_the_sample(
    dataset, image_spec, tmp_path, shift
):
    """Rows the manifest vouches for (a dataset edited, or built by a foreign tool), one starting inside its sample:
    the line says the index row and the shard disagree and names the row, where it used to call the intact sample
    unreadable."""
    import hashlib
    import tarfile

    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    path = bad / "samples.index.npy"
    rows = np.load(path)
    i = 4
    manifest = json.loads((bad / "manifest.json").read_text())
    k = int(np.searchsorted(np.cumsum([s["num_samples"] for s in manifest["shards"]]), i, side="right"))
    shard = manifest["shards"][k]["name"]
    k_first = sum(s["num_samples"] for s in manifest["shards"][:k])
    with tarfile.open(bad / shard) as tar:
        offsets = [t.offset for t in tar]
    start = int(rows["start"][i])
    rows["start"][i] = start + 512 if shift == "into_its_data" else min(o for o in offsets if o > start)
    np.save(path, rows, allow_pickle=False)
    manifest["sample_index"].update(bytes=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    (bad / "manifest.json").write_text(json.dumps(manifest))
    sources, _ = _sources(str(bad), tmp_path / "c")
    order = schedule(sources, seed=1, epoch=0, shuffle=False, shuffle_shards=False, shuffle_span=1)
    with pytest.raises(DataError) as e:
        list(ScheduledStream(sources, order, start=0, spec=image_spec))
    line = str(e.value)
    assert "\n" not in line and "index row" in line and "run `vlmprep verify`" in line, line
    assert (
        f"{shard}: index row {i - k_first} " in line and "unreadable" not in line and "missing members" not in line
    ), line

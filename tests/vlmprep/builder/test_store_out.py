"""--out in a store (issue 46.3 and 46.4), against moto's S3 server on loopback: the bucket ends holding the local
build's files byte for byte (the merge's rewritten shard included, manifest last); a build killed mid-way resumes on a
machine without its stage from what the bucket holds, re-running only unfinished tasks; --plan-only, --task-index in
scratch dirs of their own and `vlmprep merge URL` work with nothing shared but the bucket; a prefix holding files no
build wrote is refused."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer import test_remote
from tests.trainer.conftest import ROOT
from tests.vlmprep.conftest import OPTS, planned_cfg, tree_hashes
from vlmprep.builder.pipeline import build
from vlmprep.builder.store import STAGE_ENV, stage_for

s3_server = test_remote.s3_server  # moto's S3 server on loopback, module-scoped


@pytest.fixture
def bucket(s3_server, tmp_path, monkeypatch, request):
    """A new empty bucket per test, and this test's own stage root."""
    import s3fs

    monkeypatch.setenv(STAGE_ENV, str(tmp_path / "stages"))
    fs = s3fs.S3FileSystem()
    # the test's name cut to fit a bucket name, and a digest of its whole id: parametrized cases (and two tests whose
    # names share their first 40 characters) each get their own bucket on the module's server
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    name = f"out-{request.node.name.lower().replace('_', '-')[:40].strip('-')}-{digest}"
    fs.mkdir(name)
    return fs, name


def _objects(fs, prefix: str) -> dict:
    import hashlib

    fs.invalidate_cache()
    return {k[len(prefix) + 1 :]: hashlib.sha256(fs.cat_file(k)).hexdigest() for k in sorted(fs.find(prefix))}


# OPTS on the command line
FLAGS = [
    "--processor",
    OPTS["processor"],
    "--seq-len",
    str(OPTS["seq_len"]),
    "--samples-per-shard",
    str(OPTS["samples_per_shard"]),
    "--chat-template",
    OPTS["chat_template"],
    "--max-reject-fraction",
    "1",
    "--min-turn-coverage",
    "0",
]


def _local(d: Path) -> dict:
    return {k: v for k, v in tree_hashes(d).items() if not k.endswith(".lock")}


def _kill_once(fs, args: list[str], ready) -> None:
    """`vlmprep ARGS` in a subprocess, SIGKILLed as soon as ready() holds (or it ends)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vlmprep", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if ready():
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmprep", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow  # ~16 s on 2 cores; make test keeps test_plan_tasks_and_merge_share_nothing_but_the_bucket and
# test_append_store's bucket-equals-local build (S3 out), test_remote's trainer streaming from S3 (make test-all runs it)
def test_a_build_into_s3_holds_the_local_build_byte_for_byte(bucket, task_traces, local3, tmp_path):
    """The bucket holds the local 3-task build's files (the merge's rewritten shard included); `vlmprep verify URL`
    passes; the trainer trains a step from the URL; the secret key is in no output, run file or object."""
    fs, name = bucket
    ref, ref_res = local3
    url = f"s3://{name}/ds"
    res = build(planned_cfg(task_traces, url, tasks=3, workers=2))
    assert _objects(fs, f"{name}/ds") == _local(ref)
    assert res.manifest == ref_res.manifest and str(res.out) == url
    assert not stage_for(url).exists()  # removed once the manifest is up
    from typer.testing import CliRunner

    from vlmprep.cli import app

    os.environ["VLMPREP_CACHE"] = str(tmp_path / "cache")
    try:
        r = CliRunner().invoke(app, ["verify", url])
    finally:
        del os.environ["VLMPREP_CACHE"]
    assert r.exit_code == 0 and "OK" in r.output, r.output
    from tests.trainer.conftest import run_trainer

    proc = run_trainer(["--data", url, "--out", tmp_path / "run", "--max-steps", "1", "--num-workers", "0"])
    assert "trainer: done at step 1" in proc.stdout + proc.stderr
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    assert secret not in proc.stdout + proc.stderr + r.output
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not [k for k in fs.find(f"{name}/ds") if secret.encode() in fs.cat_file(k)]


def test_a_prefix_holding_files_no_build_wrote_is_refused(bucket, task_traces, tmp_path):
    from vlmprep.builder.workers import BuildError

    fs, name = bucket
    fs.pipe(f"{name}/ds/notes.txt", b"mine")
    with pytest.raises(BuildError, match=rf"--out s3://{name}/ds holds files no vlmprep build wrote \(notes.txt\)"):
        build(planned_cfg(task_traces, f"s3://{name}/ds", tasks=3))
    fs.invalidate_cache()
    assert fs.find(f"{name}/ds") == [f"{name}/ds/notes.txt"]


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_a_killed_build_resumes_from_the_bucket_without_its_stage(bucket, task_traces, local3, tmp_path):
    """SIGKILL once task 0's manifest is in the bucket; the stage is then deleted (another machine): the rerun fetches
    the plan and the finished tasks, runs the rest, and the bucket holds the local build; task 0's shards were not
    uploaded again."""
    fs, name = bucket
    ref, _ = local3
    url = f"s3://{name}/ds"
    args = ["build", "--in", str(task_traces), "--out", url, "--tasks", "3", "--workers", "1", "--no-progress", *FLAGS]
    _kill_once(fs, args, lambda: fs.exists(f"{name}/ds/tasks/task-00000.json"))
    assert not fs.exists(f"{name}/ds/manifest.json"), "the build ended before it could be killed"
    first = sorted(k for k in fs.find(f"{name}/ds") if Path(k).name.startswith("shard-00000-"))
    assert first, "task 0 finished without shards"
    before = {k: fs.info(k)["LastModified"] for k in first}
    import shutil

    shutil.rmtree(stage_for(url))
    r = _run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {url}" in r.stderr
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in r.stdout + r.stderr
    assert _objects(fs, f"{name}/ds") == _local(ref)
    fs.invalidate_cache()
    assert {k: fs.info(k)["LastModified"] for k in first} == before


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_a_build_killed_mid_task_resumes_from_its_stage_with_its_shards_in_the_bucket(bucket, task_traces, tmp_path):
    """--tasks 1: each shard leaves the stage once it is up. SIGKILL once the first shard is in the bucket and gone
    from the stage; the rerun on the same machine (stage kept) resumes from the task's journal, checking that shard
    in the bucket: it is not sent again, and the bucket ends holding the local build."""
    fs, name = bucket
    ref = tmp_path / "ref"
    build(planned_cfg(task_traces, ref, tasks=1, workers=1))
    url = f"s3://{name}/ds"
    args = ["build", "--in", str(task_traces), "--out", url, "--workers", "1", "--no-progress", *FLAGS]
    first, stage = f"{name}/ds/shard-000000.tar", stage_for(url)
    _kill_once(fs, args, lambda: fs.exists(first) and not (stage / "shard-000000.tar").exists())
    assert not fs.exists(f"{name}/ds/manifest.json"), "the build ended before it could be killed"
    assert fs.exists(first) and not (stage / "shard-000000.tar").exists() and list(stage.rglob("*.journal.json"))
    before = fs.info(first)["LastModified"]
    r = _run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _objects(fs, f"{name}/ds") == _local(ref)
    fs.invalidate_cache()
    assert fs.info(first)["LastModified"] == before  # resumed from the journal, not started over


def test_plan_tasks_and_merge_share_nothing_but_the_bucket(bucket, task_traces, local3, tmp_path, monkeypatch):
    """--plan-only on one "machine", each --task-index in a scratch dir of its own, `vlmprep merge URL` on a third
    (each with its own stage root): the bucket holds the local build."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    fs, name = bucket
    ref, _ = local3
    url = f"s3://{name}/ds"
    base = ["--out", url, "--no-progress"]
    monkeypatch.setenv(STAGE_ENV, str(tmp_path / "planner"))
    r = CliRunner().invoke(app, ["build", "--in", str(task_traces), *base, "--tasks", "3", "--plan-only", *FLAGS])
    assert r.exit_code == 0, r.output
    for i in range(3):
        monkeypatch.setenv(STAGE_ENV, str(tmp_path / f"task{i}"))
        r = CliRunner().invoke(app, ["build", *base, "--task-index", str(i)])
        assert r.exit_code == 0, r.output
        assert not (tmp_path / f"task{i}").exists()
    monkeypatch.setenv(STAGE_ENV, str(tmp_path / "merger"))
    r = CliRunner().invoke(app, ["merge", url, "--max-reject-fraction", "1", "--min-turn-coverage", "0"])
    assert r.exit_code == 0, r.output
    assert _objects(fs, f"{name}/ds") == _local(ref)
    shards = sorted(k for k in fs.find(f"{name}/ds") if Path(k).name.startswith("shard-00000-"))
    before = {k: fs.info(k)["LastModified"] for k in shards}
    r = CliRunner().invoke(app, ["build", *base, "--task-index", "0"])  # a rerun of a finished array job
    assert r.exit_code == 0, r.output
    fs.invalidate_cache()
    assert {k: fs.info(k)["LastModified"] for k in shards} == before and _objects(fs, f"{name}/ds") == _local(ref)


def test_the_stage_never_holds_a_finished_tasks_shards(bucket, task_traces, local3, monkeypatch):
    """Each shard leaves the stage once it is up: at the merge the stage holds none, and the merge fetches back only
    the shards it rewrites (ids repeated across tasks). The bucket still ends holding the local build."""
    import json

    from vlmprep.builder import pipeline, store

    fs, name = bucket
    ref, _ = local3
    url = f"s3://{name}/ds"
    seen, fetched = {}, []
    merge_tasks, fetch = pipeline.merge_tasks, store.StoredShards.fetch

    def spy(out, stored=None, *rest):
        seen["before"] = sorted(p.name for p in Path(out).glob("shard-*.tar"))
        manifest = merge_tasks(out, stored, *rest)
        seen["after"] = sorted(p.name for p in Path(out).glob("shard-*.tar"))
        return manifest

    monkeypatch.setattr(pipeline, "merge_tasks", spy)
    monkeypatch.setattr(store.StoredShards, "fetch", lambda self, n, local: fetched.append(n) or fetch(self, n, local))
    build(planned_cfg(task_traces, url, tasks=3, workers=1))
    tasks = sorted((ref / "tasks").glob("task-*[0-9].json"))
    listed = {s["name"]: s["sha256"] for t in tasks for s in json.loads(t.read_text())["shards"]}
    final = {s["name"]: s["sha256"] for s in json.loads((ref / "manifest.json").read_text())["shards"]}
    rewritten = sorted(n for n in listed if final.get(n) != listed[n])  # emptied (gone) or rewritten
    assert seen["before"] == [] and rewritten and fetched == rewritten, (seen, fetched, rewritten)
    assert seen["after"] == [n for n in rewritten if n in final] and len(listed) > len(rewritten)
    assert _objects(fs, f"{name}/ds") == _local(ref)


def test_a_shard_cut_short_in_the_bucket_is_refused_by_the_merge(bucket, task_traces, local3):
    """`vlmprep merge URL` of a finished dataset again gives the same bytes (the shard the first merge emptied is gone
    from the bucket, as it should be). The merge checks each shard in the bucket by the size its task manifest lists:
    one cut short there after its task uploaded it is refused, naming the task and the rerun; no manifest is written."""
    from vlmprep.builder.merge import MergeError
    from vlmprep.builder.pipeline import merge

    fs, name = bucket
    ref, _ = local3
    url = f"s3://{name}/ds"
    build(planned_cfg(task_traces, url, tasks=3, workers=1))
    merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
    assert _objects(fs, f"{name}/ds") == _local(ref)
    shard = sorted(k for k in fs.find(f"{name}/ds") if Path(k).name.startswith("shard-00000-") and k.endswith(".tar"))[
        0
    ]
    fs.pipe(shard, fs.cat_file(shard)[:-512])
    fs.rm(f"{name}/ds/manifest.json")
    with pytest.raises(MergeError, match=r"bytes in the bucket, but tasks/task-00000.json lists \d+ .*--task-index 0"):
        merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
    fs.invalidate_cache()
    assert not fs.exists(f"{name}/ds/manifest.json")


def _same_ids_other_text(data: bytes) -> bytes:
    """A shard's bytes with its first sample's trained tokens changed and nothing else: the same ids, members, sizes
    and meta, a valid shard."""
    import io
    import tarfile

    import numpy as np

    src, out = tarfile.open(fileobj=io.BytesIO(data)), io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as dst:
        done = False
        for m in src.getmembers():
            body = src.extractfile(m).read()
            if not done and m.name.endswith(".input_ids.npy"):
                ids = np.load(io.BytesIO(body))
                ids[-2:] = ids[-2:][::-1] + 1
                buf = io.BytesIO()
                np.save(buf, ids)
                body, done = buf.getvalue(), True
            info = tarfile.TarInfo(m.name)
            info.size, info.mtime, info.mode = len(body), m.mtime, m.mode
            dst.addfile(info, io.BytesIO(body))
    assert done
    return out.getvalue()


def test_the_merge_refuses_a_rewritten_shard_changed_in_the_bucket_that_keeps_its_ids(bucket, task_traces):
    """A finished build into the bucket; the shard its merge rewrote (without an id repeated across tasks) is replaced
    there by one holding exactly the ids it keeps but other trained tokens, and the manifest removed: `vlmprep merge
    URL` refuses it naming the shard and its task, and writes no manifest (before: it took it for its own earlier
    rewrite by its ids, and certified it; `verify` then said OK). A merge run again on the untouched bucket gives
    the same bytes (it knows its own rewrite by the sha256 it recorded, tasks/merge.rewrites.json)."""
    import json

    from vlmprep.builder.merge import MergeError
    from vlmprep.builder.pipeline import merge

    fs, name = bucket
    url = f"s3://{name}/ds"
    build(planned_cfg(task_traces, url, tasks=3, workers=1, samples_per_shard=64))  # a task's samples in one shard
    merged = _objects(fs, f"{name}/ds")
    tasks = [json.loads(fs.cat_file(f"{name}/ds/tasks/task-{i:05d}.json")) for i in range(3)]
    listed = {s["name"]: s["sha256"] for t in tasks for s in t["shards"]}
    final = {s["name"]: s["sha256"] for s in json.loads(fs.cat_file(f"{name}/ds/manifest.json"))["shards"]}
    [shard] = [n for n in final if final[n] != listed[n]]  # rewritten, not emptied
    merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
    assert _objects(fs, f"{name}/ds") == merged
    key = f"{name}/ds/{shard}"
    fs.pipe(key, _same_ids_other_text(fs.cat_file(key)))
    fs.rm(f"{name}/ds/manifest.json")
    task = int(shard.split("-")[1])
    with pytest.raises(
        MergeError, match=rf"{shard}: sha256 [0-9a-f]{{16}}\.\.\., but tasks/task-{task:05d}.json lists"
    ):
        merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
    fs.invalidate_cache()
    assert not fs.exists(f"{name}/ds/manifest.json")
    rewrites = json.loads(fs.cat_file(f"{name}/ds/tasks/merge.rewrites.json"))  # what the merge made of it
    assert rewrites == {shard: [listed[shard], final[shard]]}, rewrites


def test_the_merge_fetches_only_shards_a_task_manifest_lists(bucket, task_traces, monkeypatch):
    """A task's sample rows name the shard each sample landed in; a row naming another object of the dataset (here
    rejects.jsonl) for a repeated id does not make the merge fetch that object into its stage: only shards the task
    manifests list are fetched. The merge then refuses (the shard the rows no longer name is missing)."""
    import json

    from vlmprep.builder import store
    from vlmprep.builder.merge import MergeError
    from vlmprep.builder.pipeline import merge

    fs, name = bucket
    url = f"s3://{name}/ds"
    build(planned_cfg(task_traces, url, tasks=3, workers=1))
    rows_key = f"{name}/ds/tasks/task-00002.samples.jsonl"
    final = {s["name"] for s in json.loads(fs.cat_file(f"{name}/ds/manifest.json"))["shards"]}
    rows = [json.loads(line) for line in fs.cat_file(rows_key).decode().splitlines()]
    moved = [r for r in rows if r["shard"] not in final]  # the rows of the shard the first merge emptied
    assert moved
    for r in moved:
        r["shard"] = "rejects.jsonl"
    fs.pipe(rows_key, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())
    fs.rm(f"{name}/ds/manifest.json")
    fetched, fetch = [], store.StoredShards.fetch
    monkeypatch.setattr(store.StoredShards, "fetch", lambda self, n, local: fetched.append(n) or fetch(self, n, local))
    with pytest.raises(MergeError, match="listed in tasks/task-00002.json but missing"):
        merge(url, max_reject_fraction=1.0, min_turn_coverage=0.0)
    assert fetched == []


@pytest.mark.slow  # make-test budget: a Ray cluster's start (~12 s on 2 cores) and two 3-task builds
def test_a_ray_build_with_nothing_shared_but_the_bucket_equals_a_local_build(
    bucket, task_traces, tmp_path, monkeypatch
):
    """Inputs and --out in the bucket, --executor ray: each Ray task runs in a scratch dir of its own (fetching the
    plan and processor from the bucket, uploading its files), the driver merges what the bucket holds; the bucket then
    holds a local one-machine build of the same inputs, byte for byte. The driver runs from an empty dir."""
    ray = pytest.importorskip("ray")
    fs, name = bucket
    fs.pipe(f"{name}/in/traces.jsonl", task_traces.read_bytes())
    fs.invalidate_cache()
    src = f"s3://{name}/in/traces.jsonl"
    ref = tmp_path / "ref"
    build(planned_cfg(src, ref, tasks=3, workers=2))
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        url = f"s3://{name}/ds"
        build(planned_cfg(src, url, tasks=3, workers=2, executor="ray"))
    finally:
        ray.shutdown()
    assert _objects(fs, f"{name}/ds") == _local(ref)
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_finished_task_asks_after_its_own_objects_not_a_listing_of_the_prefix(bucket, local3, monkeypatch):
    """Uploader.task_done looks up the task's own shards one by one: listing the whole prefix per task costs tasks x
    objects on a big build. Sent once; a second call (a retry) finds the task's manifest up and sends nothing."""
    from vlmprep.builder.plan import load_plan, shard_prefix
    from vlmprep.builder.store import Bucket, Uploader
    from vlmprep.shards.dataset import TaskFiles
    from vlmprep.shards.manifest import load_task_manifest

    fs, name = bucket
    ref, _ = local3
    plan = load_plan(ref)
    files = TaskFiles(ref, 1, shard_prefix(plan, 1))
    manifest = load_task_manifest(files)
    listed = []
    monkeypatch.setattr(Bucket, "names", lambda self: listed.append(self.url) or {})
    up = Uploader(f"s3://{name}/ds", ref)
    up.task_done(files, manifest)
    got = _objects(fs, f"{name}/ds")
    want = {s.name for s in manifest.shards} | {s.index.name for s in manifest.shards if s.index}
    assert want <= set(got) and "tasks/task-00001.json" in got and not listed
    put = []
    monkeypatch.setattr(Bucket, "put", lambda self, local, n: put.append(n))
    again = Uploader(f"s3://{name}/ds", ref)
    again.task_done(files, manifest)
    assert put == [], put  # the bucket holds this task's manifest: its files went up before it, nothing is sent

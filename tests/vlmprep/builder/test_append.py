"""`vlmprep build --append` (issue 55.1, docs/datasets-that-grow.md): three appends of three batches give a latest
version whose samples (keys, ids, metas, token ids, masks, pixels) and totals equal one build of all three, version
by version in order; version 1's files stay byte-identical; the same with --tasks 2 and with --task-index + merge;
an id already in an earlier version is a duplicate_id reject of the new version; an option that changes samples is
refused in one line naming it and both values; an input already in a version is skipped; two appends cannot both
commit one version; a kill between the commit and manifest.json is repaired."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmprep.builder.checks import RejectsError
from vlmprep.builder.owner import own_out
from vlmprep.builder.pipeline import build, build_task, merge
from vlmprep.cli import app
from vlmprep.config import PER_VERSION, BuildConfig
from vlmprep.shards.manifest import open_dataset, shard_paths
from vlmprep.shards.reader import iter_shard
from vlmprep.shards.rejects_file import iter_rejects
from vlmprep.shards.versions import CommitConflict, commit_record
from vlmprep.tools.stats import compute_stats
from vlmprep.tools.verify import verify_dataset
from vlmprep_schemas.versions import version_name

OPTS = dict(
    processor="tiny:qwen2-vl",
    seq_len=2048,
    samples_per_shard=2,
    chat_template="qwen2_vl_tools",
    max_reject_fraction=1.0,
    min_turn_coverage=0.0,
    progress=False,
)
FLAGS = ["--processor", "tiny:qwen2-vl", "--seq-len", "2048", "--samples-per-shard", "2"]
FLAGS += ["--chat-template", "qwen2_vl_tools", "--max-reject-fraction", "1", "--min-turn-coverage", "0"]


def cfg(inputs, out, **kw) -> BuildConfig:
    return BuildConfig(inputs=tuple(map(str, inputs)), out=str(out), **{**OPTS, **kw})


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def samples(ref) -> list[tuple]:
    """Every sample of a dataset version in order: key, meta, token ids, loss mask and decoded pixels."""
    d, m = open_dataset(ref)
    return [
        (
            s.key,
            s.meta(),
            s.array("input_ids").tolist(),
            s.array("loss_mask").tolist(),
            [hashlib.sha256(im.tobytes()).hexdigest() for im in s.images()],
        )
        for path in shard_paths(d, m)
        for s in iter_shard(path, version=m.format_version)
    ]


def one_record(path: Path, rid: str = "x4") -> Path:
    """A text-only input of one record."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text(json.dumps({"id": rid, "messages": chat}) + "\n")
    return path


def files_of(d: Path) -> dict[str, str]:
    """sha256 of every file of a dataset dir but its build state (plan, tasks, lock) and the moving manifest.json."""
    skip = ("plan.json", "manifest.json", ".vlmprep.lock")
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in skip and "tasks" not in p.relative_to(d).parts
    }


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """Three batches of 3 small demo traces (ids b0-..., b1-..., b2-...), one dir."""
    from scripts.demo_traces import write_traces

    d = tmp_path_factory.mktemp("batches")
    for k in range(3):
        write_traces(
            d / f"b{k}.jsonl.zst", id_prefix=f"b{k}-", n=3, seed=k, width=160, height=64, min_images=1, max_images=2
        )
    return [d / f"b{k}.jsonl.zst" for k in range(3)]


@pytest.fixture(scope="module")
def single(batches, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "ds"
    build(cfg(batches, out))
    return out


@pytest.fixture(scope="module")
def grown(batches, tmp_path_factory):
    """Batch 0 built, then batches 1 and 2 appended; with v1's files (sha256) and manifest bytes before the appends."""
    out = tmp_path_factory.mktemp("grown") / "ds"
    build(cfg(batches[:1], out))
    before = files_of(out), (out / "manifest.json").read_bytes()
    for b in batches[1:]:
        res = build(cfg([b], out, append=True))
        assert res.added is not None and res.manifest.version["number"] == res.plan.version
    return out, before


def test_three_appends_equal_one_build_version_by_version(grown, single, batches):
    out, (v1_files, v1_manifest) = grown
    want = samples(single)
    at = 0
    for n in (1, 2, 3):
        got = samples(f"{out}@v{n}")
        assert len(got) == 3 * n  # every record of the demo batches lands as one sample
        assert got == want[: len(got)], f"version {n}"
        assert not verify_dataset(Path(f"{out}@v{n}")), f"version {n} verifies"
        at = len(got)
    assert at == len(want)
    d, latest = open_dataset(out)
    _, one = open_dataset(single)
    assert latest.totals == one.totals and latest.turns == one.turns and latest.rejects == one.rejects
    assert latest.version["number"] == 3 and latest.version["parent"] == 2
    assert (out / version_name(1)).read_bytes() == v1_manifest  # version 1: the dataset's manifest, byte for byte
    now = files_of(out)
    assert {k: now[k] for k in v1_files} == v1_files  # nothing of version 1 changed
    # each version's added totals sum to the latest's; its own rejects file and shards are named
    added = [json.loads((out / version_name(n)).read_text())["version"]["added"] for n in (2, 3)]
    first = json.loads((out / version_name(1)).read_text())["totals"]
    assert {k: first[k] + sum(a["totals"][k] for a in added) for k in first} == latest.totals
    assert [a["rejects_file"] for a in added] == ["rejects.v000002.jsonl", "rejects.v000003.jsonl"]
    assert all(name.startswith("shard-v000002-") for name in added[0]["shards"])
    assert [i["path"] for a in added for i in a["inputs"]] == [str(b) for b in batches[1:]]
    assert all(i["bytes"] == Path(i["path"]).stat().st_size and i["mtime_ns"] for a in added for i in a["inputs"])
    assert (out / "manifest.json").read_bytes() == (out / version_name(3)).read_bytes()


def test_an_option_that_changes_samples_is_refused_in_one_line(grown, batches, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    before = files_of(out)
    for flag, value, there in (
        ("--seq-len", "4096", "--seq-len 2048"),
        ("--chat-template", "qwen2_vl", "--chat-template qwen2_vl_tools"),
        ("--processor", "tiny:qwen2.5-vl", "--processor tiny:qwen2-vl"),
    ):
        flags = list(FLAGS)
        flags[flags.index(flag) + 1] = value
        r = invoke("build", "--append", "--in", one_record(tmp_path / "new.jsonl"), "--out", out, *flags)
        assert r.exit_code == 1
        lines = r.output.strip().splitlines()
        assert len(lines[-1:]) == 1 and f"{flag} {value} asked, but {out} was built with {there}" in lines[-1], r.output
    assert files_of(out) == before


def test_an_append_takes_the_dataset_options_it_is_not_given(grown, batches, tmp_path):
    """`build --append --in NEW --out DIR` alone: every sample option not given is the dataset's own (processor, chat
    template, --seq-len ...); one given that differs is still refused, naming it; one given equal passes."""
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    before = files_of(out)
    r = invoke("build", "--append", "--in", one_record(tmp_path / "new.jsonl"), "--out", out, "--seq-len", "4096")
    assert r.exit_code == 1 and "--seq-len 4096 asked, but" in r.output.strip().splitlines()[-1], r.output
    assert files_of(out) == before
    r = invoke("build", "--append", "--in", one_record(tmp_path / "new.jsonl"), "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "appended version v4" in r.output and "with tiny:qwen2-vl into" in r.output
    config = json.loads((out / version_name(4)).read_text())["config"]
    v3 = json.loads((out / version_name(3)).read_text())["config"]
    assert {k: v for k, v in config.items() if k not in PER_VERSION} == {
        k: v for k, v in v3.items() if k not in PER_VERSION
    }
    r = invoke("build", "--append", "--in", one_record(tmp_path / "b5.jsonl", "x5"), "--out", out, "--seq-len", "2048")
    assert r.exit_code == 0 and "appended version v5" in r.output, r.output


def test_what_an_append_does_not_inherit(tmp_path):
    """A chat template given as a file, --role-boundaries and --allow-remote are not taken from the dataset (vlmprep
    reads no file a dataset names, grants it no remote reads): left out, the append refuses naming them; a bundled
    template and every other sample option are taken; per-version options and given ones are kept."""
    from vlmprep.builder.append import inherit_options

    (tmp_path / "ds").mkdir()
    config = dict(chat_template="/tmp/t.jinja", role_boundaries="/tmp/r.json", allow_remote=True, seq_len=999)
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({"config": {**config, "workers": 7, "max_pixels": 5}}))
    values = dict(chat_template=None, role_boundaries=None, allow_remote=False, seq_len=8, workers=1, max_pixels=6)
    got = inherit_options(values, str(tmp_path / "ds"), given={"max_pixels"})
    assert got == {**values, "seq_len": 999}
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({"config": {"chat_template": "qwen2_vl_tools"}}))
    assert inherit_options(values, str(tmp_path / "ds"), given=set())["chat_template"] == "qwen2_vl_tools"
    for bad in (b"[1]", b"{", b"x" * 10):  # not a manifest: nothing taken (the append then says why in one line)
        (tmp_path / "ds" / "manifest.json").write_bytes(bad)
        assert inherit_options(values, str(tmp_path / "ds"), given=set()) == values
    assert inherit_options(values, str(tmp_path / "nothing"), given=set()) == values


def test_duplicate_ids_of_earlier_versions_are_rejects_of_the_new_version(grown, batches, tmp_path):
    """A batch holding one record of version 1 again (same id) and one new: the old one is a duplicate_id reject of
    version 4, counted in its totals, its rejects and rejects.v000004.jsonl; nothing of it lands twice."""
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    import zstandard

    old = zstandard.ZstdDecompressor().decompress(batches[0].read_bytes(), max_output_size=1 << 28).splitlines()[1]
    new = dict(json.loads(old), id="fresh-1")
    p = tmp_path / "b3.jsonl"
    p.write_bytes(old + b"\n" + json.dumps(new).encode() + b"\n")
    res = build(cfg([p], out, append=True))
    added = res.manifest.version["added"]
    assert added["rejects"] == {"duplicate_id": 1} and added["totals"]["rejected"] == 1
    assert added["totals"]["records"] == 2 and added["totals"]["samples"] == 1
    assert res.manifest.rejects["duplicate_id"] == 1 and res.manifest.totals["samples"] == 10
    [line] = list(iter_rejects(out / "rejects.v000004.jsonl"))
    assert line["reason"] == "duplicate_id" and line["id"] == json.loads(old)["id"]
    ids = [s[1]["id"] for s in samples(out)]
    assert len(ids) == len(set(ids)) == 10 and "fresh-1" in ids
    assert not verify_dataset(out)
    st = compute_stats(out)  # every version's rejects file read: they add up to the record's counts
    assert st["rejects"] == {"duplicate_id": 1} and not st["mismatches"], st["mismatches"]


def test_an_input_in_a_version_is_skipped_and_a_changed_one_refused(grown, batches, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    before = files_of(out)
    r = invoke("build", "--append", "--in", batches[1], "--out", out, *FLAGS)
    assert r.exit_code == 0, r.output
    assert f"{batches[1]} is in {out} already (unchanged): skipped" in r.output
    assert "nothing to append; it stays at v3 (9 samples)" in r.output
    assert files_of(out) == before and not (out / version_name(4)).exists()
    changed = tmp_path / "b1.jsonl.zst"
    shutil.copy(batches[1], changed)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["inputs"]:  # as if this copy had been built into version 2
        entry["path"] = str(changed) if entry["path"] == str(batches[1]) else entry["path"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / version_name(3)).write_text(json.dumps(manifest))
    os.utime(changed, ns=(1, 1))
    r = invoke("build", "--append", "--in", changed, "--out", out, *FLAGS)
    assert r.exit_code == 1 and "has changed since" in r.output and "put the new records in a new file" in r.output


@pytest.mark.parametrize("where", ["missing", "empty", "file"])
def test_append_to_no_dataset_is_refused_in_one_line(batches, tmp_path, where):
    out = tmp_path / "ds"
    if where == "empty":
        out.mkdir()
    if where == "file":
        out.write_text("x")
    r = invoke("build", "--append", "--in", batches[0], "--out", out, *FLAGS)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 2, r.output  # the reading line, the error
    assert "drop --append for a first build" in r.output or "is a file" in r.output
    assert out.exists() == (where != "missing") and (where != "empty" or not any(out.iterdir()))


def test_a_plain_build_into_a_versioned_dataset_is_refused(grown, batches, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    before = files_of(out)
    r = invoke("build", "--in", batches[0], "--out", out, *FLAGS)
    assert r.exit_code == 1 and "holds a dataset with versions (v3): pass --append" in r.output
    assert files_of(out) == before


def test_two_appends_cannot_both_commit_one_version(grown, batches, tmp_path):
    """The --out lock refuses a second append while one runs; and where two commits meet anyway (another machine on
    a shared file system), the exclusive creation of the record lets exactly one win: the loser commits nothing."""
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    extra = one_record(tmp_path / "b4.jsonl")
    with own_out(out):
        r = invoke("build", "--append", "--in", extra, "--out", out, *FLAGS)
    assert r.exit_code == 1 and "is in use by" in r.output and len(r.output.strip().splitlines()) == 2
    winner = b'{"someone": "else"}\n'
    with pytest.raises(CommitConflict):
        commit_record(out, 3, winner)  # version 3 exists
    import vlmprep.builder.pipeline as pipeline

    real = pipeline.version_record

    def racing(out_dir, plan, added, *removal):  # another build commits version 4 just before this one does
        data = real(out_dir, plan, added, *removal)
        commit_record(out_dir, plan.version, winner)
        return data

    pipeline.version_record = racing
    try:
        with pytest.raises(CommitConflict, match="version 4 was committed by another build meanwhile"):
            build(cfg([extra], out, append=True))
    finally:
        pipeline.version_record = real
    assert (out / version_name(4)).read_bytes() == winner  # the winner's record, untouched
    assert (out / "manifest.json").read_bytes() == (out / version_name(3)).read_bytes()  # the loser's never named


def test_a_manifest_behind_its_highest_record_is_repaired(grown, batches, tmp_path):
    """A kill between the record's creation and manifest.json's copy: the next append says so and repairs it first."""
    out = tmp_path / "ds"
    shutil.copytree(grown[0], out)
    (out / "manifest.json").write_bytes((out / version_name(2)).read_bytes())
    r = invoke("build", "--append", "--in", batches[2], "--out", out, *FLAGS)
    assert r.exit_code == 0, r.output
    assert "manifest.json was at version 2, behind versions/v000003.json (a commit cut short): repaired" in r.output
    assert (out / "manifest.json").read_bytes() == (out / version_name(3)).read_bytes()


def test_tasks_and_task_index_with_merge_equal_one_build(batches, single, tmp_path):
    """Appends with --tasks 2 (local pool), and an append planned with --plan-only, run as --task-index 0 and 1 and
    merged: the same samples and totals as one build of all three batches."""
    out = tmp_path / "ds"
    build(cfg(batches[:1], out, tasks=2, workers=2))
    build(cfg(batches[1:2], out, append=True, tasks=2, workers=2))
    res = build(cfg(batches[2:], out, append=True, tasks=2, plan_only=True))
    assert res.plan.version == 3 and res.manifest is None
    for i in (0, 1):
        build_task(out, i)
    merge(out, max_reject_fraction=1.0, min_turn_coverage=0.0)
    assert samples(out) == samples(single)
    assert open_dataset(out)[1].totals == open_dataset(single)[1].totals
    for n in (1, 2, 3):
        assert not verify_dataset(Path(f"{out}@v{n}"))


def test_an_append_stopped_before_its_commit_resumes_and_commits_once(grown, batches, tmp_path, monkeypatch):
    """Stopped after its tasks and merge, before its record (as a kill there leaves it): the same command again
    reruns no task, commits version 2 once, and it holds what the uninterrupted append did."""
    out = tmp_path / "ds"
    build(cfg(batches[:1], out))
    import vlmprep.builder.pipeline as pipeline

    def killed(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "version_record", killed)
    with pytest.raises(KeyboardInterrupt):
        build(cfg(batches[1:2], out, append=True))
    assert not (out / version_name(2)).exists() and (out / "tasks" / "task-00000.json").exists()
    monkeypatch.undo()
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-v000002-*.tar")}
    res = build(cfg(batches[1:2], out, append=True))
    assert res.added is not None and res.task_seconds == {0: pytest.approx(res.task_seconds[0])}
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-v000002-*.tar")} == shards  # not built again
    assert sorted(p.name for p in (out / "versions").glob("v*.json")) == ["v000001.json", "v000002.json"]
    assert samples(out) == samples(f"{grown[0]}@v2")


def test_a_dataset_built_before_versions_becomes_version_1(batches, single, tmp_path, capsys):
    """No versions/ at all (a build before this change): the first append records its manifest as version 1, byte for
    byte, derives its id file from its shards once, and still rejects an id of it as a duplicate."""
    out = tmp_path / "ds"
    build(cfg(batches[:1], out))
    shutil.rmtree(out / "versions")
    manifest = (out / "manifest.json").read_bytes()
    build(cfg(batches[1:2], out, append=True))
    assert "deriving versions/v000001.ids from its shards (once)" in capsys.readouterr().err
    assert (out / version_name(1)).read_bytes() == manifest
    assert samples(out) == samples(single)[:6]
    again = tmp_path / "again.jsonl"
    import zstandard

    again.write_bytes(zstandard.ZstdDecompressor().decompress(batches[0].read_bytes(), max_output_size=1 << 28))
    with pytest.raises(
        RejectsError, match=r"0 samples written from 3 records \(duplicate_id 3\); see .*/rejects.v000003.jsonl"
    ):
        build(cfg([again], out, append=True))
    assert not (out / version_name(3)).exists()  # a version that failed its checks is not committed
    res = build(cfg([again], out, append=True, allow_empty=True))  # its fix line, run: committed, nothing rebuilt
    assert res.manifest.version["added"]["rejects"] == {"duplicate_id": 3}
    assert res.manifest.totals["samples"] == 6 and not (out / "build-failed.txt").exists()


@pytest.mark.slow  # two cold `vlmprep` processes (the processor's load) and a build killed between them (~40 s)
def test_an_append_killed_mid_build_resumes_and_commits_once(batches, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from scripts.demo_traces import write_traces
    from tests.vlmprep.conftest import ROOT

    out = tmp_path / "ds"
    build(cfg(batches[:1], out))
    big = tmp_path / "big.jsonl.zst"
    write_traces(big, id_prefix="big-", n=40, seed=9, width=320, height=200, max_images=4)
    args = [sys.executable, "-m", "vlmprep", "build", "--append", "--in", str(big), "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([*args, *FLAGS], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(list(out.glob("shard-v000002-*.tar"))) < 2:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / version_name(2)).exists(), "the append ended before it could be killed"
    r = subprocess.run([*args, *FLAGS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "appended version v2" in r.stdout
    assert sorted(p.name for p in (out / "versions").glob("v*.json")) == ["v000001.json", "v000002.json"]
    ref = tmp_path / "ref"
    build(cfg(batches[:1], ref))
    build(cfg([big], ref, append=True))
    assert samples(out) == samples(ref) and not verify_dataset(out)


@pytest.mark.slow  # a local Ray cluster's start (~12 s on 2 cores) and two appends
def test_appends_run_by_ray_equal_one_build(batches, single, tmp_path):
    ray = pytest.importorskip("ray")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        out = tmp_path / "ds"
        build(cfg(batches[:1], out))
        for b in batches[1:]:
            res = build(cfg([b], out, append=True, tasks=2, executor="ray"))
            assert sorted(res.task_seconds) == [0, 1]
    finally:
        ray.shutdown()
    assert samples(out) == samples(single)
    assert all(not verify_dataset(Path(f"{out}@v{n}")) for n in (1, 2, 3))

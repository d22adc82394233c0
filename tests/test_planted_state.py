"""Round 5 of the hostile cases (issue 53.6): a link or FIFO planted where vlmprep keeps state of its own, in the new
dirs (a dataset URL's copy in the cache, the stage of an --out in a store) and at the build's state files. One check
(vlmprep_schemas.boundary: state_dir, read_state, open_no_follow) refuses each in one line: nothing is written into
a link's target or pruned from it (the dir itself included, not only what is in it), and no FIFO is waited on.
The trainer's dirs have theirs in tests/trainer/test_unsafe_writes.py."""

import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from tests.support.planted import finishes, plant, untouched, victim_dir
from tests.vlmprep.builder.test_build_safety import text_records

RECORDS = 4


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    return text_records(tmp_path_factory.mktemp("planted") / "r.jsonl", RECORDS)


@pytest.fixture(scope="module")
def dataset(records) -> Path:
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    out = records.parent / "ds"
    build(BuildConfig(inputs=(str(records),), out=str(out), processor="tiny:qwen2-vl", progress=False))
    return out


def _cli(*args: str):
    """`vlmprep ARGS` in this process, failing (not hanging) if it waits on a FIFO."""
    from vlmprep.cli import app

    return finishes(lambda: CliRunner().invoke(app, list(args)))


def _refused(res, *must: str) -> str:
    """The command failed with one error line holding `must`, and no traceback."""
    assert res.exit_code == 1 and not isinstance(res.exception, (AssertionError, TypeError)), res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and all(m in errors[0] for m in must), res.output
    return errors[0]


def _build_args(records: Path, out) -> list[str]:
    return ["build", "--in", str(records), "--out", str(out), "--processor", "tiny:qwen2-vl", "--no-progress"]


# --- a dataset URL's copy in the cache: $VLMPREP_CACHE/datasets/<hash>


@pytest.mark.parametrize("where", ["the copy's dir", "datasets/", "processor/ in the copy"])
def test_a_linked_cache_dir_is_refused_and_its_target_kept(dataset, tmp_path, monkeypatch, where):
    """Before: `vlmprep verify URL` with the copy's dir linked to a dir of the user's wrote the dataset into it and
    deleted the file already there (the copy's prune), with exit 0."""
    from vlmprep.shards.remote import cache_dir

    monkeypatch.setenv("VLMPREP_CACHE", str(tmp_path / "cache"))
    url = f"memory://planted-{uuid.uuid4().hex[:8]}/ds"
    fs = fsspec.filesystem("memory")
    for p in sorted(dataset.rglob("*")):
        if p.is_file() and "tasks" not in p.parts:
            fs.pipe_file(f"{url}/{p.relative_to(dataset).as_posix()}", p.read_bytes())
    victim, copy = victim_dir(tmp_path), cache_dir(url)
    link = {"the copy's dir": copy, "datasets/": copy.parent, "processor/ in the copy": copy / "processor"}[where]
    link.parent.mkdir(parents=True, exist_ok=True)
    plant(link, "symlink", victim)
    line = _refused(_cli("verify", url), "symlink", str(link))
    assert untouched(victim), (line, sorted(p.name for p in victim.iterdir()))
    link.unlink()  # the link the line names gone, the copy is made and read as before
    assert _cli("verify", url).exit_code == 0 and untouched(victim)


# --- the stage of an --out in a store: $VLMPREP_STAGE/<hash>


@pytest.mark.parametrize("where", ["the stage", "tasks/ in the stage"])
def test_a_linked_stage_dir_is_refused_and_its_target_kept(records, tmp_path, monkeypatch, where):
    """Before: `--out s3://...` with its stage linked to a dir of the user's built into that dir and left its files
    there."""
    from vlmprep.builder.store import STAGE_ENV, stage_for

    monkeypatch.setenv(STAGE_ENV, str(tmp_path / "stages"))
    url = f"memory://stage-{uuid.uuid4().hex[:8]}/ds"
    victim, stage = victim_dir(tmp_path), stage_for(url)
    if where == "the stage":
        plant(stage, "symlink", victim)
    else:
        stage.mkdir(parents=True)
        plant(stage / "tasks", "symlink", victim)
    _refused(_cli(*_build_args(records, url)), "symlink")
    assert untouched(victim), sorted(p.name for p in victim.iterdir())
    assert not fsspec.filesystem("memory").exists(f"{url}/manifest.json")


# --- a local --out and what the build makes in it


@pytest.mark.parametrize("where", ["--out", "tasks/", ".nv-meta/"])
def test_a_linked_out_or_dir_in_it_is_refused_and_its_target_kept(records, tmp_path, where):
    """--out itself linked (planted before the first build in a shared dir), or a dir the build makes in it: refused,
    the target keeps its files (energon's stale index names among them, which the build removes from its own)."""
    victim = victim_dir(tmp_path)
    (victim / "split.yaml").write_text("the user's\n")
    out = tmp_path / "ds"
    if where == "--out":
        plant(out, "symlink", victim)
    else:
        out.mkdir()
        plant(out / where.rstrip("/"), "symlink", victim)
    _refused(_cli(*_build_args(records, out)), "symlink")
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt", "split.yaml"]


@pytest.mark.parametrize("name", ["plan.json", "manifest.json"])
def test_a_fifo_at_the_builds_state_file_is_refused_not_waited_on(records, tmp_path, name):
    """Before: a FIFO at --out/plan.json or manifest.json hung the build (it read the file to compare options)."""
    out = tmp_path / "ds"
    out.mkdir()
    plant(out / name, "FIFO")
    _refused(_cli(*_build_args(records, out)), name, "special file")


@pytest.mark.parametrize("kind", ["FIFO", "symlink"])
def test_a_fifo_or_link_at_a_task_manifest_is_refused_by_the_task_and_the_merge(records, tmp_path, kind):
    """Before: a FIFO at tasks/task-00000.json hung `--task-index 0` and `vlmprep merge`; a link was read."""
    out, target = tmp_path / "ds", tmp_path / "elsewhere.json"
    assert _cli(*_build_args(records, out), "--tasks", "2", "--plan-only").exit_code == 0
    task = out / "tasks" / "task-00000.json"
    plant(task, kind, target)
    _refused(_cli("build", "--out", str(out), "--task-index", "0", "--no-progress"), "task-00000.json")
    assert _cli("build", "--out", str(out), "--task-index", "1", "--no-progress").exit_code == 0
    _refused(_cli("merge", str(out)), "task-00000.json", "symlink or special file")
    assert not target.exists()

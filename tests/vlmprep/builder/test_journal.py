"""The task journal is state a rerun trusts: a resume point its own counts and the task's input span do not reach
(moved past the end, or back) starts the task over instead of skipping records that never landed; a link or FIFO
planted at its name is refused in one line, never read through or waited on."""

import json

import pytest
from typer.testing import CliRunner

from tests.support.planted import finishes, plant
from tests.vlmprep.builder.test_build_safety import text_records
from vlmprep.builder import task as task_module
from vlmprep.builder.pipeline import build
from vlmprep.config import BuildConfig

N = 40
JOURNAL = "tasks/task-00000.journal.json"
DONE = 1 << 62  # the journal's end marker: every record of the task landed


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return text_records(tmp_path_factory.mktemp("journal") / "r.jsonl", N)


def _cfg(records, out):
    return BuildConfig(
        inputs=(str(records),), out=str(out), processor="tiny:qwen2-vl", samples_per_shard=2, progress=False
    )


def _interrupted(records, out, monkeypatch, after: int = 1):
    """A build stopped (as a kill would) right after its `after`-th journal checkpoint: the journal is on disk."""
    real, calls = task_module._TaskState.checkpoint, []

    def checkpoint(self, rej, rows, next_position):
        real(self, rej, rows, next_position)
        calls.append(next_position)
        if len(calls) == after:
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(task_module._TaskState, "checkpoint", checkpoint)
    with pytest.raises(KeyboardInterrupt):
        build(_cfg(records, out))
    monkeypatch.setattr(task_module._TaskState, "checkpoint", real)
    return json.loads((out / JOURNAL).read_text())


@pytest.mark.parametrize("point", ["past the end", "back", "ahead"])
def test_a_moved_resume_point_starts_the_task_over_instead_of_dropping_records(records, tmp_path, monkeypatch, point):
    """Before: the journal's next_position set to the end marker made the rerun write 2 of 40 records (of 300 in the
    issue's case), exit 0."""
    out = tmp_path / "ds"
    journal = _interrupted(records, out, monkeypatch)
    assert journal["next_position"] == 2 and journal["totals"]["records"] == 2
    journal["next_position"] = {"past the end": DONE, "back": 0, "ahead": 200}[point]
    (out / JOURNAL).write_text(json.dumps(journal))
    manifest = build(_cfg(records, out)).manifest
    assert manifest.totals["records"] == N and manifest.totals["samples"] == N
    assert sum(s.num_samples for s in manifest.shards) == N


def test_an_untouched_journal_still_resumes(records, tmp_path, monkeypatch):
    """The check keeps honest resumes: the journaled shards are kept (same inode), the dataset whole."""
    out = tmp_path / "ds"
    journal = _interrupted(records, out, monkeypatch, after=3)
    inode = (out / journal["shards"][0]["name"]).stat().st_ino
    manifest = build(_cfg(records, out)).manifest
    assert manifest.totals["records"] == N and (out / journal["shards"][0]["name"]).stat().st_ino == inode


@pytest.mark.parametrize("kind", ["symlink", "FIFO"])
def test_a_link_or_fifo_at_the_journal_is_refused_in_one_line(records, tmp_path, monkeypatch, kind):
    from vlmprep.cli import app

    out = tmp_path / "ds"
    _interrupted(records, out, monkeypatch)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    plant(out / JOURNAL, kind, victim)
    args = ["build", "--in", str(records), "--out", str(out), "--processor", "tiny:qwen2-vl"]
    r = finishes(lambda: CliRunner().invoke(app, [*args, "--samples-per-shard", "2", "--no-progress"]))
    assert r.exit_code == 1, r.output
    line = r.output.strip().splitlines()[-1]
    assert "task-00000.journal.json is a symlink or special file" in line and "refusing to read" in line, line
    assert victim.read_text() == "{}"

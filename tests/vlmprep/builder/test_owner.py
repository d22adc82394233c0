"""One owner per dataset dir: a second build (or merge) on an --out in use refuses with one line naming the holder
and changes nothing; --task-index runs share --out but never run one task twice; a lock left by a killed process
never blocks. Merge vouches for every shard it lists: a missing, cut, modified or twice-claimed task shard is refused
naming the task file, and following the advice gives the right dataset."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.vlmprep.conftest import ROOT, tree_hashes
from vlmprep.builder import pipeline, task, workers
from vlmprep.builder.merge import MergeError, merge_tasks
from vlmprep.builder.owner import BusyError, own_out
from vlmprep.builder.pipeline import build, build_task
from vlmprep.config import BuildConfig
from vlmprep.process import Renderer
from vlmprep.shards.dataset import LOCK_NAME


def _fast(mp, processor) -> None:
    """Builds and task runs reuse the session's builtin:qwen2-vl instead of loading one (~15 s each); no
    --chat-template is given, so nothing changes it."""
    mp.setattr(pipeline, "load_processor", lambda spec: processor)
    mp.setattr(workers, "renderer_from_saved", lambda cfg, d: Renderer(cfg, processor, saved=True))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Seven text records; the last repeats the first's id (only merge sees it: another task)."""
    rows = [
        {
            "id": f"r{i}",
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}],
        }
        for i in range(6)
    ]
    rows.append({**rows[0], "messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "x"}]})
    p = tmp_path_factory.mktemp("owner") / "records.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def cfg(records, out, **kw) -> BuildConfig:
    return BuildConfig(
        inputs=(str(records),),
        out=str(out),
        progress=False,
        samples_per_shard=1,
        max_reject_fraction=1.0,
        min_turn_coverage=0.0,
        **kw,
    )


@pytest.fixture
def fast(monkeypatch, qwen2vl_processor):
    _fast(monkeypatch, qwen2vl_processor)


@pytest.fixture(scope="module")
def ref3(records, tmp_path_factory, qwen2vl_processor):
    """A merged 3-task build: the reference every repaired copy must equal."""
    out = tmp_path_factory.mktemp("ref3") / "ds"
    with pytest.MonkeyPatch.context() as mp:
        _fast(mp, qwen2vl_processor)
        res = build(cfg(records, out, tasks=3))
    assert res.manifest.rejects == {"duplicate_id": 1}
    return out


def _nested(monkeypatch, module, name, inner):
    """Run inner() (a second build, merge or task) while the first is inside module.name; return what it raised."""
    seen = []
    original = getattr(module, name)

    def wrapped(*args, **kw):
        try:
            inner()
        except BusyError as e:
            seen.append(e)
        return original(*args, **kw)

    monkeypatch.setattr(module, name, wrapped)
    return seen


def test_a_second_build_or_merge_on_an_out_in_use_refuses_naming_the_first(records, tmp_path, monkeypatch, fast):
    out = tmp_path / "ds"
    second = []

    def inner():
        before = tree_hashes(out)
        for run in (
            lambda: build(cfg(records, out, overwrite=True)),
            lambda: pipeline.merge(out),
            lambda: build_task(out, 0),
        ):
            with pytest.raises(BusyError) as e:
                run()
            second.append(str(e.value))
        assert tree_hashes(out) == before  # refused before touching anything

    _nested(monkeypatch, pipeline, "merge_tasks", inner)
    res = build(cfg(records, out))
    assert res.manifest.totals["samples"] > 0  # the first build is unaffected
    assert len(second) == 3 and all("\n" not in m and f"pid {os.getpid()}" in m for m in second), second
    assert second[0].startswith(f"--out {out} is in use by `") and "build into another --out" in second[0]
    assert "which owns the whole dir" in second[2]
    assert not (out / LOCK_NAME).exists()  # released and removed


def test_task_index_runs_share_the_out_but_one_task_runs_once(records, tmp_path, monkeypatch, fast):
    out = tmp_path / "ds"
    build(cfg(records, out, tasks=3, plan_only=True))
    started, ran, refused = [], [], []

    def inner():
        if started:  # task 2's own run comes through here too
            return
        started.append(True)
        ran.append(build_task(out, 2).task.task)
        for run in (lambda: build_task(out, 0), lambda: build(cfg(records, out, tasks=3)), lambda: pipeline.merge(out)):
            with pytest.raises(BusyError) as e:
                run()
            refused.append(str(e.value))

    _nested(monkeypatch, task, "_write_records", inner)
    build_task(out, 0)
    assert ran == [2]  # another task of the same --out ran beside task 0
    assert "task 0 is already running in `" in refused[0] and f"pid {os.getpid()}" in refused[0]
    assert "in use by --task-index runs (task 0: `" in refused[1], refused[1]
    assert "in use by --task-index runs" in refused[2]
    assert not list((out / "tasks").glob("*.lock")) and not (out / LOCK_NAME).exists()


def test_a_lock_left_by_a_killed_process_does_not_block(records, tmp_path, fast):
    out = tmp_path / "ds"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from vlmprep.builder.owner import own_out\n"
            f"with own_out(Path({str(out)!r})):\n print('held', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(BusyError, match=rf"is in use by `.* \(pid {holder.pid} on "):
        with own_out(out):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / LOCK_NAME).exists()  # left behind, with the dead holder's note: the kernel dropped its lock
    (out / "tasks").mkdir()
    (out / "tasks" / "task-00000.lock").write_text('{"pid": 1}')  # a killed task run's
    build(cfg(records, out))
    assert not (out / LOCK_NAME).exists()


@pytest.fixture
def merged3(ref3, tmp_path, fast):
    """A copy of the 3-task build (merged: its last task's shard that held the repeated id already rewritten)."""
    out = tmp_path / "ds"
    shutil.copytree(ref3, out)
    return out


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "fault, said",
    [
        ("missing", r"shard-00001-000000.tar: listed in tasks/task-00001.json but missing \(changed, cut short or "),
        ("cut", r"shard-00001-000000.tar: \d+ bytes, but tasks/task-00001.json lists \d+ \("),
        (
            "modified",
            r"shard-00001-000000.tar: sha256 [0-9a-f]{16}\.\.\., but tasks/task-00001.json lists [0-9a-f]{16}",
        ),
    ],
)
def test_merge_refuses_a_missing_cut_or_modified_task_shard_naming_the_task(merged3, ref3, fault, said):
    out, shard = merged3, merged3 / "shard-00001-000000.tar"
    manifest = (out / "manifest.json").read_bytes()
    if fault == "missing":
        shard.unlink()
    elif fault == "cut":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        _flip_byte(shard)
    with pytest.raises(MergeError, match=said) as e:
        merge_tasks(out)
    assert "\n" not in str(e.value) and f"remove {out}/tasks/task-00001.json and run the task again" in str(e.value)
    assert (out / "manifest.json").read_bytes() == manifest  # never rewritten over a bad shard
    (out / "tasks" / "task-00001.json").unlink()  # the advice
    build_task(out, 1)
    merge_tasks(out)
    assert tree_hashes(out) == tree_hashes(ref3)


def test_merge_refuses_a_task_manifest_copied_over_another_and_its_advice_gives_the_right_dataset(merged3, ref3):
    """A copy of task 0's manifest as task 1's listed task 0's shards twice once task 1's shards, the files 'no
    task wrote', were removed as merge advised."""
    out = merged3
    shutil.copy(out / "tasks" / "task-00000.json", out / "tasks" / "task-00001.json")
    with pytest.raises(MergeError, match=r"tasks/task-00001.json is the manifest of task 0, not of task 1"):
        merge_tasks(out)
    for p in out.glob("shard-00001-*.tar"):  # what the stray-file message used to advise
        p.unlink()
    with pytest.raises(MergeError, match=r"task-00001.json is the manifest of task 0"):
        merge_tasks(out)
    (out / "tasks" / "task-00001.json").unlink()  # this advice
    build_task(out, 1)
    manifest = merge_tasks(out)
    names = [s.name for s in manifest.shards]
    assert len(names) == len(set(names)) and all((out / n).is_file() for n in names)
    assert tree_hashes(out) == tree_hashes(ref3)


def test_merge_refuses_a_task_manifest_naming_a_shard_twice(merged3):
    out = merged3
    m = json.loads((out / "tasks" / "task-00000.json").read_text())
    m["shards"].append(m["shards"][0])
    (out / "tasks" / "task-00000.json").write_text(json.dumps(m))
    with pytest.raises(MergeError, match=r"task-00000.json lists shard-00000-000000.tar twice"):
        merge_tasks(out)


def test_merge_run_again_keeps_the_shard_it_rewrote_for_a_repeated_id(merged3, ref3):
    """The shard merge rewrote without an id an earlier task has differs from its task manifest's sha256: merge
    run again (after a crash, or by hand) recognizes it by its ids and ends the same."""
    merge_tasks(merged3)
    assert tree_hashes(merged3) == tree_hashes(ref3)

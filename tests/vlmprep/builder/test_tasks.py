"""Planned builds (--tasks T): for a fixed T the dataset dir is byte-identical whether the local pool runs the tasks
or separate `--task-index` processes do (then `vlmprep merge`); its samples equal the one-task build's; a killed task
process re-runs to the same output; merge refuses what it cannot vouch for. Ray is tested in test_ray.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.vlmprep.conftest import OPTS, TOOLS, planned_cfg, tree_hashes
from vlmprep.builder.merge import MergeError, merge_tasks
from vlmprep.builder.pipeline import build, build_task
from vlmprep.builder.plan import PlanError
from vlmprep.shards.reader import iter_dataset

CLI_OPTS = [
    "--processor",
    OPTS["processor"],
    "--seq-len",
    "2048",
    "--samples-per-shard",
    "2",
    "--chat-template",
    TOOLS,
    "--no-progress",
    "--max-reject-fraction",
    "1",
    "--min-turn-coverage",
    "0",
]


cfg, hashes = planned_cfg, tree_hashes


def samples(d: Path) -> dict:
    return {s.key: {n: s.read(n) for n in s.names} for s in iter_dataset(d)}


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "vlmprep", *map(str, args)]


@pytest.mark.slow  # ~15 s: make test keeps test_append's tasks and task index merged equal to one build
def test_three_tasks_hold_the_single_task_build_samples_rejects_and_totals(single, local3):
    out, res = local3
    assert samples(out) == samples(single)
    a, b = json.loads((single / "manifest.json").read_text()), res.manifest.to_json()
    assert a["totals"] == b["totals"] and a["rejects"] == b["rejects"] == {
        "duplicate_id": 1,
        "invalid_json": 1,
        "turn_too_long": 2,
    }
    assert a["turns"] == b["turns"]
    # each input file's share of the totals (one input here): merge takes the repeated id back from it too
    assert a["inputs"][0]["totals"] == b["inputs"][0]["totals"] == {k: v for k, v in a["totals"].items() if v}
    assert sorted((single / "rejects.jsonl").read_text().splitlines()) == sorted(
        (out / "rejects.jsonl").read_text().splitlines()
    )
    assert b["plan"]["tasks"] == 3 and len(res.task_seconds) == 3
    assert [s["name"][:12] for s in b["shards"]][:1] == ["shard-00000-"] and b["shards"][-1]["name"].startswith(
        "shard-00002-"
    )
    # the repeated id was caught by merge: the last task's shard that held it was rewritten without it
    last = json.loads((out / "tasks" / "task-00002.json").read_text())
    assert (
        sum(s["num_samples"] for s in last["shards"])
        == sum(s["num_samples"] for s in b["shards"] if s["name"].startswith("shard-00002-")) + 1
    )
    assert subprocess.run(cli("verify", out), capture_output=True).returncode == 0


@pytest.mark.slow  # ~45 s: three CLI processes on 2 cores
def test_task_index_processes_started_together_then_merge_equal_the_local_pool(task_traces, local3, tmp_path):
    """No plan yet: each process writes the same plan itself; then `vlmprep merge` -> every file byte-identical."""
    ref, _ = local3
    out = tmp_path / "ds"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs = [
        subprocess.Popen(
            cli("build", "--in", task_traces, "--out", out, "--tasks", 3, "--task-index", i, *CLI_OPTS),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for i in (2, 0, 1)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    with pytest.raises(FileNotFoundError):
        (out / "manifest.json").read_bytes()  # a task never merges
    merged = subprocess.run(
        cli("merge", out, "--max-reject-fraction", 1, "--min-turn-coverage", 0), capture_output=True, text=True
    )
    assert merged.returncode == 0, merged.stderr
    # split by default: the long traces are step samples (two turns whose page dump cannot fit are lost)
    assert "14 samples" in merged.stdout
    assert hashes(out) == hashes(ref)


@pytest.mark.slow  # ~30 s: two CLI runs of one task
def test_a_sigkilled_task_index_process_reruns_to_the_same_task_output(task_traces, local3, tmp_path):
    ref, _ = local3
    out = tmp_path / "ds"
    build(cfg(task_traces, out, tasks=3, plan_only=True))
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "processor"]
    cmd = cli("build", "--out", out, "--task-index", 1, "--no-progress")  # options from DIR/plan.json
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(out.glob("shard-00001-*.tar")):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "tasks" / "task-00001.json").exists(), "killed before it finished"
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    task1 = ("shard-00001-", "tasks/task-00001.")
    mine = {k: v for k, v in hashes(out).items() if k.startswith(task1)}
    assert len(mine) >= 4 and mine == {k: v for k, v in hashes(ref).items() if k.startswith(task1)}
    # A finished task is skipped (its files untouched) when run again.
    stamp = (out / "tasks" / "task-00001.json").stat().st_mtime_ns
    build_task(out, 1)
    assert (out / "tasks" / "task-00001.json").stat().st_mtime_ns == stamp


def _copy_task(src: Path, dst: Path, i: int) -> None:
    for p in list(src.glob(f"shard-{i:05d}-*.tar*")) + list((src / "tasks").glob(f"task-{i:05d}.*")):
        shutil.copy2(p, dst / p.relative_to(src))


def test_merge_refuses_a_missing_task_a_task_of_another_config_and_stray_files(task_traces, local3, tmp_path):
    ref, _ = local3
    out = tmp_path / "ds"
    build(cfg(task_traces, out, tasks=3, plan_only=True))
    for i in (0, 2):
        build_task(out, i)
    with pytest.raises(MergeError, match=r"1 of 3 tasks have not finished .*--task-index 1"):
        merge_tasks(out)
    other = tmp_path / "other"  # task 1 of a plan with another --seq-len
    build(cfg(task_traces, other, tasks=3, seq_len=1536, plan_only=True))
    build_task(other, 1)
    _copy_task(other, out, 1)
    with pytest.raises(MergeError, match=r"task 1 was built with another config \(seq_len differ"):
        merge_tasks(out)
    for p in list(out.glob("shard-00001-*.tar*")) + list((out / "tasks").glob("task-00001.*")):
        p.unlink()
    _copy_task(ref, out, 1)
    (out / "shard-00007-000000.tar").write_bytes((other / "shard-00001-000000.tar").read_bytes())
    with pytest.raises(MergeError, match=r"no task of this plan wrote: shard-00007-000000.tar"):
        merge_tasks(out)
    (out / "shard-00007-000000.tar").unlink()
    (out / "tasks" / "task-00009.json").write_text("{}")
    with pytest.raises(MergeError, match=r"tasks/task-00009.json"):
        merge_tasks(out)
    (out / "tasks" / "task-00009.json").unlink()
    merge_tasks(out)
    assert hashes(out) == hashes(ref)
    # A task run with other options than the plan's is refused before it writes anything.
    with pytest.raises(PlanError, match="options seq_len differ"):
        build(cfg(task_traces, out, tasks=3, task_index=0, seq_len=1536))


@pytest.mark.slow  # ~20 s: a trainer process
def test_the_trainer_trains_on_a_merged_dataset(local3, tmp_path):
    from tests.trainer.conftest import read_metrics, run_trainer

    out, _ = local3
    run_trainer(["--data", out, "--out", tmp_path / "run", "--max-steps", 2, "--num-workers", 1])
    metrics = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)


def test_a_whole_build_drops_what_a_killed_earlier_run_left_half_written(task_traces, single, tmp_path):
    """A kill inside save_processor or write_plan leaves per-process temp names that no later write reuses."""
    out = tmp_path / "ds"
    (out / "processor.4242.tmp").mkdir(parents=True)
    (out / "processor.4242.tmp" / "tokenizer.json").write_text("{}")
    (out / "processor.4243.old").mkdir()
    (out / "plan.json.4242.tmp").write_text("{")
    build(cfg(task_traces, out))
    assert tree_hashes(out) == tree_hashes(single)


def _copied_records(d: Path) -> Path:
    """64 copies of 9 records with the same ids: 6 that land whole, one split into two samples, one that lands with
    a turn lost (turn_too_long) and one whose image is missing."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 10, 10)).save(buf, format="PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }

    def chat(*texts, first=None):
        ms = [{"role": "user", "content": [first, {"type": "text", "text": texts[0]}] if first else texts[0]}]
        for k, t in enumerate(texts[1:]):
            ms.append({"role": "assistant" if k % 2 == 0 else "user", "content": t})
        return ms

    words = " ".join(f"w{i}" for i in range(60))
    records = [{"id": f"g{k}", "messages": chat(f"q{k}", f"a{k}", "more", "b", first=image)} for k in range(6)]
    records.append({"id": "split", "messages": chat("task", words, "go on", words)})
    records.append({"id": "lost", "messages": chat("task", "one", "go on", words + " " + words + " " + words)})
    records.append(
        {"id": "gone", "messages": chat("q", "a", first={"type": "image_url", "image_url": {"url": "no.png"}})}
    )
    p = d / "copies.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for _ in range(64) for r in records))
    return p


def test_a_record_is_rejected_once_and_duplicates_lose_their_turns_loudly(tmp_path, qwen2vl_processor):
    """Rejects never exceed records: a record is rejected once, under one reason (a repeated id rejects the whole
    record, split samples and lost-turn lines included); the turns of every rejected record count as lost, so a build
    that keeps 8 of 576 records fails the turn coverage gate. One task and three (where merge finds the repeats
    across tasks) count alike."""
    from vlmprep.builder.pipeline import RejectsError
    from vlmprep.shards.summary import format_build_summary, rejected_records
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.stats_text import format_stats

    inp = _copied_records(tmp_path)
    with pytest.raises(
        RejectsError,
        match=r"turn coverage 1\.4% < --min-turn-coverage 0\.95 \(15 of 1088 assistant "
        r"turns trained; lost to --seq-len 256: turn_too_long 1; lost with rejected "
        r"records: 1072\); fix: duplicate_id is the most common reject \(504\)",
    ):
        build(cfg(inp, tmp_path / "gate", seq_len=256, min_turn_coverage=0.95))
    m1 = build(cfg(inp, tmp_path / "one", seq_len=256, min_turn_coverage=0.0)).manifest
    m3 = build(cfg(inp, tmp_path / "three", seq_len=256, min_turn_coverage=0.0, tasks=3, workers=2)).manifest
    for m in (m1, m3):
        t = m.totals
        assert t["records"] == 576 and rejected_records(m) == 504 + 64 and t["samples"] == 9
        assert m.rejects == {"duplicate_id": 504, "image_not_found": 64, "turn_too_long": 1}
        assert m.turns["input_assistant_turns"] == 64 * 17 and m.turns["trained_assistant_turns"] == 15
        assert m.turns["lost"]["record_rejected"] == 64 * 17 - 16
        assert "rejected          568 of 576 records (98.6%)" in format_build_summary(m, tmp_path)
    for d in ("one", "three"):
        text = format_stats(compute_stats(tmp_path / d))
        assert "records            576 read, 9 samples, 568 rejected" in text
        assert "rejected           568 of 576 records by reason:" in text
        assert "turn_too_long                            1 (turns; their records landed)" in text
        assert compute_stats(tmp_path / d)["mismatches"] == []
    assert m1.totals == m3.totals and m1.rejects == m3.rejects and m1.turns == m3.turns
    assert m1.inputs[0].totals == m3.inputs[0].totals
    for d in ("one", "three"):
        lines = [json.loads(x) for x in (tmp_path / d / "rejects.jsonl").read_text().splitlines()]
        assert len(lines) == len({(x["source"]["line"], x["reason"]) for x in lines}) == 568 + 1
        assert sorted({x["id"] for x in lines if x["reason"] == "duplicate_id"}) == sorted(
            ["g0", "g1", "g2", "g3", "g4", "g5", "split", "lost"]
        )
    assert samples(tmp_path / "one") == samples(tmp_path / "three")

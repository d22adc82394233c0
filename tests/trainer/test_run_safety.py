"""A run trains on the data it started with, alone in its run dir, and resumes past a checkpoint cut short (live
runs; the parts alone: test_integrity.py, test_checkpoint.py): a shard whose bytes differ from its manifest's sha256
is refused at start-up; a dataset rebuilt or a shard modified under a running trainer stops it with one line naming
the file; a second trainer on the same --out refuses, naming the first, which goes on unaffected; a resume skips
(and names) a newest checkpoint that was cut short."""

import hashlib
import json
import shutil
import subprocess
import sys
import types

import pytest

from tests.trainer.conftest import ROOT, read_metrics, trainer_env
from trainer.data import integrity
from trainer.train import Session, main

COMMON = ["--tiny-random", "qwen2-vl", "--no-progress", "--micro-batch-size", "2"]


def _args(data, out, *extra) -> list[str]:
    return ["--data", str(data), "--out", str(out), *COMMON, *map(str, extra)]


def _error(err: str) -> str:
    """The run's one error line (no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("trainer: error")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


def _after_step(monkeypatch, step: int, action) -> None:
    """Run action() once the training loop has taken `step` steps (inside the live run)."""
    original = Session.train_one

    def train_one(self, *args, **kw):
        original(self, *args, **kw)
        if self.step == step:
            action()

    monkeypatch.setattr(Session, "train_one", train_one)


def _flip_byte(path, offset=None) -> None:
    """Change one byte in place: same size, same inode (a bit-rotted or hand-edited copy)."""
    with open(path, "r+b") as f:
        f.seek(offset if offset is not None else path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture
def data(dataset, tmp_path):
    shutil.copytree(dataset, tmp_path / "data")
    return tmp_path / "data"


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_shard_whose_bytes_differ_from_the_manifest_stops_the_run_naming_it(data, tmp_path, capsys, shuffle):
    """Without the sample shuffle the rank's shards are hashed at start-up, before step 1; with it, each is hashed as
    the run first reaches it, ahead of the readers (test_integrity.py: nothing is read from it), so the run stops
    there, exit 1, naming the shard."""
    _flip_byte(data / "shard-000002.tar")
    flags = () if shuffle else ("--no-shuffle",)
    assert main(_args(data, tmp_path / "run", "--max-steps", 50, "--num-workers", 0, *flags)) == 1
    err = _error(capsys.readouterr().err)
    assert f"{data / 'shard-000002.tar'}: sha256 " in err and "but its manifest lists" in err, err
    steps = read_metrics(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(steps) < 50 and (shuffle or not steps)


def test_a_shard_modified_under_a_running_trainer_stops_it_naming_the_shard(data, tmp_path, capsys, monkeypatch):
    """Same size, bytes changed after the run checked them: the next read of that file stops the run, rather than
    train on other data than the run started with (a DataLoader worker runs the same check; samples it read ahead,
    before the change, still train)."""
    _after_step(monkeypatch, 1, lambda: [_flip_byte(p) for p in sorted(data.glob("shard-*.tar"))])
    assert main(_args(data, tmp_path / "run", "--max-steps", 50, "--num-workers", 0)) == 1
    err = _error(capsys.readouterr().err)
    assert f"{data}/shard-00000" in err and "changed or was removed while this run reads it" in err, err
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


def test_a_build_over_the_dataset_a_trainer_reads_stops_the_trainer(
    data, traces, tmp_path, capsys, monkeypatch, qwen2vl_processor
):
    from vlmprep.builder import pipeline
    from vlmprep.config import BuildConfig

    policy = {"tool_calls": "train-content"} if "tool_calls" in BuildConfig.__dataclass_fields__ else {}

    def rebuild():
        monkeypatch.setattr(pipeline, "load_processor", lambda spec: qwen2vl_processor)
        pipeline.build(
            BuildConfig(
                inputs=(str(traces),),
                out=str(data),
                processor="builtin:qwen2-vl",
                seq_len=1024,
                samples_per_shard=6,
                image_format="zstd",
                progress=False,
                overwrite=True,
                max_reject_fraction=1.0,
                min_turn_coverage=0.0,
                **policy,
            )
        )

    _after_step(monkeypatch, 1, rebuild)
    assert main(_args(data, tmp_path / "run", "--max-steps", 50, "--num-workers", 0, "--no-shuffle")) == 1
    err = _error(capsys.readouterr().err)
    assert f"{data / 'manifest.json'} changed or was removed while this run reads it" in err, err
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


@pytest.mark.slow  # ~20 s: a second trainer process (the lock's refusal alone: test_checkpoint.py)
def test_a_second_trainer_on_the_same_out_refuses_and_the_first_goes_on(dataset, tmp_path, capsys, monkeypatch):
    out, second = tmp_path / "run", []

    def start_another():
        second.append(
            subprocess.run(
                [sys.executable, "-m", "trainer", *_args(dataset, out, "--max-steps", 5)],
                cwd=ROOT,
                env=trainer_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
        )

    _after_step(monkeypatch, 1, start_another)
    assert main(_args(dataset, out, "--max-steps", 3, "--num-workers", 0)) == 0
    proc = second[0]
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"trainer: error: {out} is in use by another trainer (pid "), proc.stderr
    assert "`" in proc.stderr and "pass another --out" in proc.stderr
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]  # each step once: the second wrote nothing
    assert not (out / "trainer.lock").exists()  # released when the run ended


def _largest_file(ckpt):
    return max((p for p in ckpt.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_a_resume_skips_a_newest_checkpoint_cut_short_naming_it(dataset, tmp_path, capsys, monkeypatch):
    """Also: the shards were hashed by the first run only (its record in the shard cache spares the resume)."""
    hashed = []

    def counting():
        hashed.append(1)
        return hashlib.sha256()

    monkeypatch.setattr(integrity, "hashlib", types.SimpleNamespace(sha256=counting))
    out = tmp_path / "run"
    assert main(_args(dataset, out, "--max-steps", 2, "--save-every", 1, "--num-workers", 0)) == 0
    assert len(hashed) == 5  # every shard, once
    first = read_metrics(out)
    newest = out / "checkpoints" / "step-00000002"
    cut = _largest_file(newest)
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[: size // 3])
    capsys.readouterr()
    assert main(_args(dataset, out, "--max-steps", 3, "--save-every", 1, "--num-workers", 0)) == 0
    err = capsys.readouterr().err
    assert f"trainer: skipped checkpoint {newest}: {cut.name} has {size // 3} bytes, {size} when saved" in err, err
    assert f"resumed from {out / 'checkpoints' / 'step-00000001'} (step 1" in err and "Traceback" not in err
    assert len(hashed) == 5  # the resume hashed nothing
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[0] == first[0]
    assert metrics[1]["sample_ids"] == first[1]["sample_ids"]  # step 2 redone from step 1's state, exactly
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]
    for step in (2, 3):  # both complete again: the cut one was replaced when the run reached its step
        assert json.loads((out / "checkpoints" / f"step-{step:08d}" / "complete.json").read_text())["step"] == step

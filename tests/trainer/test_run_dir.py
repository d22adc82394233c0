"""The run dir belongs to one run: another --data, model or option that shapes the run is refused before anything
in it changes (every file's hash compared); the same command resumes; --no-resume starts over in place; user
errors (a missing --model or --data) are one line and exit code 1."""

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from tests.trainer.conftest import ROOT, read_metrics, trainer_env
from trainer.train import main

COMMON = ["--no-progress", "--num-workers", "0", "--micro-batch-size", "2", "--no-shuffle-shards"]


def _args(data, out, *extra, model=None) -> list[str]:
    who = ["--model", str(model)] if model else ["--tiny-random", "qwen2-vl"]
    return ["--data", str(data), "--out", str(out), *who, *COMMON, *map(str, extra)]


def _hashes(d) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def run_dir(dataset, tmp_path_factory):
    """One finished step of a run on the whole dataset."""
    out = tmp_path_factory.mktemp("guard") / "run"
    assert main(_args(dataset, out, "--max-steps", 1)) == 0
    return out


def _copy(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def _config_only_model(tmp_path):
    """A --model dir with the tiny model's config.json and no weights: the check reads only the config."""
    from trainer.model import tiny_config

    tiny_config("qwen2-vl").save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _subset(dataset) -> str:
    return str(dataset / "shard-{000002..000003}.tar")  # 2 of the 5 shards: other data


@pytest.mark.parametrize(
    "change, named",
    [
        ("data", "data (--data"),
        ("model", "model 'tiny-random qwen2-vl' -> "),
        ("packing", "pack_to 0 -> 4096"),
        ("batch", "micro_batch_size 2 -> 3"),
        ("lr", "lr 2e-05 -> 0.001"),
    ],
)
def test_another_run_into_the_same_out_is_refused_and_changes_nothing(
    run_dir, dataset, tmp_path, capsys, change, named
):
    before = _hashes(run_dir)
    args = {
        "data": _args(_subset(dataset), run_dir, "--max-steps", 2),
        "model": _args(dataset, run_dir, "--max-steps", 2, model=_config_only_model(tmp_path)),
        "packing": _args(dataset, run_dir, "--max-steps", 2, "--pack-to", 4096),
        "batch": _args(dataset, run_dir, "--max-steps", 2, "--micro-batch-size", 3),
        "lr": _args(dataset, run_dir, "--max-steps", 2, "--lr", 1e-3),
    }[change]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert f"pass --no-resume to start over in {run_dir}" in err and "or another --out" in err
    assert _hashes(run_dir) == before


def test_a_run_dir_without_run_json_is_not_resumed(run_dir, dataset, tmp_path, capsys):
    """A run dir from before run.json existed (or not the trainer's): nothing says what it holds."""
    out = _copy(run_dir, tmp_path)
    (out / "run.json").unlink()
    before = _hashes(out)
    assert main(_args(dataset, out, "--max-steps", 2)) == 1
    assert "holds checkpoints, metrics.jsonl but no readable run.json" in capsys.readouterr().err
    assert _hashes(out) == before


def test_the_same_command_resumes_with_a_longer_run_and_other_workers(run_dir, dataset, tmp_path, capsys):
    out = _copy(run_dir, tmp_path)
    first = read_metrics(out)
    args = _args(dataset, out, "--max-steps", 2)
    args[args.index("--num-workers") + 1] = "1"  # speed and run length may change on resume
    assert main(args) == 0
    assert "resumed from" in capsys.readouterr().err
    got = read_metrics(out)
    assert [m["step"] for m in got] == [1, 2] and got[0] == first[0]
    assert json.loads((out / "run.json").read_text())["data_source"] == str(dataset)


@pytest.mark.slow  # make test-all; long in make test (issue 33's 8-minute budget)
def test_a_finished_run_resumed_says_so_and_still_runs_the_asked_eval_and_export(run_dir, dataset, tmp_path, capsys):
    """The same command again after the run ended (the served-model walk): one line instead of a silent 0-step run,
    then what was asked and is not done yet: the final eval (once) and the --save-hf export."""
    out = _copy(run_dir, tmp_path)
    args = _args(dataset, out, "--max-steps", 1, "--eval-data", _subset(dataset), "--save-hf")
    assert main(args) == 0
    said = capsys.readouterr()
    assert said.out.splitlines() == [
        f"trainer: nothing left to train: {out} finished at step 1 (--max-steps 1); "
        "raise --max-steps or --epochs to train further"
    ]
    assert "trainer: eval at step 1: loss" in said.err and f"trainer: exported {out / 'hf'}" in said.err
    evals = [m for m in read_metrics(out) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [1] and (out / "hf" / "config.json").is_file()
    assert [m["step"] for m in read_metrics(out) if "loss" in m] == [1]  # no step trained again
    assert said.out.splitlines()[0] in (out / "train.log").read_text()
    assert main(args) == 0  # and again: the eval is in metrics.jsonl already
    assert "eval at step" not in capsys.readouterr().err
    assert len([m for m in read_metrics(out) if "eval_loss" in m]) == 1


def test_no_resume_starts_over_in_place(run_dir, dataset, tmp_path, capsys):
    out = _copy(run_dir, tmp_path)
    (out / "notes.txt").write_text("mine")  # not the trainer's: left alone
    old = read_metrics(out)
    assert main(_args(_subset(dataset), out, "--max-steps", 1, "--no-resume")) == 0
    assert "resumed from" not in capsys.readouterr().err
    new = read_metrics(out)
    assert [m["step"] for m in new] == [1] and new[0]["sample_ids"] != old[0]["sample_ids"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert json.loads((out / "run.json").read_text())["data_source"] == _subset(dataset)
    assert (out / "notes.txt").read_text() == "mine"


def test_a_missing_model_path_is_one_line_and_exit_1(dataset, tmp_path):
    model = tmp_path / "no-such-model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--model",
            str(model),
            "--data",
            str(dataset),
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"trainer: error: --model {model}: no checkpoint dir with a config.json there "
        "(the trainer loads local checkpoints only, never from a hub)"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("raw", ["traces.jsonl", "traces.jsonl.zst", "dir-of-records"])
def test_raw_input_says_build_it_first(tmp_path, capsys, raw):
    path = tmp_path / raw
    if raw.startswith("dir"):
        path.mkdir()
        (path / "a.jsonl").write_text("{}\n")
    else:
        path.write_text("{}\n")
    assert main(_args(path, tmp_path / "run", "--max-steps", 1)) == 1
    assert capsys.readouterr().err == (
        f"trainer: error: --data {path} is raw input (records), not a built dataset: "
        f"run `vlmprep build --in {path} --out DIR` first, then pass --data DIR\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_missing_data_dir_is_one_line_and_exit_1(tmp_path, capsys):
    assert main(_args(tmp_path / "nope", tmp_path / "run", "--max-steps", 1)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"trainer: error: --data {tmp_path / 'nope'}: no such dataset dir") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()

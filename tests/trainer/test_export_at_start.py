"""What `--save-hf` (and a later `python -m trainer export`) needs is settled before step 1: a processor in a
bucket (`--data s3://...`, a local S3 server) is copied into RUN/processor at start-up and the export ships it,
even once the bucket is gone; a processor dir the export cannot ship, an RUN/hf that is not an earlier export and a
link planted at RUN/processor or RUN/hf each stop the run at start-up in one line, before any step trains."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.trainer.conftest import ROOT, trainer_cmd, trainer_env
from tests.trainer.test_remote import _to_s3, s3_server  # noqa: F401 - the local S3 server fixture
from trainer.train import main

ONE_STEP = ["--max-steps", "1", "--num-workers", "0", "--lr", "1e-30", "--no-progress", "--export-dtype", "fp32"]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A one-record dataset built with tiny:qwen2-vl (a small vocabulary: the run and its exports stay quick)."""
    from tests.trainer.test_family_training import build_one

    return build_one(tmp_path_factory.mktemp("small"), "tiny:qwen2-vl")[0]


def _train(*args) -> int:
    return main(["--tiny-random", "qwen2-vl", *ONE_STEP, *map(str, args)])


def _error(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trainer: error")]
    assert len(lines) == 1, lines
    return lines[0]


def _shipped(d: Path) -> dict[str, bytes]:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json")
    return {n: (d / n).read_bytes() for n in names if (d / n).is_file()}


def test_save_hf_with_a_bucket_dataset_ships_its_processor_and_export_works_once_the_bucket_is_gone(
    s3_server,  # noqa: F811
    small,
    tmp_path,
):
    """`--data s3://... --save-hf` trains and exports (before: both steps trained, then exit 1, "not a local
    processor dir"): RUN/hf holds the dataset's processor files, byte for byte, from the copy in RUN/processor made
    at start-up; `python -m trainer export RUN` later ships the same files with the bucket emptied."""
    import s3fs

    from trainer.export import main as export_main

    url = _to_s3(small, "export-bucket")
    run = tmp_path / "run"
    assert _train("--data", url, "--out", run, "--save-hf") == 0
    want = _shipped(small / "processor")
    assert set(want) >= {"tokenizer.json", "tokenizer_config.json"}
    assert _shipped(run / "processor") == want and _shipped(run / "hf") == want
    assert json.loads((run / "hf" / "export.json").read_text())["processor"] == str((run / "processor").resolve())
    fs = s3fs.S3FileSystem()
    fs.rm("export-bucket", recursive=True)
    fs.invalidate_cache()
    assert export_main([str(run), "--out", str(tmp_path / "later"), "--dtype", "fp32"]) == 0
    assert _shipped(tmp_path / "later") == want


def test_a_processor_the_export_cannot_ship_is_refused_before_step_1(small, tmp_path, capsys):
    """--processor DIR without tokenizer_config.json and a Qwen checkpoint (whose run loads no tokenizer): the
    export at the end would refuse it; with --save-hf the run refuses it at start-up instead (no step trained)."""
    import shutil

    from trainer.model import build_model, tiny_vocab
    from trainer.options import ModelOptions

    vocab = tiny_vocab("qwen2-vl", str(small / "processor"))
    build_model(ModelOptions(tiny_random="qwen2-vl", seed=0), vocab).save_pretrained(tmp_path / "ckpt")
    bare = tmp_path / "bare"
    shutil.copytree(small / "processor", bare)
    (bare / "tokenizer_config.json").unlink()
    run = tmp_path / "run"
    args = ["--data", small, "--out", run, "--processor", bare, "--save-hf"]
    assert main(["--model", str(tmp_path / "ckpt"), *ONE_STEP, *map(str, args)]) == 1
    line = _error(capsys)
    assert f"--save-hf: processor {bare}: not a local processor dir (no tokenizer_config.json)" in line, line
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    # without --save-hf nothing needs the tokenizer config: the run trains
    assert main(["--model", str(tmp_path / "ckpt"), *ONE_STEP, *map(str, args[:-1])]) == 0


def test_an_hf_dir_that_is_not_an_earlier_export_is_refused_before_step_1(small, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "notes.txt").write_text("mine\n")
    assert _train("--data", small, "--out", run, "--save-hf") == 1
    assert f"--out {run / 'hf'} is not an earlier export" in _error(capsys)
    assert (run / "hf" / "notes.txt").read_text() == "mine\n" and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("where", ["processor", "hf"])
def test_a_link_planted_at_run_processor_or_hf_is_refused_and_never_followed(
    s3_server,  # noqa: F811
    small,
    tmp_path,
    capsys,
    where,
):
    url = _to_s3(small, f"planted-{where}")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("the user's own file\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / where).symlink_to(victim, target_is_directory=True)
    assert _train("--data", url, "--out", run, "--save-hf") == 1
    assert f"{run / where} is a symlink" in _error(capsys)
    assert os.listdir(victim) == ["keep.txt"] and (victim / "keep.txt").read_text() == "the user's own file\n"
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.slow  # two torchrun ranks: ~30 s on 2 cores
def test_two_ranks_both_stop_at_start_up_on_rank_0s_refusal(small, tmp_path):
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "notes.txt").write_text("mine\n")
    cmd = trainer_cmd(["--data", small, "--out", run, "--save-hf", *ONE_STEP, "--device", "cpu"], 2)
    r = subprocess.run(cmd, cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("trainer: error")]
    assert len(lines) == 2 and all("is not an earlier export" in ln for ln in lines), r.stderr
    # torchrun's own ChildFailedError trace follows; no rank shows one
    assert f'File "{ROOT / "trainer"}' not in r.stderr and not (run / "metrics.jsonl").exists()

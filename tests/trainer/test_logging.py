"""Run curves: TensorBoard scalars in RUN/tb/ (read back with tensorboard's own event reader, also after a resume)
and `python -m trainer plot RUN` (the PNG opened and its curves found by colour)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.trainer.conftest import ROOT, read_metrics, run_trainer, trainer_env
from trainer.metrics import RunLog, tb_scalars
from trainer.plot import EVAL_COLOUR, PANELS, SOURCE_COLOURS, plot_run

TRAIN_TAGS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/grad_norm": "grad_norm",
    "perf/tokens_per_s": "tokens_per_s",
    "perf/pack_fill": "pack_fill",
    "perf/data_wait_s": "data_wait_s",
}


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """2 packed steps on CPU (packing, so pack_fill is logged too)."""
    out = tmp_path_factory.mktemp("tb") / "run"
    run_trainer(["--data", dataset, "--out", out, "--max-steps", 2, "--num-workers", 0, "--pack-to", 4096])
    return out


@pytest.mark.slow  # a CLI training run (make-test budget); in process: test_resumed_run_shows_each_step_once, test_plot_draws_every_curve
def test_training_writes_tensorboard_scalars(trained):
    metrics = read_metrics(trained)
    scalars = _scalars(trained)
    assert set(TRAIN_TAGS) <= set(scalars), sorted(scalars)
    for tag, key in TRAIN_TAGS.items():
        assert [s for s, _ in scalars[tag]] == [1, 2], tag
        np.testing.assert_allclose([v for _, v in scalars[tag]], [m[key] for m in metrics], rtol=1e-6, err_msg=tag)


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_off_a_terminal_log_every_1_prints_one_line_per_step_and_the_start_up_agrees_with_the_run(dataset, tmp_path):
    """A Slurm / nohup job: stdout is a pipe, so each step is a plain line there and in RUN/train.log; under
    --max-steps the start-up names the run's length, not the epoch's; counts take their plurals."""
    out = tmp_path / "run"
    proc = run_trainer(["--data", dataset, "--out", out, "--max-steps", 2, "--num-workers", 0, "--log-every", 1])
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("trainer: step ")]
    assert len(steps) == 2 and steps[0].startswith("trainer: step 1/2 | loss ") and steps[1].endswith("ETA 0:00:00")
    for key in ("| lr ", "| grad_norm ", " tok/s | data wait ", "% | ETA "):
        assert all(key in ln for ln in steps), key
    loss = [m["loss"] for m in read_metrics(out)]
    assert [float(ln.split("| loss ")[1].split(" ")[0]) for ln in steps] == pytest.approx(loss, abs=1e-4)
    log = (out / "train.log").read_text().splitlines()
    assert log[:2] == steps and log[-1].startswith("trainer: done at step 2: ")
    assert "trainer: run length: 2 steps (--max-steps); predicted steps per epoch: " in proc.stderr
    assert "(total " not in proc.stderr and "5 shards over 1 rank (rank 0: 5 shards " in proc.stderr


def test_log_every_writes_the_log_file_and_echoes_only_where_asked(tmp_path, capsys):
    run = RunLog(tmp_path, total_steps=30, start_step=0, progress=False, tensorboard=False, log_every=10, echo=False)
    for step in range(1, 31):
        run.step(
            {"step": step, "loss": 1.0, "lr": 1e-5, "grad_norm": 0.5, "tokens_per_s": 100.0, "data_wait_frac": 0.25}
        )
    run.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == [
        "trainer: step 1/30",
        "trainer: step 10/30",
        "trainer: step 20/30",
        "trainer: step 30/30",
    ]
    assert "| loss 1.0000 | lr 1e-05 | grad_norm 0.500 | 100 tok/s | data wait 25% | ETA 0:00:" in lines[0]
    assert capsys.readouterr().out == ""


def test_packing_start_up_line_expects_the_fill_a_rank_can_reach():
    from trainer.data.pack import check_packing

    def line(samples, tokens, world=1, window=64):
        manifest = {"config": {"seq_len": 2048}, "shards": [{"num_samples": samples, "num_tokens": tokens}]}
        return check_packing(pack_to=4096, pack_window=window, manifest=manifest, model_type="qwen2_vl", world=world)

    assert "expected a low fill (a rank's whole epoch is 2.2 rows' worth" in line(18, 9000)  # a tiny dataset
    assert "expected fill >= 0.95" in line(1000, 500_000)
    assert "expected a low fill" in line(1000, 500_000, world=512)
    assert "expected a lower fill (raise --pack-window to " in line(1000, 500_000, window=8)


def test_eval_metrics_become_eval_scalars():
    record = {
        "step": 7,
        "loss": 1.5,
        "lr": 1e-5,
        "sample_ids": ["a"],
        "epoch": 0,
        "eval_loss": 2.25,
        "eval_tokens": 400,
        "eval_loss_per_source": {"web": 2.0, "docs": 2.5},
        "eval_flag": True,
    }
    assert tb_scalars(record) == {
        "train/loss": 1.5,
        "train/lr": 1e-5,
        "eval/loss": 2.25,
        "eval/tokens": 400.0,
        "eval/loss_per_source/web": 2.0,
        "eval/loss_per_source/docs": 2.5,
    }


def test_resumed_run_shows_each_step_once(tmp_path):
    """A run killed after step 3 resumes from its step-2 checkpoint and redoes step 3: TensorBoard shows steps
    1, 2, 3 once, step 3 with the resumed run's value (as metrics.jsonl does)."""

    def log(start, steps):
        run = RunLog(tmp_path, total_steps=3, start_step=start, progress=False, tensorboard=True, log_every=0)
        for step, loss in steps:
            run.step({"step": step, "loss": loss, "lr": 0.1, "tokens_per_s": 1.0})
        return run

    killed = log(0, [(1, 3.0), (2, 2.0), (3, 1.0)])
    assert [s for s, _ in _scalars(tmp_path)["train/loss"]] == [1, 2, 3]  # on disk before any close: a kill keeps it
    killed.close()
    log(2, [(3, 0.5)]).close()
    assert _scalars(tmp_path)["train/loss"] == [(1, 3.0), (2, 2.0), (3, 0.5)]
    assert [(m["step"], m["loss"]) for m in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.0), (3, 0.5)]


def _colour_pixels(png, colour: str) -> int:
    from matplotlib.colors import to_rgb

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    want = np.array([round(c * 255) for c in to_rgb(colour)])
    return int((np.abs(rgb - want).max(-1) <= 8).sum())


def _write_metrics(run_dir, n=40, eval_every=10, sources=()):
    """A run's metrics.jsonl as the trainer writes it (packed: pack_fill; a mixture of `sources`: loss_by_source,
    None where a source had no trained token that step)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, n + 1):
            row = {
                "step": s,
                "loss": 3.0 / s + 1,
                "lr": 1e-5 * min(1.0, s / 5),
                "grad_norm": 2.0 / s + 0.5 * (s % 3),
                "tokens_per_s": 900 + s,
                "data_wait_s": 0.01 * (s % 4),
                "pack_fill": 0.9 + 0.002 * (s % 5),
            }
            if sources:
                row["loss_by_source"] = {
                    name: (None if (s + i) % 7 == 0 else 3.0 / s + 0.5 * i) for i, name in enumerate(sources)
                }
            f.write(json.dumps(row) + "\n")
            if s % eval_every == 0:
                f.write(json.dumps({"step": s, "eval_loss": 3.0 / s + 1.2, "eval_tokens": 100}) + "\n")


def test_plot_draws_every_curve(tmp_path):
    """Loss (and eval loss), lr, grad norm, tokens/s, data wait and pack fill each draw their curve; a mixture adds
    one loss curve per source."""
    _write_metrics(tmp_path / "run", sources=("web", "docs"))
    png = plot_run(tmp_path / "run")
    assert png == tmp_path / "run" / "curves.png"
    img = Image.open(png)
    assert img.format == "PNG" and img.size == (1500, 700)
    assert {key for key, _, _ in PANELS} >= {"grad_norm", "pack_fill"}
    for key, _, colour in PANELS:
        assert _colour_pixels(png, colour) > 200, f"no {key} curve ({colour}) in the plot"
    for name, colour in zip(("docs", "web"), SOURCE_COLOURS):
        assert _colour_pixels(png, colour) > 200, f"no loss curve for source {name} ({colour})"
    assert _colour_pixels(png, EVAL_COLOUR) > 50, "no eval_loss curve"
    _write_metrics(tmp_path / "no-eval", eval_every=10**6)
    plain = plot_run(tmp_path / "no-eval")
    assert _colour_pixels(plain, EVAL_COLOUR) == 0 and _colour_pixels(plain, SOURCE_COLOURS[0]) == 0


@pytest.mark.slow  # a CLI training run (make-test budget); in process: test_resumed_run_shows_each_step_once, test_plot_draws_every_curve
def test_plot_command_on_a_training_run(trained, tmp_path):
    out = tmp_path / "sub" / "curves.png"
    r = subprocess.run(
        [sys.executable, "-m", "trainer", "plot", str(trained), "--out", str(out)],
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"trainer plot: wrote {out}"
    for key, _, colour in PANELS:
        assert _colour_pixels(out, colour) > 50, f"no {key} curve ({colour}) in the plot"


def test_plot_errors_are_one_line(tmp_path, monkeypatch, capsys):
    from trainer.plot import main

    assert main([str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"trainer plot: error: cannot read {tmp_path / 'missing' / 'metrics.jsonl'}: No such file or directory "
        f"(is {tmp_path / 'missing'} a trainer run dir?)"
    ]
    _write_metrics(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main([str(tmp_path / "run")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "trainer plot: error: plot needs matplotlib: pip install 'vlmprep[tb]'"
    ]

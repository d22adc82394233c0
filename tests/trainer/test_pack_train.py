"""Packing end to end through the CLI: torchrun 2 ranks x 2 workers with --pack-to over 5 uneven shards (every
sample once, same steps on both ranks, no hang), SIGKILL and resume with 3 workers (the same packs, losses and
grad norms), and the start-up refusals."""

import os
import signal
import subprocess
import time

import pytest

from tests.trainer.conftest import (
    ROOT,
    build_dataset,
    read_all_samples,
    read_metrics,
    run_trainer,
    trainer_cmd,
    trainer_env,
)
from trainer.train import main

T = 512
PACK = [
    "--pack-to",
    T,
    "--pack-window",
    4,
    "--micro-batch-size",
    1,
    "--save-every",
    2,
    "--seed",
    0,
    "--schedule-steps",
    10,
]
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def short_dataset(traces, tmp_path_factory):
    """The conftest traces built with --seq-len 512: about 8 rows of 512 tokens, so a few packed steps per rank."""
    return build_dataset(traces, tmp_path_factory.mktemp("ds512") / "shards", seq_len=T, truncate=True)


@pytest.fixture(scope="module")
def run_p(short_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("run_p")
    proc = run_trainer(["--data", short_dataset, "--out", out, "--num-workers", 2, *PACK], nproc=2, timeout=300)
    return out, read_metrics(out), proc.stderr


@pytest.mark.slow
def test_packed_two_ranks_two_workers_see_every_sample_once_in_full_rows(run_p, short_dataset, image_spec):
    out, metrics, stderr = run_p
    everything = sorted(s.id for s in read_all_samples(short_dataset, image_spec))
    seen = [i for m in metrics for i in m["sample_ids"]]
    assert len(seen) == len(set(seen)) and sorted(seen) == everything
    assert len(metrics) >= 4 and [m["step"] for m in metrics] == list(range(1, len(metrics) + 1))
    assert all(len(m["tokens_per_rank"]) == 2 and len(m["samples_per_rank"]) == 2 for m in metrics)
    assert all(t <= T for m in metrics for t in m["tokens_per_rank"])  # one row of <= T per rank and step
    assert all(m["segments"] == len(m["sample_ids"]) for m in metrics)
    fill = [m["pack_fill"] for m in metrics]
    assert all(0 < f <= 1 for f in fill) and sum(fill[:-1]) / len(fill[:-1]) >= 0.8, fill
    assert all(
        m["max_over_mean_tokens"] == pytest.approx(max(m["tokens_per_rank"]) * 2 / sum(m["tokens_per_rank"]))
        for m in metrics
    )
    assert f"rows of <= {T} tokens" in stderr and "window of 4 samples" in stderr and "remainder policy 'pad'" in stderr
    assert "mfu" not in metrics[0]  # CUDA only


def _wait_for_checkpoint(path, proc, deadline):
    while time.monotonic() < deadline:  # renamed into place only once complete: kill right after it appears
        if (path / ".metadata").is_file():
            return
        assert proc.poll() is None, "trainer ended before it could be killed"
        time.sleep(0.02)
    raise AssertionError(f"no {path} before the deadline")


@pytest.mark.slow
def test_packed_kill_then_resume_with_another_worker_count_makes_the_same_packs(run_p, short_dataset, tmp_path):
    _, ref, _ = run_p
    out = tmp_path / "run_q"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            trainer_cmd(["--data", short_dataset, "--out", out, "--num-workers", 2, *PACK], 2),
            cwd=ROOT,
            env=trainer_env(),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        try:
            _wait_for_checkpoint(out / "checkpoints" / "step-00000002", proc, time.monotonic() + 240)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (out / "checkpoints" / f"step-{len(ref):08d}").exists()  # killed mid-epoch
    proc = run_trainer(["--data", short_dataset, "--out", out, "--num-workers", 3, *PACK], nproc=2, timeout=300)
    assert "resumed from" in proc.stderr
    got = read_metrics(out)
    assert [(m["step"], m["sample_ids"]) for m in got] == [(m["step"], m["sample_ids"]) for m in ref]
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]  # bit-exact
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    assert [m["tokens_per_rank"] for m in got] == [m["tokens_per_rank"] for m in ref]


@pytest.mark.slow
def test_resume_without_pack_to_is_refused(run_p, short_dataset, capsys):
    out, _, _ = run_p
    assert (
        main(
            [
                "--data",
                str(short_dataset),
                "--out",
                str(out),
                "--tiny-random",
                "qwen2-vl",
                "--no-progress",
                "--num-workers",
                "0",
                "--max-steps",
                "99",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err  # the run dir's run.json names the differing options before anything loads
    assert f"pack_to {T} -> 0" in err and "pass --no-resume to start over" in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pack-to", "1024"], "--pack-to 1024 is shorter than the dataset's seq_len 2048"),
        (["--pack-to", "1024", "--max-tokens-per-batch", "4096"], "pick one"),
    ],
)
def test_start_up_refusals(dataset, tmp_path, capsys, args, message):
    assert (
        main(
            [
                "--data",
                str(dataset),
                "--out",
                str(tmp_path / "r"),
                "--tiny-random",
                "qwen2-vl",
                "--no-progress",
                "--max-steps",
                "1",
                *args,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("trainer: error: ") and message in err[-1], err

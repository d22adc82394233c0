"""End to end through the CLI: torchrun with 2 ranks x 2 DataLoader workers over 5 uneven shards, checked
against a single-process replay, a killed-and-resumed run and a run over HTTP."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.trainer.conftest import ROOT, read_all_samples, read_metrics, run_trainer, trainer_cmd, trainer_env

COMMON = ["--micro-batch-size", 2, "--save-every", 2, "--seed", 0]
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def run_a(dataset, tmp_path_factory):
    """The uninterrupted reference run: one full epoch."""
    out = tmp_path_factory.mktemp("run_a")
    proc = run_trainer(["--data", dataset, "--out", out, "--num-workers", 2, *COMMON], nproc=2, timeout=300)
    return out, read_metrics(out), proc.stderr


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_two_ranks_two_workers_read_every_sample_once_and_run_the_same_steps(run_a, dataset, image_spec):
    out, metrics, stderr = run_a
    everything = sorted(s.id for s in read_all_samples(dataset, image_spec))
    seen = [i for m in metrics for i in m["sample_ids"]]
    assert len(seen) == len(set(seen)) and sorted(seen) == everything
    # Ranks own 8 and 10 samples (token-balanced shards): 5 steps of 2 samples for the busier rank; every
    # step's metrics were gathered from both ranks, and the idle rank took empty micro-batches in step 5.
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["samples_per_rank"] for m in metrics][-1] == [0, 2]
    assert all(len(m["samples_per_rank"]) == 2 for m in metrics)
    assert "max/mean imbalance 1.136" in stderr and "remainder policy 'pad'" in stderr
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "num_tokens",
        "num_trained_tokens",
        "tokens_per_s",
        "samples_per_s",
        "data_wait_s",
    ):
        assert all(isinstance(m[key], (int, float)) for m in metrics), key
    assert (out / "config.toml").is_file() and (out / "checkpoints" / "step-00000005" / ".metadata").is_file()


@pytest.mark.slow  # a single-process replay of the whole epoch: ~50 s on 2 cores
def test_fsdp_two_ranks_equal_a_single_process_on_the_same_global_batches(run_a, dataset, image_spec):
    from trainer.config import TrainConfig
    from trainer.data.collate import CollateSpec, collate
    from trainer.data.vision import Patchifier
    from trainer.model import build_model
    from trainer.options import ModelOptions, Optimization
    from trainer.startup import build_optimizer
    from trainer.train import lr_at, train_step

    _, metrics, _ = run_a
    by_id = {s.id: s for s in read_all_samples(dataset, image_spec)}
    cfg = TrainConfig(data="-", tiny_random="qwen2-vl")
    net = build_model(ModelOptions(tiny_random="qwen2-vl", seed=0))
    opt = build_optimizer(Optimization.of(cfg), net)
    spec = CollateSpec(pad_id=0, image_token_id=int(net.config.image_token_id), patch_size=14, merge_size=2)
    worst = [0.0, 0.0]
    for m in metrics:
        batch = collate([by_id[i] for i in m["sample_ids"]], spec)  # the whole global batch, one micro-batch
        lr = lr_at(
            m["step"] - 1, lr=cfg.lr, warmup_steps=cfg.warmup_steps, total=len(metrics), min_lr_ratio=cfg.min_lr_ratio
        )
        for g in opt.param_groups:
            g["lr"] = lr
        loss_sum, grad_norm = train_step(
            net,
            opt,
            [batch],
            patchifier=Patchifier(image_spec, "cpu"),
            global_trained=batch.num_trained,
            max_grad_norm=cfg.max_grad_norm,
        )
        assert lr == m["lr"] and batch.num_trained == m["num_trained_tokens"]
        worst = [
            max(worst[0], abs(loss_sum / batch.num_trained / m["loss"] - 1)),
            max(worst[1], abs(grad_norm / m["grad_norm"] - 1)),
        ]
        assert loss_sum / batch.num_trained == pytest.approx(m["loss"], rel=1e-6, abs=0), m["step"]
        assert grad_norm == pytest.approx(m["grad_norm"], rel=1e-4, abs=0), m["step"]
    print(
        f"fsdp vs single process over {len(metrics)} steps: loss rel diff <= {worst[0]:.1e}, "
        f"grad norm rel diff <= {worst[1]:.1e}"
    )


def _wait_for_step(run_dir, step, proc, deadline):
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.is_file() and any(m["step"] >= step for m in read_metrics(run_dir)):
            return
        assert proc.poll() is None, "trainer ended before it could be killed"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} before the deadline")


@pytest.mark.slow  # a second and a third torchrun (killed, resumed): ~1.5 min on 2 cores
def test_kill_then_resume_with_another_worker_count_replays_the_uninterrupted_run(run_a, dataset, tmp_path):
    _, ref, _ = run_a
    out = tmp_path / "run_b"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            trainer_cmd(["--data", dataset, "--out", out, "--num-workers", 2, *COMMON], 2),
            cwd=ROOT,
            env=trainer_env(),
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        try:
            _wait_for_step(out, 3, proc, time.monotonic() + 240)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole launch: torchrun, both ranks, their workers
            proc.wait()
    assert (out / "checkpoints" / "step-00000002" / ".metadata").is_file()
    proc = run_trainer(["--data", dataset, "--out", out, "--num-workers", 3, *COMMON], nproc=2, timeout=300)
    assert "resumed from" in proc.stderr
    got = read_metrics(out)
    assert [(m["step"], m["sample_ids"]) for m in got] == [(m["step"], m["sample_ids"]) for m in ref]
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]  # bit-exact
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # another full torchrun epoch, over HTTP
def test_shards_over_http_train_like_from_disk(run_a, dataset, tmp_path):
    _, ref, _ = run_a
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(dataset)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "http.server did not start"
                time.sleep(0.1)
        out = tmp_path / "run_http"
        run_trainer(
            [
                "--data",
                f"http://127.0.0.1:{port}/",
                "--out",
                out,
                "--num-workers",
                2,
                *COMMON,
                "--max-steps",
                2,
                "--schedule-steps",
                len(ref),
            ],
            nproc=2,
            timeout=300,
        )
    finally:
        server.kill()
        server.wait()
    got = read_metrics(out)
    assert [(m["sample_ids"], m["loss"], m["grad_norm"]) for m in got] == [
        (m["sample_ids"], m["loss"], m["grad_norm"]) for m in ref[:2]
    ]

"""Trainer fixtures: small vlmprep datasets built once per session (18 records -> 5 shards of 4,4,4,4,2
samples), and a runner for the trainer CLI (plain python or torchrun) that returns the metrics."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TRACES = dict(
    n=18, seed=1, min_images=1, max_images=3, width=224, height=160, overlong_fraction=0.0, text_only_fraction=0.2
)


def build_dataset(
    traces: Path,
    out: Path,
    *,
    image_format: str = "zstd",
    samples_per_shard: int = 4,
    seq_len: int = 2048,
    truncate: bool = False,
) -> Path:
    """truncate: one sample per trace, cut at seq_len (its lost turns accepted), as a short-sequence dataset."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    # The demo's agent turns carry tool_calls the Qwen2-VL template does not render: train their content.
    policy = {"tool_calls": "train-content"} if "tool_calls" in BuildConfig.__dataclass_fields__ else {}
    if truncate:
        policy.update(long_traces="truncate", min_turn_coverage=0.0)
    build(
        BuildConfig(
            inputs=(str(traces),),
            out=str(out),
            processor="builtin:qwen2-vl",
            seq_len=seq_len,
            samples_per_shard=samples_per_shard,
            image_format=image_format,
            progress=False,
            **policy,
        )
    )
    return out


@pytest.fixture(scope="session")
def traces(tmp_path_factory) -> Path:
    from scripts.demo_traces import write_traces

    path = tmp_path_factory.mktemp("traces") / "traces.jsonl.zst"
    write_traces(path, **TRACES)
    return path


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, traces) -> Path:
    return build_dataset(traces, tmp_path_factory.mktemp("ds") / "shards")


@pytest.fixture(scope="session")
def image_spec(dataset):
    from trainer.data.processors import load_image_processor_config
    from trainer.data.vision import ImageSpec

    return ImageSpec.from_config(load_image_processor_config(str(dataset / "processor")))


def trainer_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def trainer_cmd(args: list[str], nproc: int) -> list[str]:
    launch = (
        [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", "-m", "trainer"]
        if nproc > 1
        else [sys.executable, "-m", "trainer"]
    )
    return launch + ["--tiny-random", "qwen2-vl", "--no-progress"] + [str(a) for a in args]


def run_trainer(args: list, *, nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        trainer_cmd(args, nproc), cwd=ROOT, env=trainer_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def kill_at_step(args: list, out: Path, steps: int, log: Path, *, nproc: int = 1, timeout: float = 600) -> None:
    """Run the trainer into `out` until its metrics.jsonl has `steps` rows, then SIGKILL the whole launch (torchrun,
    every rank and their DataLoader workers); its output goes to `log`."""
    import signal
    import time

    with open(log, "w") as f:
        proc = subprocess.Popen(
            trainer_cmd([*args, "--out", out], nproc),
            cwd=ROOT,
            env=trainer_env(),
            stdout=f,
            stderr=f,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while not (Path(out) / "metrics.jsonl").is_file() or len(read_metrics(out)) < steps:
                assert proc.poll() is None and time.monotonic() < deadline, "trainer ended before it could be killed"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging: a TimeoutError in the main thread once `seconds` have passed (SIGALRM)."""

    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_all_samples(dataset: Path, spec) -> list:
    """Every sample of the dataset in manifest order, decoded in-process."""
    from trainer.data.sources import resolve_data
    from trainer.data.streams import RankStream

    return list(RankStream(list(resolve_data(str(dataset)).shards), start=0, spec=spec))


def open_data_of(cfg, world: int = 1):
    """open_data as the run calls it for a TrainConfig (trainer/train.py run)."""
    from trainer.data import open_data
    from trainer.model import model_type_of
    from trainer.options import DataOptions

    return open_data(
        DataOptions.of(cfg),
        model_type=model_type_of(model=cfg.model, tiny_random=cfg.tiny_random),
        packing=bool(cfg.pack_to),
        world=world,
    )


def make_loader_of(cfg, data, *, collate_spec, check=None, rank: int = 0):
    """read_plan and make_loader as the run calls them for a TrainConfig (`check`: the test's own ShardCheck in place
    of the plan's), on the CPU."""
    import dataclasses

    import torch

    from trainer.data import data_streams, make_loader, read_plan
    from trainer.options import Batching, DataOptions, RunLength

    plan = read_plan(DataOptions.of(cfg), data, rank=rank)
    if check is not None:
        plan = dataclasses.replace(plan, check=check)
    options = DataOptions.of(dataclasses.replace(cfg, shuffle_span=plan.shuffle_span))
    batching, length = Batching.of(cfg), RunLength.of(cfg)
    read = data_streams(options, plan, data, batching=batching, length=length, device=torch.device("cpu"))
    return make_loader(read, options, collate_spec, batching=batching, length=length)

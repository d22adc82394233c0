"""Other stacks at the trainer's memory: peak RSS of one process training 2 steps at batch 2 on the demo agent shards
(make demo's build options; CPU fp32, tiny random Qwen2-VL with the real 151,936-token vocabulary), each in a fresh
process: `python -m trainer` vs HF Trainer through vlmprep.clients.collate.Collator(trained_logits=True), with their
step-1 losses; and HF Trainer with the plain Collator (logits at every position), stopped past ALL_LOGITS_CAP x the
trainer's peak (or this machine's free memory less 2 GB): it can take many times the trainer's memory.
`python -m benchmarks.bench_clients trainer|hf-trained|hf-all DS OUT` runs one of them alone, uncapped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_build import status_mb, timed_build
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces

ROOT = Path(__file__).resolve().parents[1]
ALL_LOGITS_CAP = 2.0  # the all-logits run (the "before" figure) is stopped past this multiple of the trainer's peak
GOAL = 1.5  # HF Trainer's peak / the trainer's (issue 33)


def _free_mb() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 1024


def measure(which: str, ds: Path, out: Path, cap_mb: float | None = None) -> dict:
    """Run `python -m benchmarks.bench_clients WHICH DS OUT` and read its result; past cap_mb of RSS it is killed and
    reported as stopped (its RSS polled every 50 ms: the peak seen, not the exact high-water mark)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_clients", which, str(ds), str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        seen = 0.0
        while p.poll() is None:
            seen = max(seen, status_mb("VmRSS", p.pid))
            if cap_mb is not None and seen > cap_mb:
                p.kill()
                p.wait()
                return {
                    "stopped_past_mb": round(cap_mb),
                    "peak_rss_mb_seen": round(seen),
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            time.sleep(0.05)
    if p.returncode != 0:
        raise RuntimeError(f"{which} exited {p.returncode}: {(out / 'log.txt').read_text()[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    return {**res, "seconds": round(time.perf_counter() - t0, 1)}


def _train_trainer(ds: str, out: str) -> float:
    from trainer.train import main

    assert (
        main(
            [
                "--data",
                ds,
                "--out",
                f"{out}/run",
                "--tiny-random",
                "qwen2-vl",
                "--max-steps",
                "2",
                "--micro-batch-size",
                "2",
                "--no-shuffle",
                "--no-shuffle-shards",
                "--num-workers",
                "0",
                "--no-progress",
                "--device",
                "cpu",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    return json.loads(Path(out, "run", "metrics.jsonl").read_text().splitlines()[0])["loss"]


def _train_hf(ds: str, out: str, trained_logits: bool) -> float:
    """docs/other-libraries.md's HF Trainer block, the model being the trainer's tiny one (as its test runs it)."""
    from transformers import Trainer, TrainingArguments

    import vlmprep.clients.hf
    from trainer.model import build_model
    from trainer.options import ModelOptions
    from vlmprep.clients.collate import Collator

    args = TrainingArguments(
        output_dir=f"{out}/hf",
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        report_to="none",
        remove_unused_columns=False,
        accelerator_config={"dispatch_batches": False},
    )
    trainer = Trainer(
        model=build_model(ModelOptions(tiny_random="qwen2-vl")),
        args=args,
        train_dataset=vlmprep.clients.hf.iterable_dataset(ds),
        data_collator=Collator(ds, trained_logits=trained_logits),
    )
    trainer.train()
    return next(e["loss"] for e in trainer.state.log_history if e.get("step") == 1 and "loss" in e)


def demo_shards(quick: bool) -> tuple[Path, dict]:
    """The first 4 demo traces (2 steps of 2) built as `make demo` builds them; quick: small screenshots. Returns the
    dataset and the first batch's size."""
    import vlmprep.clients.hf

    inp = traces(4, width=320, height=200, max_images=4) if quick else traces(4)
    ds = OUT / ("clients-quick" if quick else "clients-demo")
    timed_build(inp, ds, seq_len=16384, samples_per_shard=16)
    samples = list(vlmprep.clients.hf.iterable_dataset(ds))[:2]
    return ds, {
        "tokens": sum(len(s["input_ids"]) for s in samples),
        "trained_tokens": sum(int(s["loss_mask"].sum()) for s in samples),
        "images": sum(len(s["images"]) for s in samples),
    }


def run(quick: bool) -> list[dict]:
    ds, first = demo_shards(quick)
    base = dict(
        data="demo traces 0-3, make demo's build options" + (" (quick: 320x200)" if quick else ""),
        batch=2,
        steps=2,
        device="cpu fp32",
        model="tiny random qwen2-vl, vocab 151936",
        first_batch=first,
    )
    trainer = measure("trainer", ds, OUT / "clients-trainer")
    hf = measure("hf-trained", ds, OUT / "clients-hf-trained")
    cap = min(ALL_LOGITS_CAP * trainer["peak_rss_mb"], _free_mb() - 2048)
    hf_all = (
        measure("hf-all", ds, OUT / "clients-hf-all", cap_mb=cap)
        if cap > GOAL * trainer["peak_rss_mb"]
        else {"skipped": f"{round(_free_mb())} MB free"}
    )
    rows = [
        emit("clients", metric="peak_rss", run="python -m trainer", **base, **trainer),
        emit("clients", metric="peak_rss", run="HF Trainer, Collator(DIR, trained_logits=True)", **base, **hf),
        emit("clients", metric="peak_rss", run="HF Trainer, Collator(DIR): logits at every position", **base, **hf_all),
    ]
    all_logits = (
        round(hf_all["peak_rss_mb"] / trainer["peak_rss_mb"], 3)
        if "peak_rss_mb" in hf_all
        else f"> {round(cap / trainer['peak_rss_mb'], 2)} (stopped)"
        if "stopped_past_mb" in hf_all
        else hf_all["skipped"]
    )
    want = trainer["step1_loss"]
    rows.append(
        emit(
            "clients",
            metric="ratio",
            ratio=round(hf["peak_rss_mb"] / trainer["peak_rss_mb"], 3),
            goal=GOAL,
            step1_loss_rel_diff=abs(hf["step1_loss"] - want) / want,
            all_logits_over_trainer_peak_rss=all_logits,
        )
    )
    return rows


def _child(which: str, ds: str, out: str) -> None:
    """One run in this process: its own peak RSS (VmHWM) and step-1 loss -> OUT/result.json."""
    t0 = time.perf_counter()
    if which == "trainer":
        loss = _train_trainer(ds, out)
    else:
        loss = _train_hf(ds, out, trained_logits=which == "hf-trained")
    res = {
        "peak_rss_mb": round(status_mb("VmHWM")),
        "step1_loss": loss,
        "train_seconds": round(time.perf_counter() - t0, 1),
    }
    Path(out, "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    _child(*sys.argv[1:])

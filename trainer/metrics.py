"""Run log on rank 0: one JSON line per step in RUN/metrics.jsonl, plus a progress bar on the terminal."""
from __future__ import annotations

import json
from pathlib import Path


def truncate_metrics(path: Path, last_step: int) -> None:
    """A resumed run redoes the steps after its checkpoint: drop their lines from the killed run."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text(encoding="utf-8").splitlines()
            if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")


class RunLog:
    def __init__(self, run_dir: Path, *, total_steps: int | None, start_step: int, progress: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, start_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
                            TimeRemainingColumn(), disable=not progress)
        self.bar.start()
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step, loss=float("nan"), tps=0.0)

    def step(self, record: dict) -> None:
        self.file.write(json.dumps(record, ensure_ascii=True) + "\n")
        self.file.flush()
        self.bar.update(self.task, completed=record["step"], loss=record["loss"], tps=record["tokens_per_s"])

    def close(self) -> None:
        self.bar.stop()
        self.file.close()

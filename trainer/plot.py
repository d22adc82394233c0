"""`python -m trainer plot RUN`: one PNG of a run's curves (loss and eval loss, lr, tokens/s, data wait) from
RUN/metrics.jsonl, for people without TensorBoard."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trainer.config import ConfigError, run_tool

# (metrics.jsonl key, panel title, colour): one panel per entry; eval_loss joins the loss panel.
PANELS = (("loss", "loss", "tab:blue"), ("lr", "learning rate", "tab:green"),
          ("tokens_per_s", "tokens/s", "tab:purple"), ("data_wait_s", "data wait (s)", "tab:red"))
EVAL_COLOUR = "tab:orange"


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror} (is {run_dir} a trainer run dir?)") from None
    try:
        return [json.loads(ln) for ln in lines if ln.strip()]
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON lines ({e})") from None


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry `key` as a number."""
    pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float)) and "step" in r]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of RUN/metrics.jsonl to `out` (default RUN/curves.png); returns the PNG's path."""
    try:
        from matplotlib.figure import Figure  # without pyplot: no GUI backend, no global state
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError("plot needs matplotlib: pip install 'vlmprep[tb]'") from None
    run_dir = Path(run_dir)
    records = read_records(run_dir)
    if not any("loss" in r for r in records):
        raise ConfigError(f"{run_dir / 'metrics.jsonl'} has no training steps yet: nothing to plot")
    out = Path(out) if out else run_dir / "curves.png"
    fig = Figure(figsize=(11, 7), dpi=100, layout="constrained")
    fig.suptitle(str(run_dir))
    for ax, (key, title, colour) in zip(fig.subplots(2, 2).flat, PANELS):
        steps, values = series(records, key)
        ax.plot(steps, values, color=colour, marker="." if len(steps) < 50 else None, label=key)
        if key == "loss":
            eval_steps, eval_values = series(records, "eval_loss")
            if eval_steps:
                ax.plot(eval_steps, eval_values, color=EVAL_COLOUR, marker="o", label="eval_loss")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer plot", allow_abbrev=False,
                                 description="Plot a run's curves (RUN/metrics.jsonl) into one PNG.")
    ap.add_argument("run", metavar="RUN", help="the run dir (--out of the training run)")
    ap.add_argument("--out", metavar="PNG", default="", help="where to write the PNG (default: RUN/curves.png)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    return run_tool("trainer plot", lambda: plot_run(ns.run, ns.out or None))

"""`python -m trainer plot RUN`: one PNG of a run's curves (loss with eval loss and, for a mixture, each source's loss;
lr; grad norm; tokens/s; data wait; pack fill) from RUN/metrics.jsonl, for people without TensorBoard."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from trainer.cli import run_tool
from trainer.config import ConfigError
from vlmprep_schemas.boundary import UnsafeWrite, open_no_follow, read_state

# (metrics.jsonl key, panel title, colour): one panel per entry, in a 2 x 3 grid; eval_loss and loss_by_source join
# the loss panel. A run without packing has no pack_fill: its panel says so.
PANELS = (
    ("loss", "loss", "tab:blue"),
    ("lr", "learning rate", "tab:green"),
    ("grad_norm", "grad norm (before clipping)", "tab:brown"),
    ("tokens_per_s", "tokens/s", "tab:purple"),
    ("data_wait_s", "data wait (s)", "tab:red"),
    ("pack_fill", "pack fill (real / row tokens)", "tab:olive"),
)
EVAL_COLOUR = "tab:orange"
SOURCE_COLOURS = ("tab:cyan", "tab:pink", "tab:gray", "gold", "navy", "lime")  # loss_by_source, cycled


def read_records(run_dir: Path) -> list[dict]:
    """RUN/metrics.jsonl -> its rows; a missing or unparsable file is a one-line ConfigError that says what RUN
    should be."""
    path = run_dir / "metrics.jsonl"
    try:
        lines = read_state(path, 1 << 40).decode("utf-8").splitlines()  # a link or FIFO there: refused, not waited on
    except UnsafeWrite as e:
        raise ConfigError(str(e)) from None
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


def source_series(records: list[dict], key: str = "loss_by_source") -> dict[str, tuple[list[int], list[float]]]:
    """Per source of a mixture: (steps, values) of the steps where that source had trained tokens."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        for name, v in (r.get(key) or {}).items():
            if isinstance(v, (int, float)) and "step" in r:
                steps, values = out.setdefault(name, ([], []))
                steps.append(r["step"])
                values.append(float(v))
    return out


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
    fig = Figure(figsize=(15, 7), dpi=100, layout="constrained")
    fig.suptitle(str(run_dir))
    for ax, (key, title, colour) in zip(fig.subplots(2, 3).flat, PANELS):
        steps, values = series(records, key)
        ax.plot(steps, values, color=colour, marker="." if len(steps) < 50 else None, label=key)
        if key == "loss":
            for i, (name, (s_steps, s_values)) in enumerate(sorted(source_series(records).items())):
                ax.plot(
                    s_steps, s_values, color=SOURCE_COLOURS[i % len(SOURCE_COLOURS)], linewidth=1, label=f"loss {name}"
                )
            eval_steps, eval_values = series(records, "eval_loss")
            if eval_steps:
                ax.plot(eval_steps, eval_values, color=EVAL_COLOUR, marker="o", label="eval_loss")
            ax.legend(fontsize="small")
        if not steps:
            ax.text(
                0.5,
                0.5,
                f"no {key} in metrics.jsonl" + (" (no --pack-to)" if key == "pack_fill" else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="0.4",
            )
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open_no_follow(tmp, "wb") as f:  # a link planted at the temp name is refused, not written through
        fig.savefig(f, format="png")
    os.replace(tmp, out)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer plot",
        allow_abbrev=False,
        description="Plot a run's curves (RUN/metrics.jsonl) into one PNG.",
    )
    ap.add_argument("run", metavar="RUN", help="the run dir (--out of the training run)")
    ap.add_argument("--out", metavar="PNG", default="", help="where to write the PNG (default: RUN/curves.png)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer plot RUN [--out PNG]` -> exit status: a run's curves drawn into one PNG; an unreadable run
    is one line and exit 1."""
    ns = _parser().parse_args(argv)
    return run_tool("trainer plot", lambda: plot_run(ns.run, ns.out or None))

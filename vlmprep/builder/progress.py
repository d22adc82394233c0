"""The build's progress bars (rich, on stderr when it is a terminal): records of one task, or tasks of a plan."""

from __future__ import annotations

import collections

from vlmprep.config import BuildConfig
from vlmprep.jobs import progress_bar


def record_progress(cfg: BuildConfig):
    """A progress bar over one task's records (rich; shows nothing unless cfg.progress)."""
    return progress_bar(
        "[bold]build",
        "records",
        "{task.fields[rate]:.1f} rec/s",
        "{task.fields[samples]} samples",
        "{task.fields[rejects]} rejects",
        disable=not cfg.progress,
    )


class TaskProgress:
    """A progress bar over tasks, fed by each finished task's totals (local pool and Ray alike)."""

    def __init__(self, cfg: BuildConfig, n: int):
        self.progress = progress_bar(
            "[bold]build tasks",
            "{task.fields[records]} records",
            "{task.fields[samples]} samples",
            "{task.fields[rejects]} rejects",
            disable=not cfg.progress,
        )
        self.n = n
        self.totals: collections.Counter = collections.Counter()

    def __enter__(self):
        self.progress.__enter__()
        self.bar = self.progress.add_task("tasks", total=self.n, records=0, samples=0, rejects=0)
        return self.tick

    def tick(self, totals: dict) -> None:
        """Adds one finished task's totals and moves the bar on by one task."""
        self.totals.update(totals)
        self.progress.update(
            self.bar,
            advance=1,
            records=self.totals["records"],
            samples=self.totals["samples"],
            rejects=self.totals["rejected"],
        )

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

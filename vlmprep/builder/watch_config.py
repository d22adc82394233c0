"""WatchConfig: `vlmprep watch`'s own options, each declared once (the CLI's are generated from these fields, as
build's are from BuildConfig), beside the BuildConfig of the builds it runs (its --in is the location watched)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from vlmprep.config import BuildConfig
from vlmprep.ingest import is_url
from vlmprep.options import OWN, opt

ON_CHANGE = ("report", "stop", "rebuild")
DEFAULT_EVERY = 60.0  # seconds, where neither --every nor --min-records is given
# Build options a watcher sets itself, never taken from its command line: each cycle decides --append, and a watcher
# never replaces a dataset, runs one task of a plan or stops after planning.
NOT_WATCH_OPTIONS = ("append", "overwrite", "task_index", "plan_only", "progress")


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """`vlmprep watch`: the builds' options (`build`: --in is the location watched, --out the dataset) and when and
    how the watcher builds, reports and serves its status. A local location is made absolute, so the inputs a
    version records name the same objects whatever directory the watcher is started from."""

    build: BuildConfig
    every: float | None = opt(
        None,
        OWN,
        f"Build what waits every SECONDS (default {DEFAULT_EVERY:g} unless --min-records is given; a first listing "
        "builds what waits at once).",
    )
    min_records: int | None = opt(
        None, OWN, "Build as soon as the waiting objects hold this many records (each object counted once)."
    )
    poll: float = opt(
        10.0,
        OWN,
        "List the location every SECONDS (at most --every): how soon the status and --min-records see a new object.",
    )
    on_change: str = opt(
        "report",
        OWN,
        "A built object whose size or ETag (locally: mtime) changed since: report (say so once, keep its samples) | "
        "stop (exit 1 naming it) | rebuild (build its content now into the next version, which replaces its "
        "samples; earlier versions stay as they are: docs/datasets-that-grow.md, Rebuild).",
        choices=ON_CHANGE,
    )
    status_file: str | None = opt(None, OWN, "Write the status as JSON to this file after every change (atomic).")
    status_port: int | None = opt(
        None, OWN, "Serve /healthz and /metrics (Prometheus text) on this port (0: any free one).", bounds=(0, 65535)
    )
    status_host: str = opt("127.0.0.1", OWN, "The address --status-port binds (0.0.0.0 for a pod's probes).")
    once: bool = opt(False, OWN, "One cycle (list, build what is due), then exit: for cron and tests.")
    # How long a watcher's lease on an --out in a bucket outlives its last renewal (renewed every quarter of it).
    lease_seconds: float = opt(60.0, None, "Lease of a bucket --out (library only).")

    def __post_init__(self):
        b = self.build
        location = tuple(p if is_url(p) else os.path.abspath(p) for p in b.inputs)
        object.__setattr__(self, "build", dataclasses.replace(b, inputs=location, progress=False))
        if self.every is not None and not self.every > 0:
            raise ValueError(f"--every {self.every}: must be a positive number of seconds, e.g. --every 60")
        if self.min_records is not None and self.min_records < 1:
            raise ValueError(f"--min-records {self.min_records}: must be >= 1")
        if not self.poll > 0:
            raise ValueError(f"--poll {self.poll}: must be a positive number of seconds, e.g. --poll 10")
        if self.on_change not in ON_CHANGE:
            raise ValueError(f"--on-change {self.on_change}: choose one of {', '.join(ON_CHANGE)}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds={self.lease_seconds}: must be > 0")
        given = [n for n in NOT_WATCH_OPTIONS[:4] if getattr(b, n) not in (False, None)]
        if given:
            raise ValueError(f"{given[0]}: a watcher sets it itself (each cycle appends); drop it")

    @property
    def period(self) -> float | None:
        """The time trigger: a build of what waits at most every this many seconds (None: --min-records alone)."""
        if self.every is not None:
            return self.every
        return None if self.min_records is not None else DEFAULT_EVERY

    @property
    def tick(self) -> float:
        """Seconds between listings."""
        return min(self.poll, self.period) if self.period is not None else self.poll


WATCH_FIELDS = {f.name: f for f in dataclasses.fields(WatchConfig) if f.metadata and f.metadata["group"] is not None}

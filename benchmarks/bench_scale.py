"""Scale-out benchmark: one plan of T tasks over the demo traces run by the local pool (2 processes) and by Ray on a
local cluster of 2 CPUs (started before the clock, as a user's cluster is): wall-clock and the Ray/local ratio
(same bytes, checked); then each task alone, one after another, for per-task seconds (and input bytes) max/mean."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from benchmarks.bench_build import build_config
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces


def _tree(d: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(d)).encode() + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _build(inp: Path, out: Path, **kw):
    from vlmprep.builder.pipeline import build

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res = build(build_config(inp, out, **kw))
    return time.perf_counter() - t0, res


def run(quick: bool, n: int | None = None, tasks: int | None = None) -> list[dict]:
    n = n or (6 if quick else 64)
    tasks = tasks or (3 if quick else 8)
    size = (320, 200) if quick else (1280, 720)
    inp = traces(n, width=size[0], height=size[1])
    kw = dict(seq_len=1024 if quick else 16384, samples_per_shard=16, tasks=tasks)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    local_s, local = _build(inp, OUT / "scale-local", workers=2, **kw)
    rows.append(
        emit(
            "scale",
            executor="local",
            processes=2,
            tasks=tasks,
            records=local.manifest.totals["records"],
            samples=local.manifest.totals["samples"],
            seconds=round(local_s, 2),
        )
    )
    try:
        import ray
    except ImportError:
        rows.append(emit("scale", executor="ray", skipped="ray not installed: pip install 'vlmprep[ray]'"))
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            ray_s, _ = _build(inp, OUT / "scale-ray", workers=2, executor="ray", **kw)
        finally:
            ray.shutdown()
        rows.append(
            emit(
                "scale",
                executor="ray",
                cpus=2,
                tasks=tasks,
                seconds=round(ray_s, 2),
                ray_over_local=round(ray_s / local_s, 3),
                identical_bytes=_tree(OUT / "scale-local") == _tree(OUT / "scale-ray"),
            )
        )
    # Each task alone in this process, one after another: its own work, free of contention for the 2 cores.
    serial_s, serial = _build(inp, OUT / "scale-serial", workers=1, **kw)
    secs = [serial.task_seconds[i] for i in range(tasks)]
    sizes = [c.bytes for c in serial.plan.cuts]
    rows.append(
        emit(
            "scale_balance",
            tasks=tasks,
            records=n,
            one_process_seconds=round(serial_s, 2),
            task_seconds=[round(s, 2) for s in secs],
            max_over_mean_seconds=round(max(secs) / (sum(secs) / tasks), 3),
            max_over_mean_bytes=round(max(sizes) / (sum(sizes) / tasks), 3),
        )
    )
    return rows

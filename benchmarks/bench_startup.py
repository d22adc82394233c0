"""Start-up benchmark: a task or Ray worker's seconds to import vs to get ready from a dataset's saved processor dir
(renderer_from_saved), and a pool worker's seconds to be forked ready from a loaded Renderer, each in a fresh process;
a build's time to its first record and its wall-clock with 1 and 2 workers, each build in a fresh process (a warm
parent would hide the imports)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_build import build_config
from benchmarks.emit import emit
from benchmarks.inputs import OUT, traces
from vlmprep.builder.workers import _WORKER_PRELOAD

GOAL_READY_S = 3  # a task or Ray worker's seconds from its imports to ready
GOAL_SPEEDUP_2 = 1.6  # 1 worker's wall-clock over 2 workers' on 2 cores

# What a task process has before it loads a processor: the forkserver's imports.
IMPORTS = "import " + ", ".join(_WORKER_PRELOAD)
_START = time.time()  # a build child sets it to its interpreter's start


def worker_child(processor_dir: str, inp: str) -> dict:
    """In a fresh process, after IMPORTS: seconds to renderer_from_saved, then to render the first record that has
    images (jinja compile, resize warm-up); then seconds until 2 pool workers forked from it (record_workers) have
    each answered."""
    from transformers import AutoProcessor

    from vlmprep.builder.workers import record_workers, renderer_from_saved
    from vlmprep.ingest.records import iter_records
    from vlmprep.process import Renderer

    cfg = build_config(Path(inp), Path(processor_dir).parent, seq_len=16384)
    t0 = time.perf_counter()  # the load before from_local_dir: transformers' own, in the same process
    Renderer(cfg, AutoProcessor.from_pretrained(processor_dir, local_files_only=True), saved=True)
    t0, before = time.perf_counter(), time.perf_counter() - t0
    renderer = renderer_from_saved(cfg, processor_dir)
    t1 = time.perf_counter()
    for raw in iter_records([Path(inp)]):
        t2 = time.perf_counter()
        if any(status == "ok" and s.num_images for status, s in renderer.process(raw)[0]):
            break
    t3 = time.perf_counter()
    with record_workers(
        build_config(Path(inp), Path(processor_dir).parent, seq_len=16384, workers=2), renderer
    ) as pool:
        pids = {f.result() for f in [pool.submit(_slow_pid) for _ in range(4)]}
    assert len(pids) == 2, pids
    return {
        "ready_s": t1 - t0,
        "transformers_load_s": before,
        "first_render_s": t3 - t2,
        "forked_ready_s": time.perf_counter() - t3 - 0.05,
    }


def _slow_pid() -> int:
    time.sleep(0.05)  # so that the 4 tasks land on both workers
    return os.getpid()


def build_child(inp: str, out: str, workers: int) -> dict:
    """In a fresh process: seconds from process start to the build's first record and to its end."""
    from vlmprep.builder import pipeline, task

    first = []
    ordered = task.ordered_results  # the name the task runner calls

    def timed(*args, **kw):  # the build consumes results in input order: the first one out is the first record
        for i, item in enumerate(ordered(*args, **kw)):
            if i == 0:
                first.append(time.time() - _START)
            yield item

    task.ordered_results = timed
    res = pipeline.build(build_config(Path(inp), Path(out), workers=workers, seq_len=16384))
    return {"first_record_s": first[0], "seconds": time.time() - _START, "samples": res.manifest.totals["samples"]}


def _child(code: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", f"import time; _t = time.time(); {code}"], check=True, capture_output=True, text=True
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def worker_startup(processor_dir: Path, inp: Path) -> dict:
    code = (
        f"{IMPORTS}; _i = time.time() - _t; import json; from benchmarks.bench_startup import worker_child; "
        f"r = worker_child({str(processor_dir)!r}, {str(inp)!r}); "
        "print(json.dumps({'imports_s': _i, **r}))"
    )
    return _child(code)


def timed_child_build(inp: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    code = (
        "import benchmarks.bench_startup as b; b._START = _t; import json; "
        f"print(json.dumps(b.build_child({str(inp)!r}, {str(out)!r}, {workers})))"
    )
    return _child(code)


def run(quick: bool) -> list[dict]:
    rows = []
    n = 4 if quick else 500
    # Small images keep a 500-record build near a minute on 2 cores, where start-up still matters.
    inp = traces(n, width=320 if quick else 640, height=200 if quick else 360, max_images=4 if quick else 8)
    runs = {w: timed_child_build(inp, OUT / f"startup-w{w}", w) for w in (1, 2)}

    probes = [worker_startup(OUT / "startup-w1" / "processor", inp) for _ in range(1 if quick else 3)]
    med = {
        k: statistics.median(p[k] for p in probes)
        for k in ("imports_s", "ready_s", "transformers_load_s", "first_render_s", "forked_ready_s")
    }
    rows.append(
        emit(
            "startup",
            metric="worker_ready",
            repeats=len(probes),
            imports_seconds=round(med["imports_s"], 2),
            ready_beyond_imports_seconds=round(med["ready_s"], 2),
            first_render_seconds=round(med["first_render_s"], 2),
            goal_seconds=GOAL_READY_S,
            forked_pool_workers_ready_seconds=round(med["forked_ready_s"], 2),
        )
    )
    # Per path, seconds from its imports to ready: a task process (local --tasks, forked from the forkserver that
    # imported) and a Ray worker both run cached_renderer -> renderer_from_saved after their imports; a pool worker
    # is forked from the loaded build. Beside it, transformers' own load of the same dir in the same processes.
    for path, key, how in (
        ("pool", "forked_ready_s", "forked from the build's loaded Renderer (record_workers)"),
        ("task", "ready_s", "renderer_from_saved of the dataset's processor dir after the imports"),
        ("ray", "ready_s", "renderer_from_saved, as a task (the Ray task runs run_task)"),
    ):
        rows.append(
            emit(
                "startup",
                metric="ready_beyond_imports",
                path=path,
                seconds=round(med[key], 2),
                goal_seconds=GOAL_READY_S,
                how=how,
                transformers_load_seconds=None if path == "pool" else round(med["transformers_load_s"], 2),
            )
        )
    for w, r in runs.items():
        rows.append(emit("startup", metric="first_record", workers=w, seconds=round(r["first_record_s"], 2)))
    for w, r in runs.items():
        rows.append(
            emit(
                "startup",
                metric="build_wall_clock",
                workers=w,
                records=n,
                samples=r["samples"],
                seconds=round(r["seconds"], 2),
            )
        )
    rows.append(
        emit(
            "startup",
            metric="speedup_2_workers_wall_clock",
            records=n,
            ratio=round(runs[1]["seconds"] / runs[2]["seconds"], 3),
            goal=GOAL_SPEEDUP_2,
        )
    )
    return rows

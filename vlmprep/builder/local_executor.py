"""Local executor: the plan's T tasks on this machine, in --workers processes that each run whole tasks (the processor
loaded once per process) or in this process with --workers 1 -> each task's wall time (the task manifests land in the
dataset dir). ray_executor.py runs them on a Ray cluster instead."""

from __future__ import annotations

import os
import time
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from vlmprep.builder.plan import Plan
from vlmprep.builder.progress import TaskProgress
from vlmprep.builder.task import run_task, task_start
from vlmprep.builder.workers import BuildError, pool_failure, worker_pool
from vlmprep.config import BuildConfig
from vlmprep.process import Renderer

# Where the stores' libraries take credentials and endpoints from (and web.py its timeout): handed to a task process
# as this process sees them now, since the forkserver it forks from may predate them (a notebook that sets AWS_* after
# an earlier build).
_STORE_ENV = ("AWS_", "GOOGLE_", "GCS_", "HF_", "FSSPEC_", "VLMPREP_HTTP_")


def _run_one(args: tuple) -> tuple[int, float, dict]:
    out, plan, cfg, index, upload_to, env = args
    os.environ.update(env)
    t0 = time.perf_counter()
    task = run_task(Path(out), plan, index, cfg=cfg, upload_to=upload_to)
    return index, time.perf_counter() - t0, task.totals


def run_tasks_locally(
    out: Path, plan: Plan, cfg: BuildConfig, renderer: Renderer | None, upload_to: str | None
) -> dict[int, float]:
    """T > 1 on this machine: --workers processes, each running whole tasks (its processor loaded once)."""
    one = BuildConfig.from_plan(plan.config, out=str(out), workers=1, progress=False)
    env = {k: v for k, v in os.environ.items() if k.startswith(_STORE_ENV)}
    jobs = [(str(out), plan, one, i, upload_to, env) for i in range(plan.tasks)]
    seconds: dict[int, float] = {}
    with TaskProgress(cfg, plan.tasks) as tick:
        if cfg.workers == 1:  # in this process, with the processor plan_build already loaded
            for i in range(plan.tasks):
                t0 = time.perf_counter()
                totals = run_task(out, plan, i, cfg=one, renderer=renderer, upload_to=upload_to).totals
                seconds[i] = time.perf_counter() - t0
                tick(totals)
        else:
            with worker_pool(min(cfg.workers, len(jobs))) as pool:
                futures = [pool.submit(_run_one, job) for job in jobs]
                try:
                    for future in as_completed(futures):
                        i, s, totals = future.result()
                        seconds[i] = s
                        tick(totals)
                except BrokenProcessPool as e:
                    left = [i for i in range(plan.tasks) if i not in seconds]
                    raise BuildError(
                        pool_failure(
                            e,
                            f"running tasks {', '.join(map(str, left))} (task {left[0]} "
                            f"starts at {task_start(plan, left[0])})",
                        )
                    ) from None
    return seconds

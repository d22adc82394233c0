"""Ray executor: each task of the plan -> one Ray task (1 CPU) on any node that sees the dataset dir -> task manifest.
Only a task index and the plan travel through Ray; samples go from the worker straight to the shared filesystem.
Imported only for `--executor ray` (`pip install 'vlmprep[ray]'`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from vlmprep.builder.plan import Plan, plan_digest
from vlmprep.builder.progress import TaskProgress
from vlmprep.builder.store import Bucket, pull_plan, scratch_stage
from vlmprep.builder.task import run_task, task_start
from vlmprep.builder.workers import BuildError
from vlmprep.config import BuildConfig
from vlmprep.types import UserError, printable

# A task killed with its worker (node lost, OOM, preemption) is run again; it resumes from its own journal.
MAX_RETRIES = 3


def _run_task_on_worker(
    out: str, plan: Plan, config: dict, index: int, cwd: str, upload_to: str | None = None
) -> tuple[int, float, dict]:
    import torch

    torch.set_num_threads(1)  # one CPU per Ray task, as requested from the scheduler
    if os.path.isdir(cwd):  # relative input paths mean what they meant to the driver (as a Slurm job's submit dir)
        os.chdir(cwd)
    t0 = time.perf_counter()
    if upload_to:  # --out in a store: nothing shared but the bucket; the task runs in a scratch stage of its own
        bucket = Bucket(upload_to)
        have = bucket.names()
        done = bucket.finished_task(have, index, plan_digest(plan))  # before a retry or a resumed build
        if done is not None:
            return index, time.perf_counter() - t0, done.totals
        with scratch_stage(upload_to, index) as stage:
            pull_plan(bucket, stage, have)
            cfg = BuildConfig.from_plan(config, out=str(stage), workers=1, progress=False)
            task = run_task(stage, plan, index, cfg=cfg, upload_to=upload_to)
        return index, time.perf_counter() - t0, task.totals
    cfg = BuildConfig.from_plan(config, out=out, workers=1, progress=False)
    task = run_task(Path(out), plan, index, cfg=cfg)
    return index, time.perf_counter() - t0, task.totals


def _one_line(e: Exception) -> str:
    """A Ray error as one line: the task's own exception when Ray carries it (a user-facing fault says itself), else
    the end of the task's traceback, else the head of Ray's report (worker crashed, out of memory, ...)."""
    import ray

    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        lines = (str(cause) if isinstance(cause, UserError) else f"{type(cause).__name__}: {cause}").splitlines()
    else:
        lines = str(e).splitlines()
        if isinstance(e, ray.exceptions.RayTaskError):
            lines = lines[::-1]
    lines = [line.strip() for line in lines if line.strip()]
    return printable(lines[0] if lines else type(e).__name__)


def run_tasks_on_ray(out: Path, plan: Plan, cfg: BuildConfig, upload_to: str | None = None) -> dict[int, float]:
    """Runs a plan's unfinished tasks as Ray tasks (a new local cluster with --workers CPUs, or the one at
    --ray-address / RAY_ADDRESS) -> each task's wall time. Ray is imported only here; without it, a BuildError says
    how to install it."""
    try:
        import ray
    except ImportError:
        raise BuildError("--executor ray needs Ray: pip install 'vlmprep[ray]'") from None
    started = False
    if not ray.is_initialized():
        address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
        # No address: a new local cluster with --workers CPUs, the same resources `--executor local` would use
        # ("local", since ray.init() alone would join a `ray start` cluster on this machine and refuse num_cpus).
        ray.init(
            address=address or "local",
            num_cpus=None if address else cfg.workers,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        started = True
    try:
        remote = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(_run_task_on_worker)
        out_abs = str(Path(out).resolve())
        plan_ref = ray.put(plan)
        refs = {remote.remote(out_abs, plan_ref, plan.config, i, os.getcwd(), upload_to): i for i in range(plan.tasks)}
        pending = list(refs)
        seconds: dict[int, float] = {}
        with TaskProgress(cfg, plan.tasks) as tick:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    index, s, totals = ray.get(done[0])
                except ray.exceptions.RayError as e:  # a fault inside a task, or its worker lost MAX_RETRIES times
                    i = refs[done[0]]
                    raise BuildError(f"Ray task {i} (from {task_start(plan, i)}) failed: {_one_line(e)}") from None
                seconds[index] = s
                tick(totals)
        return seconds
    finally:
        if started:
            ray.shutdown()

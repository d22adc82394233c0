"""The build, top to bottom in flow order:

    inputs --plan.make_plan--> DIR/plan.json  (T tasks cut by file and line; config; processor fingerprint)
           --executor: local pool | Ray | one `--task-index i` per job--> task.run_task x T
               (records -> normalize -> render + mask -> truncate -> shards of that task; see task.py)
           --merge.merge_tasks--> DIR/manifest.json + rejects.jsonl  (manifest last)
           --checks.check_dataset--> the reject share and turn coverage judged (build-failed.txt on a failure)

--append (append.py) plans the new inputs alone on top of the latest version and, once the merge passed its checks,
commits them as the next version: DIR/versions/v00000N.json created exclusively, then manifest.json.

T = 1 is the single-machine build: one task whose records are spread over --workers processes. The plan never
depends on the executor, so for a fixed T every executor writes the same bytes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from vlmprep.builder.append import (
    NothingToAppend,
    Parent,
    append_ref,
    check_options,
    check_processor,
    commit_local,
    local_parent,
    new_inputs,
    new_names,
    version_record,
)
from vlmprep.builder.checks import RejectsError, check_coverage, check_dataset, check_rejects
from vlmprep.builder.local_executor import run_tasks_locally
from vlmprep.builder.merge import merge_tasks
from vlmprep.builder.out_dir import check_out, clear_attempt, clear_dataset, plan_options
from vlmprep.builder.owner import own_out, share_out
from vlmprep.builder.plan import (
    Plan,
    PlanError,
    config_changes,
    load_plan,
    make_plan,
    plan_digest,
    saved_processor,
    shard_prefix,
    write_plan,
)
from vlmprep.builder.rewrite import remove_replaced
from vlmprep.builder.store import (
    Bucket,
    StoredShards,
    check_bucket,
    is_store,
    pull,
    pull_plan,
    pull_task,
    push_dataset,
    push_plan,
    say,
    scratch_stage,
    stage_for,
)
from vlmprep.builder.store_versions import (
    attempt_in_bucket,
    check_conditional_writes,
    claim_version,
    pull_parent,
    store_parent,
)
from vlmprep.builder.task import run_task
from vlmprep.builder.workers import BuildError, start_worker_server
from vlmprep.config import BuildConfig, default
from vlmprep.ingest import ReadLimits, expand_inputs, stamp
from vlmprep.process import Renderer
from vlmprep.processors.load import load_processor, save_processor
from vlmprep.shards.dataset import (
    PLAN_NAME,
    PROCESSOR_DIR,
    TMP_SUFFIX,
    TaskFiles,
)
from vlmprep.shards.manifest import Manifest, TaskManifest, load_task_manifest
from vlmprep.shards.versions import parse_record, rejects_file
from vlmprep.types import UserError
from vlmprep_schemas.boundary import state_dir
from vlmprep_schemas.versions import version_name

__all__ = [
    "BuildError",
    "BuildResult",
    "RejectsError",
    "build",
    "build_task",
    "check_coverage",
    "check_dataset",
    "check_rejects",
    "merge",
    "plan_build",
]


@dataclass
class BuildResult:
    """What a build returns: the output dir, its manifest (None when only the plan or one task ran), the plan, the
    task manifest of a --task-index run, the reject counts and each task's wall time."""

    out: Path
    manifest: Manifest | None  # None when only the plan or one task ran
    plan: Plan | None = None
    task: TaskManifest | None = None  # the task manifest of a --task-index run
    rejects: collections.Counter = field(default_factory=collections.Counter)
    task_seconds: dict[int, float] = field(default_factory=dict)  # wall time of each task this run executed
    added: Manifest | None = None  # --append: the new version's own inputs, shards and totals (manifest: the record)


def plan_build(
    cfg: BuildConfig, *, fresh: bool, parent: Parent | None = None, replace: bool = False
) -> tuple[Plan, Renderer | None]:
    """Make DIR/plan.json (and DIR/processor) for cfg, or reuse the one there. fresh=True (a whole build) replaces a
    plan made with other options only with --overwrite (check_out), clearing its outputs; fresh=False (one task of
    many) refuses it, since other tasks may be using it. Returns the plan and, when the processor was loaded here, a
    Renderer over it. Nothing is created in --out before the inputs, processor and options proved good. With
    --append the plan covers the inputs not in the dataset yet, on top of `parent` (the latest version; for a
    local --out read here, builder/append.py), with the dataset's own options and processor; `replace` (a watcher's
    --on-change rebuild): an input built before that changed since is planned again, its old samples replaced."""
    out = Path(cfg.out)
    if fresh:
        check_out(cfg, out)
    files = expand_inputs(cfg.inputs)
    append = None
    if cfg.append:
        parent = parent or local_parent(out, say)
        check_options(cfg, parent, out)
        files = new_inputs(files, parent, out, say, replaced := [] if replace else None)
        append = append_ref(parent, replaced)
    try:
        old = load_plan(out)
    except PlanError:
        if not fresh:
            raise
        old = None
    if old is not None and append is not None and old.version <= append.parent:
        old = None  # the plan of a version committed already: done with
    asked = {
        "config": cfg.to_json(),
        "tasks": cfg.tasks,
        "inputs": [(str(f), st["bytes"], st["mtime_ns"], st.get("etag")) for f, st in ((f, stamp(f)) for f in files)],
    }
    if old is not None and not fresh:
        if plan_options(old) != asked or old.append != append:  # a task never re-plans over one others run from
            differ = config_changes(asked["config"], old.config)
            why = (
                f"options {', '.join(differ)} differ"
                if differ
                else "--tasks differs"
                if asked["tasks"] != old.tasks
                else "the inputs changed"
                if plan_options(old) != asked
                else "it appends to another version"
            )
            raise PlanError(
                f"{out / PLAN_NAME} was made for another build ({why}); run the task with the plan's "
                f"options (or just `--out {out} --task-index N`), or plan into a fresh --out dir"
            )
        return old, None
    if cfg.executor == "local" and cfg.tasks > 1:  # a single task's workers fork from this process instead
        start_worker_server(cfg.workers)  # task processes' imports overlap the processor load and the input scan
    processor = load_processor(cfg.processor)
    renderer = Renderer(cfg, processor)  # fail fast on an unsupported processor or policy, before any task starts
    state_dir(out)
    if fresh:  # a whole build owns the dir: drop processor copies a killed earlier run left half-saved
        for p in list(out.glob(f"{PROCESSOR_DIR}.*{TMP_SUFFIX}")) + list(out.glob(f"{PROCESSOR_DIR}.*.old")):
            shutil.rmtree(p, ignore_errors=True)
    expect = parent.manifest.processor.fingerprint if append is not None else None
    fingerprint = save_processor(processor, out / PROCESSOR_DIR, expect=expect)
    if append is not None:
        check_processor(fingerprint, parent, cfg.processor, out)
    plan = make_plan(
        config=cfg.to_json(),
        files=files,
        tasks=cfg.tasks,
        limits=ReadLimits.of(cfg),
        processor=saved_processor(cfg.processor, processor, fingerprint),
        append=append,
        names=new_names(files, parent) if append is not None else None,
    )
    if plan != old:
        if append is not None:
            clear_attempt(out, plan.version, keep_tasks=0 if fresh else plan.tasks)
        elif old is not None or fresh:
            clear_dataset(out)
        write_plan(out, plan)
    return plan, renderer


def build_task(
    out: Path,
    index: int,
    *,
    workers: int = default("workers"),
    progress: bool = default("progress"),
    cfg: BuildConfig | None = None,
) -> BuildResult:
    """`vlmprep build --out DIR --task-index i`: one task of DIR/plan.json, anywhere DIR is visible. With cfg (the
    build options given again) a missing plan is made first, identical to the one any other task would make."""
    if is_store(str(out)):
        return _task_in_store(str(out).rstrip("/"), index, workers=workers, progress=progress, cfg=cfg)
    out = Path(out)
    if cfg is not None:
        state_dir(out)  # every task of a new --out makes it: the same dir
    with share_out(out) if out.is_dir() else contextlib.nullcontext():
        return _build_task_shared(out, index, workers=workers, progress=progress, cfg=cfg)


def _task_in_store(url: str, index: int, *, workers: int, progress: bool, cfg: BuildConfig | None) -> BuildResult:
    """--task-index with --out in a store, on any machine (no shared filesystem): the plan and processor fetched into
    a scratch stage of the task's own (or, with the build options, the plan made there and uploaded, identical to
    the one any other task makes), the task run there, its files uploaded as they land; nothing left behind."""
    bucket = Bucket(url)
    have = bucket.names()
    with scratch_stage(url, index) as stage:
        try:
            parent = _store_parent(bucket) if cfg is not None and cfg.append else None
            ours = parent is None or attempt_in_bucket(bucket, have, parent)  # not the plan of an earlier version
            if not (ours and pull_plan(bucket, stage, have)) and cfg is not None:
                plan_build(dataclasses.replace(cfg, out=str(stage)), fresh=False, parent=parent)
                if parent is not None:
                    claim_version(bucket, load_plan(stage))
                push_plan(bucket, stage)
            plan = load_plan(stage)
            done = bucket.finished_task(have, index, plan_digest(plan)) if plan is not None else None
            if done is not None:  # a rerun of a finished array job: nothing to do
                return BuildResult(
                    out=url, manifest=None, plan=plan, task=done, rejects=collections.Counter(done.rejects)
                )
            result = _build_task_shared(stage, index, workers=workers, progress=progress, cfg=None, upload_to=url)
        except UserError as e:
            e.args = (str(e).replace(str(stage), url),)
            raise
    return dataclasses.replace(result, out=url)


def _build_task_shared(
    out: Path, index: int, *, workers: int, progress: bool, cfg: BuildConfig | None, upload_to: str | None = None
) -> BuildResult:
    """build_task() under --out's shared lock: any number of tasks at once, never beside a whole build or a merge."""
    if cfg is not None:
        plan, _ = plan_build(cfg, fresh=False)
    else:
        plan = load_plan(out)
        if plan is None:
            raise PlanError(
                f"{out / PLAN_NAME}: no plan; make one with `vlmprep build --in ... --out {out} --tasks T "
                "--plan-only`, or pass the build options with --task-index"
            )
    if not 0 <= index < plan.tasks:
        raise PlanError(f"--task-index {index}: the plan in {out} has tasks 0..{plan.tasks - 1}")
    run = BuildConfig.from_plan(plan.config, out=str(out), workers=workers, progress=progress)
    t0 = time.perf_counter()
    task = run_task(out, plan, index, cfg=run, upload_to=upload_to)
    return BuildResult(
        out=out,
        manifest=None,
        plan=plan,
        task=task,
        rejects=collections.Counter(task.rejects),
        task_seconds={index: time.perf_counter() - t0},
    )


def build(cfg: BuildConfig, *, replace: bool = False) -> BuildResult:
    """A checked BuildConfig -> the dataset in cfg.out (shards, manifest.json, rejects.jsonl, the processor), and a
    BuildResult with the manifest and the reject counts. Chains the whole build under --out's lock: plan (inputs cut
    into tasks, plan.json), the tasks (one in this process's worker pool, several over the pool or Ray, or only
    `--task-index i`), then the merge and the dataset checks (--max-reject-fraction, --min-turn-coverage). A bad
    option or input is a one-line BuildError; a bad record is a counted reject, never a stop. Trade-off: each
    completed shard is journaled, so a killed build resumes where it stopped at the cost of an fsync per shard; the
    output is byte-identical for the same inputs, config and task count, whatever the worker count or executor
    (`replace`: a watcher's --on-change rebuild, a changed input's samples replaced)."""
    try:
        if cfg.task_index is not None:
            return build_task(cfg.out, cfg.task_index, workers=cfg.workers, progress=cfg.progress, cfg=cfg)
        if is_store(cfg.out):
            return _build_to_store(cfg, replace)
        return _build_local(cfg, replace=replace)
    except NothingToAppend as e:  # every input is in the dataset: it stays as it is, and that is no error
        say(str(e))
        return BuildResult(out=cfg.out, manifest=e.manifest)


def _build_local(
    cfg: BuildConfig, upload_to: str | None = None, parent: Parent | None = None, replace: bool = False
) -> BuildResult:
    """build() into a local dir: the --out dir, or the stage of an --out in a store (upload_to, its URL; `parent`:
    the version an append builds on, as the bucket holds it; `replace`: build())."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise BuildError(f"--out {out} is a file: pass a directory")
    top = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the first dir made here
    state_dir(out)  # the lock lives inside --out: a second build into a new dir refuses too (a link there: refused)
    with own_out(out):
        try:
            plan, renderer = plan_build(cfg, fresh=True, parent=parent, replace=replace)
        except BaseException:
            if top is not None and not (out / PLAN_NAME).exists():  # a failed start leaves no half-made dir
                shutil.rmtree(top, ignore_errors=True)
            raise
        if upload_to:
            if plan.append is not None:  # before any shard of it goes up: two machines would write the same names
                claim_version(Bucket(upload_to), plan)
            push_plan(Bucket(upload_to), out)
        return _build_planned(cfg, out, plan, renderer, upload_to)


def _build_to_store(cfg: BuildConfig, replace: bool = False) -> BuildResult:
    """build() with --out in a store (builder/store.py): in this machine's stage of the URL (fetched back from the
    bucket where the stage is gone), every file uploaded as it lands; the stage removed once the manifest is up.
    Messages name the URL, not the stage."""
    url = cfg.out.rstrip("/")
    bucket, stage = Bucket(url), stage_for(url)
    have = check_bucket(bucket, overwrite=cfg.overwrite)
    try:
        parent = _store_parent(bucket) if cfg.append else None
        resumable = parent is None or attempt_in_bucket(bucket, have, parent)  # an append's own unfinished build
        if not (stage / PLAN_NAME).is_file() and PLAN_NAME in have and resumable:
            say(f"resuming from {url}: fetching its plan and finished tasks into {stage}")
            state_dir(stage)
            pull(bucket, stage, have)
        result = _build_local(dataclasses.replace(cfg, out=str(stage)), upload_to=url, parent=parent, replace=replace)
    except UserError as e:
        e.args = (str(e).replace(str(stage), url),)
        if isinstance(e, RejectsError):  # complete, and uploaded: the stage has done its job
            shutil.rmtree(stage, ignore_errors=True)
        raise
    if result.manifest is not None:
        shutil.rmtree(stage, ignore_errors=True)
    return dataclasses.replace(result, out=url)


def _store_parent(bucket: Bucket) -> Parent:
    """The version an append into a store builds on, once the store proved its creates exclusive."""
    check_conditional_writes(bucket)
    return store_parent(bucket, say)


def _build_planned(
    cfg: BuildConfig, out: Path, plan: Plan, renderer: Renderer | None, upload_to: str | None = None
) -> BuildResult:
    """The rest of build() once the plan is made, under --out's lock: the tasks, then the merge."""
    if cfg.plan_only:
        return BuildResult(out=out, manifest=None, plan=plan)
    if cfg.executor == "ray":
        from vlmprep.builder.ray_executor import run_tasks_on_ray  # ray is imported only when chosen

        seconds = run_tasks_on_ray(out, plan, cfg, upload_to=upload_to)
    elif plan.tasks == 1:  # the records of the one task spread over --workers processes
        t0 = time.perf_counter()
        run_task(out, plan, 0, cfg=cfg, renderer=renderer, upload_to=upload_to)
        seconds = {0: time.perf_counter() - t0}
    else:
        seconds = run_tasks_locally(out, plan, cfg, renderer, upload_to)
    manifest, added = _merge_and_check(
        out,
        upload_to,
        allow_empty=cfg.allow_empty,
        max_reject_fraction=cfg.max_reject_fraction,
        min_turn_coverage=cfg.min_turn_coverage,
    )
    rejects = collections.Counter((added or manifest).rejects)
    return BuildResult(out=out, manifest=manifest, plan=plan, rejects=rejects, task_seconds=seconds, added=added)


def _merge_and_check(out: Path, upload_to: str | None, **checks) -> tuple[Manifest, Manifest | None]:
    """merge_tasks and check_dataset; for a store's --out the dataset is uploaded either way (a dataset that failed
    its checks is complete, with its build-failed.txt), manifest.json last. An append's version is committed once it
    passed its checks (one that failed is not: its fix line, run, commits it). -> (the dataset's manifest, an
    append's own manifest of the new inputs or None)."""
    plan = load_plan(out)
    stored = None
    if upload_to and plan is not None:
        bucket = Bucket(upload_to)
        have = bucket.names()
        for i in range(plan.tasks):  # tasks that ran elsewhere (Ray workers, --task-index): their lists fetched back
            if load_task_manifest(TaskFiles(out, i, shard_prefix(plan, i))) is None:
                pull_task(bucket, out, have, i)
        if plan.append is not None:
            pull_parent(bucket, out, have, plan)
        stored = StoredShards(bucket, have)
    removal = remove_replaced(out, plan, stored) if plan is not None else None
    manifest = merge_tasks(out, stored, removal.ids if removal is not None else None)
    record = None
    try:
        try:
            check_dataset(manifest, out, **checks, rejects_file=rejects_file(plan.version if plan else 1))
        except RejectsError as e:
            e.version = plan.version if plan is not None and plan.append is not None else None  # for its summary
            raise
        if plan is not None and plan.append is not None:
            record = version_record(out, plan, manifest, removal)
            if not upload_to:
                return commit_local(out, plan.version, record), manifest
    finally:
        if upload_to and plan is not None:
            tasks = [load_task_manifest(TaskFiles(out, i, shard_prefix(plan, i))) for i in range(plan.tasks)]
            commit = None if plan.append is None else (plan.version, record)
            push_dataset(Bucket(upload_to), out, manifest, tasks, version=commit)
    if record is not None:
        return parse_record(record, f"{upload_to}/{version_name(plan.version)}"), manifest
    return manifest, None


def merge(
    out: str | Path,
    *,
    allow_empty: bool = default("allow_empty"),
    max_reject_fraction: float = default("max_reject_fraction"),
    min_turn_coverage: float = default("min_turn_coverage"),
) -> Manifest:
    """`vlmprep merge DIR` (or URL): merge_tasks and check_dataset with DIR this process's alone, so no task or build
    writes there meanwhile; a URL's finished tasks are fetched into its stage, merged there and uploaded."""
    checks = {
        "allow_empty": allow_empty,
        "max_reject_fraction": max_reject_fraction,
        "min_turn_coverage": min_turn_coverage,
    }
    if is_store(str(out)):
        url = str(out).rstrip("/")
        stage = state_dir(stage_for(url))
        with own_out(stage):
            if not pull_plan(Bucket(url), stage, Bucket(url).names()):
                raise PlanError(
                    f"{url}/{PLAN_NAME}: no plan; make one with `vlmprep build --in ... --out {url} "
                    "--tasks T --plan-only`"
                )
            try:
                manifest, _ = _merge_and_check(stage, url, **checks)
            except UserError as e:
                e.args = (str(e).replace(str(stage), url),)
                raise
        shutil.rmtree(stage, ignore_errors=True)
        return manifest
    out = Path(out)
    with own_out(out) if out.is_dir() else contextlib.nullcontext():
        return _merge_and_check(out, None, **checks)[0]

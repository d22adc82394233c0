"""One task of a build plan, top to bottom in flow order:

    plan cut --task_records--> RawRecord --process.Renderer (in workers.py's pool)--> ShardSample | reject
             --ShardWriter--> shard-*.tar  (+ tasks/task-NNNNN.rejects.jsonl, .samples.jsonl, task manifest last)

Records are processed by N worker processes but written strictly in input order, so the output is
byte-identical whatever N is. Every bad record becomes a counted reject, never a crash.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from vlmprep.builder.journal import DONE, Journal, landed_ids, load_journal, save_journal
from vlmprep.builder.owner import own_task
from vlmprep.builder.plan import Plan, check_inputs_unchanged, plan_digest, shard_prefix, task_records
from vlmprep.builder.progress import record_progress
from vlmprep.builder.store import Uploader
from vlmprep.builder.totals import (
    SAMPLE_FIELDS,
    count_reject,
    count_sample,
    duplicate_reject,
    duplicate_turns,
    input_totals,
)
from vlmprep.builder.workers import BuildError, cached_renderer, ordered_results, record_workers
from vlmprep.config import BuildConfig
from vlmprep.ingest import ReadLimits
from vlmprep.process import Renderer
from vlmprep.shards.dataset import TASKS_DIR, TMP_SUFFIX, TaskFiles, task_file, write_json_atomic
from vlmprep.shards.format import index_name
from vlmprep.shards.manifest import TaskManifest, load_task_manifest
from vlmprep.shards.versions import id_keys
from vlmprep.shards.writer import ShardInfo, ShardWriter
from vlmprep.types import RawRecord
from vlmprep_schemas.boundary import open_no_follow, state_dir


def task_start(plan: Plan, index: int) -> str:
    """Where task `index` of the plan starts reading: FILE:LINE, for messages."""
    cut = plan.cuts[index]
    if cut.file >= len(plan.inputs):
        return "the end of the input"
    return f"{plan.inputs[cut.file].path}:{cut.seek.line + 1}"


def _start_or_resume(files: TaskFiles, identity: dict, span: tuple[int, int], uploader: Uploader | None) -> Journal:
    """Resume this task's matching interrupted run, or clear every trace of an older one and start fresh. For an
    --out in a store, a journaled shard that left the stage is checked in the bucket, and not sent again."""
    partials = {files.partial_rejects: files.rejects, files.partial_samples: files.samples}
    stored = uploader.bucket.sizes if uploader is not None else None
    journal = load_journal(files.out, files.journal, partials, identity, span, stored)
    if journal is not None and uploader is not None:
        uploader.sent.update(s["name"] for s in journal.shards if not (files.out / s["name"]).exists())
    stale = [p for p in files.out.glob(f"{files.prefix}*.tar{TMP_SUFFIX}")]
    if journal is None:
        journal = Journal(identity=identity, samples_bytes=0)
        stale += files.shards() + [*partials, *partials.values(), files.journal]
    else:
        done = {s["name"] for s in journal.shards}
        stale += [p for p in files.shards() if p.name not in done]
    stale += [p.with_name(index_name(p.name)) for p in stale if p.name.endswith(".tar")]  # their sample indexes
    for p in stale:
        if p.exists():
            p.unlink()
    for path, size in ((files.partial_rejects, journal.rejects_bytes), (files.partial_samples, journal.samples_bytes)):
        with open_no_follow(path, "a+b") as f:  # drop what was written after the last durable point
            f.truncate(size)
    return journal


def _clean_up(files: TaskFiles) -> None:
    """What a finished task leaves no longer: its journal, partial rejects and temp files."""
    for p in [files.journal, files.partial_rejects, files.partial_samples] + list(
        files.out.glob(task_file(files.index, f".*{TMP_SUFFIX}"))
    ):
        p.unlink(missing_ok=True)


@dataclass
class _TaskState:
    """What a running task has written so far; a checkpoint makes it durable in the journal."""

    files: TaskFiles
    journal: Journal
    writer: ShardWriter
    rejects: collections.Counter
    totals: collections.Counter
    seen_ids: set[str]
    input_starts: list[int]  # the plan's first position of each input file
    inputs: dict[int, collections.Counter]  # input file index -> its share of the totals

    def checkpoint(self, rej: IO[str], rows: IO[str], next_position: int) -> None:
        for f in (rej, rows):
            f.flush()
            os.fsync(f.fileno())
        self.journal.shards = [s.to_json() for s in self.writer.shards]
        self.journal.next_position = next_position
        self.journal.rejects_bytes = rej.tell()
        self.journal.samples_bytes = rows.tell()
        self.journal.totals = dict(self.totals)
        self.journal.rejects = dict(self.rejects)
        self.journal.inputs = {str(i): dict(c) for i, c in sorted(self.inputs.items())}
        save_journal(self.files.journal, self.journal)

    def land(self, position: int, outcomes: list, turns: dict, rej: IO[str], rows: IO[str], *, strict: bool) -> bool:
        """Write one record's samples (and their rows: id, shard, counts; the first also the record's turns, which
        merge needs to reject it as a duplicate) and rejects and count them, in the totals and in its input file's;
        True when a shard closed inside it."""
        completed = False
        landed = [payload.meta for status, payload in outcomes if status == "ok"]
        if any(key in self.seen_ids for meta in landed for key in id_keys(meta)):
            # A record whose id an earlier record used (split into step samples or not: id_keys) is rejected once,
            # whole: none of its samples land, its other rejects (lost turns) are not written, and its turns count
            # as lost with it.
            outcomes, turns = [("reject", duplicate_reject(landed[0]))], duplicate_turns(turns)
        counts = collections.Counter(records=1, **turns)
        for status, payload in outcomes:
            if status == "ok":
                self.seen_ids.update(id_keys(payload.meta))
                count_sample(counts, payload.meta)
                row = {
                    "shard": self.writer.shard_name,
                    **{k: payload.meta[k] for k in SAMPLE_FIELDS if k in payload.meta},
                }
                if payload.meta is landed[0]:
                    row["turns"] = {k: v for k, v in sorted(turns.items()) if v}
                rows.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
                completed |= self.writer.write(payload)
            else:
                self.rejects[payload["reason"]] += 1
                count_reject(counts, payload)
                counts["unread_bytes"] += payload.get("unread_bytes", 0)
                rej.write(json.dumps(payload, ensure_ascii=False, sort_keys=True) + "\n")
                if strict:
                    raise BuildError(
                        f"--strict: {payload['source']['file']}:{payload['source']['line']}: "
                        f"{payload['reason']}: {payload['message']}"
                    )
        self.totals.update(counts)
        self.inputs[bisect.bisect_right(self.input_starts, position) - 1].update(counts)
        return completed


def _resume_state(files: TaskFiles, journal: Journal, cfg: BuildConfig, plan: Plan) -> _TaskState:
    writer = ShardWriter(
        files.out,
        samples_per_shard=cfg.samples_per_shard,
        shard_size_bytes=int(cfg.shard_size_mb * 1024 * 1024),
        prefix=files.prefix,
        done=[ShardInfo(**s) for s in journal.shards],
    )
    inputs: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    inputs.update((int(i), collections.Counter(c)) for i, c in journal.inputs.items())
    return _TaskState(
        files=files,
        journal=journal,
        writer=writer,
        rejects=collections.Counter(journal.rejects),
        totals=collections.Counter(journal.totals),
        seen_ids=landed_ids(files.partial_samples),
        input_starts=[inp.first_position for inp in plan.inputs],
        inputs=inputs,
    )


def _task_records(plan: Plan, index: int, cfg: BuildConfig, journal: Journal) -> Iterator[RawRecord]:
    """The task's records the journal has not yet made durable."""
    cut = plan.cuts[index]
    return (
        r
        for r in task_records(plan, index, limits=ReadLimits.of(cfg))
        if r.position >= max(journal.next_position, cut.position)
    )


def _write_records(
    state: _TaskState,
    records: Iterator[RawRecord],
    n: int,
    *,
    cfg: BuildConfig,
    renderer: Renderer,
    uploader: Uploader | None,
) -> None:
    """Records -> shards and partial rejects, checkpointing the journal whenever a shard closes (and then, for an
    --out in a store, uploading the shard)."""
    totals = state.totals
    t0 = time.monotonic()
    # The workers fork first: before the progress bar's thread starts (record_workers).
    with (
        record_workers(cfg, renderer) as pool,
        open_no_follow(state.files.partial_rejects, "a", encoding="utf-8") as rej,
        open_no_follow(state.files.partial_samples, "a", encoding="utf-8") as rows,
        record_progress(cfg) as progress,
    ):
        bar = progress.add_task(
            "build",
            total=n,
            rate=0.0,
            samples=totals["samples"],
            rejects=totals["rejected"],
            completed=totals["records"],
        )
        for pos, (outcomes, turns) in ordered_results(cfg, records, renderer, pool):
            if state.land(pos, outcomes, turns, rej, rows, strict=cfg.strict):
                # a shard closed inside this record: the journal's durable point is the record's end
                state.writer.finish_shard()
                state.checkpoint(rej, rows, pos + 1)
                if uploader is not None:
                    uploader.shards(state.writer.shards)
            elapsed = max(time.monotonic() - t0, 1e-9)
            progress.update(
                bar, advance=1, rate=totals["records"] / elapsed, samples=totals["samples"], rejects=totals["rejected"]
            )
        state.writer.close()
        state.checkpoint(rej, rows, DONE)  # all consumed: a kill from here on resumes straight to the task manifest


def _finish_task(state: _TaskState, plan: Plan, digest: str) -> TaskManifest:
    """The sample list, the final rejects name, then the task manifest (last); returns the manifest."""
    files, writer, totals = state.files, state.writer, state.totals
    # Every landed sample's id, shard and counts, in order, written as it landed: merge finds ids repeated across
    # tasks (and what removing one changes) without reading shards.
    os.replace(files.partial_samples, files.samples)
    os.replace(files.partial_rejects, files.rejects)
    cut = plan.cuts[files.index]
    manifest = TaskManifest(
        plan=digest,
        task=files.index,
        config=plan.config,
        fingerprint=plan.processor.fingerprint,
        records={"first_position": cut.position, "count": cut.records},
        shards=tuple(s.entry() for s in writer.shards),
        totals=input_totals(totals, zeros=True),
        inputs={str(i): input_totals(c) for i, c in sorted(state.inputs.items())},
        rejects=dict(sorted(state.rejects.items())),
    )
    write_json_atomic(files.manifest, manifest.to_json())
    files.journal.unlink()
    return manifest


def run_task(
    out: Path,
    plan: Plan,
    index: int,
    *,
    cfg: BuildConfig,
    renderer: Renderer | None = None,
    processor_dir: Path | None = None,
    upload_to: str | None = None,
) -> TaskManifest:
    """One task of the plan: its records -> its shards (final names), tasks/task-NNNNN.rejects.jsonl and .samples.jsonl,
    then the task manifest, last and atomically. A task whose manifest exists is skipped; a killed one resumes
    from its journal and ends byte-identical. upload_to: the --out URL the task's files go to as they land (out is
    then the local stage). Returns the task manifest."""
    out = Path(out)
    state_dir(out / TASKS_DIR)
    with own_task(out, index):  # one run of a task at a time, whatever executor started it
        uploader = Uploader(upload_to, out, drop_shards=True) if upload_to else None
        try:
            return _run_owned_task(
                out, plan, index, cfg=cfg, renderer=renderer, processor_dir=processor_dir, uploader=uploader
            )
        finally:
            if uploader is not None:
                with contextlib.suppress(Exception):  # the task's own error, if any, is the one to raise
                    uploader.close()


def _run_owned_task(
    out: Path,
    plan: Plan,
    index: int,
    *,
    cfg: BuildConfig,
    renderer: Renderer | None,
    processor_dir: Path | None,
    uploader: Uploader | None,
) -> TaskManifest:
    digest = plan_digest(plan)
    files = TaskFiles(out, index, shard_prefix(plan, index))
    done = load_task_manifest(files)
    if done is not None and done.plan == digest:
        _clean_up(files)  # killed between its manifest and its clean-up: only the clean-up is left to do
        if uploader is not None:  # killed before its files were all up: those missing in the bucket go now
            uploader.task_done(files, done)
        return done
    check_inputs_unchanged(plan)
    processor_dir = Path(processor_dir or out / plan.processor.dir)
    if renderer is None:
        renderer = cached_renderer(cfg, processor_dir)
    cut = plan.cuts[index]
    journal = _start_or_resume(files, {"plan": digest, "task": index}, (cut.position, cut.records), uploader)
    state = _resume_state(files, journal, cfg, plan)
    _write_records(
        state,
        _task_records(plan, index, cfg, journal),
        plan.cuts[index].records,
        cfg=cfg,
        renderer=renderer,
        uploader=uploader,
    )
    manifest = _finish_task(state, plan, digest)
    if uploader is not None:
        uploader.task_done(files, manifest)
    return manifest

"""Merge: the plan's finished tasks (tasks/task-NNNNN.json, their shards, rejects and sample lists) -> one
DIR/manifest.json and DIR/rejects.jsonl in plan order. Refuses a dir it cannot vouch for: a missing task, a task of
another plan or processor, a task manifest that is not its own task's, files no task of this plan wrote, a listed
shard missing or changed (size, sha256): the manifest never names a missing, changed or duplicated shard. Ids
repeated across tasks (no task can see another's ids) are rejected here as the one-task build rejects them, by
rewriting the few shards that hold them; each is checked against the sha256 its task manifest lists before it is read,
and tasks/merge.rewrites.json records what each rewrite made of it (a merge run again, here or from the bucket,
accepts exactly that, never a shard that merely holds the same ids).
"""

from __future__ import annotations

import collections
import fnmatch
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlmprep.builder.append import dataset_index, earlier_ids
from vlmprep.builder.plan import Plan, PlanError, config_changes, load_plan, plan_digest, shard_prefix
from vlmprep.builder.store import StoredShards
from vlmprep.builder.totals import (
    count_reject,
    count_sample,
    duplicate_reject,
    duplicate_turns,
    input_totals,
)
from vlmprep.clients.energon_meta import write_energon_meta
from vlmprep.processors.load import fingerprint_dir
from vlmprep.shards.dataset import (
    MANIFEST_NAME,
    PLAN_NAME,
    SHARD_GLOB,
    TASK_SUFFIXES,
    TASKS_DIR,
    TMP_SUFFIX,
    TaskFiles,
    sha256_file,
    task_file,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from vlmprep.shards.format import DATASET_INDEX_NAME, FORMAT_VERSION, index_name
from vlmprep.shards.manifest import (
    InputEntry,
    Manifest,
    PlanRef,
    ShardEntry,
    TaskManifest,
    load_task_manifest,
)
from vlmprep.shards.reader import iter_shard
from vlmprep.shards.summary import turn_coverage
from vlmprep.shards.versions import (
    id_digest,
    id_keys,
    ids_bytes,
    rejects_file,
    rewrite_prefix,
    seen_before,
    shard_version,
    versions_dir,
)
from vlmprep.shards.writer import ShardWriter, copied
from vlmprep_schemas.boundary import read_state, state_dir
from vlmprep_schemas.versions import ids_name

REWRITES_NAME = f"{TASKS_DIR}/merge.rewrites.json"  # shard -> [sha256 its task listed, sha256 the merge made of it]
_SCRATCH = f"{TASKS_DIR}/merge.tmp"  # where a rewrite is made and hashed before it replaces the shard
LIST_BYTES = 1 << 40  # a task's sample and reject lists: read whole as before; a FIFO or link there is refused


class MergeError(PlanError):
    """The dataset dir cannot be merged as it is: one clear line naming the task or file and the fix."""


def _load_rewrites(out: Path) -> dict[str, list[str]]:
    """tasks/merge.rewrites.json as far as it is well formed ({} where it is missing or not)."""
    try:
        got = json.loads(read_state(out / REWRITES_NAME))
    except (OSError, ValueError):  # UnsafeWrite (a link or FIFO planted there) is an OSError: checked by hashing
        return {}
    if not isinstance(got, dict):
        return {}
    return {k: v for k, v in got.items() if isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)}


def _task_manifests(out: Path, plan: Plan) -> list[TaskManifest]:
    digest = plan_digest(plan)
    missing, foreign, manifests = [], [], []
    for i in range(plan.tasks):
        m = load_task_manifest(TaskFiles(out, i, shard_prefix(plan, i)))
        if m is None:
            missing.append(i)
        elif m.plan != digest:
            changed = config_changes(m.config, plan.config)
            why = (
                f"another config ({', '.join(changed)} differ)"
                if changed
                else "another processor"
                if m.fingerprint != plan.processor.fingerprint
                else "another plan"
            )
            foreign.append(f"task {i} was built with {why}")
        manifests.append(m)
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise MergeError(
            f"{out}: {len(missing)} of {plan.tasks} tasks have not finished (no "
            f"{task_file(missing[0], '.json')}): tasks {shown}; run `vlmprep build --out {out} "
            f"--task-index {missing[0]}` for each, then merge again"
        )
    if foreign:
        raise MergeError(
            f"{out}: {'; '.join(foreign[:5])} than {PLAN_NAME}; remove such a task's files "
            f"({task_file(0, '.*')} and its shards, e.g. for task 0) and run it again with this plan"
        )
    return manifests


def _check_strays(out: Path, plan: Plan, manifests: list[TaskManifest]) -> None:
    claimed = {s.name for m in manifests for s in m.shards}
    # Only what a vlmprep build writes: shards and their temp files (other files, e.g. energon's *.tar.idx or the
    # user's own tars beside an --overwrite build, are not dataset content and are left alone), of the version this
    # plan builds (an append's dir holds every earlier version's shards).
    stray = sorted(
        p.name
        for p in out.iterdir()
        if shard_version(p.name) == plan.version
        and not p.name.startswith(rewrite_prefix(plan.version))  # the rewrites of a rebuild (builder/rewrite.py)
        and (
            fnmatch.fnmatch(p.name, SHARD_GLOB)
            and p.name not in claimed
            or fnmatch.fnmatch(p.name, SHARD_GLOB + TMP_SUFFIX)
        )
    )
    ours = {
        task_file(i, suffix).split("/", 1)[1] for i in range(plan.tasks) for suffix in TASK_SUFFIXES + (".lock",)
    } | {Path(REWRITES_NAME).name, Path(_SCRATCH).name}  # a task run's lock, left by a killed one; a merge's own
    stray += sorted(f"{TASKS_DIR}/{p.name}" for p in (out / TASKS_DIR).iterdir() if p.name not in ours)
    if stray:
        shown = ", ".join(stray[:8]) + (f" and {len(stray) - 8} more" if len(stray) > 8 else "")
        raise MergeError(
            f"{out}: files that no task of this plan wrote: {shown}; they are left from another "
            "plan or build: remove them, or build into a fresh --out dir"
        )


def _filter_shard(out: Path, entry: ShardEntry, drop: set[str], prefix: str, rewrites: dict) -> ShardEntry | None:
    """Rewrite one shard without the samples whose ids `drop` names (None: nothing left, file removed): made in the
    scratch dir, hashed and recorded in `rewrites` (and its file) before it replaces the shard, so a merge run again
    after a crash (the writer is deterministic, filtering twice changes nothing) knows it and ends the same."""
    name = entry.name
    path = out / name
    if not path.exists():  # emptied by an earlier run of this merge
        return None
    scratch = out / _SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    writer = ShardWriter(scratch, samples_per_shard=1 << 62, shard_size_bytes=1 << 62, prefix=prefix)
    writer.index = int(name[len(prefix) : -len(".tar")])
    for s in iter_shard(path, version=FORMAT_VERSION):
        meta = s.meta()
        if meta["id"] not in drop:
            writer.write(copied(s, meta))
    writer.close()
    if not writer.shards:
        path.unlink()
        path.with_name(index_name(name)).unlink(missing_ok=True)
        return None
    made = writer.shards[0].entry()
    rewrites[name] = [entry.sha256, made.sha256]
    write_json_atomic(out / REWRITES_NAME, dict(sorted(rewrites.items())))
    for n in [name] + ([made.index.name] if made.index else []):
        os.replace(scratch / n, out / n)
    return made


def _rerun(out: Path, i: int) -> str:
    """How to make task i's output whole again: its manifest gone, a run clears and rewrites all the task wrote."""
    return (
        f"remove {out / task_file(i, '.json')} and run the task again (`vlmprep build --out {out} --task-index "
        f"{i}`, then `vlmprep merge {out}`)"
    )


def _check_claims(out: Path, plan: Plan, manifests: list[TaskManifest]) -> None:
    """Each task manifest is its own task's and names shards of its own once: a copy of another task's manifest
    would list that task's shards twice in the dataset."""
    owner: dict[str, int] = {}
    for i, m in enumerate(manifests):
        prefix = shard_prefix(plan, i)
        if m.task != i:
            raise MergeError(
                f"{out / task_file(i, '.json')} is the manifest of task {m.task!r}, not of task "
                f"{i} (copied or moved there?): {_rerun(out, i)}"
            )
        for s in m.shards:
            name = s.name
            if not name.startswith(prefix) or "/" in name or not fnmatch.fnmatch(name, SHARD_GLOB):
                raise MergeError(
                    f"{out / task_file(i, '.json')} lists {name!r}, not a shard of task {i} (its shards "
                    f"are {prefix}NNNNNN.tar): {_rerun(out, i)}"
                )
            if name in owner:
                raise MergeError(f"{out / task_file(i, '.json')} lists {name} twice: {_rerun(out, i)}")
            owner[name] = i


def _index_problem(out: Path, s: ShardEntry, listed: str) -> str | None:
    """The shard's sample index sidecar, where its task manifest lists one, as listed (size, sha256)."""
    ix = s.index
    if ix is None:
        return None
    path = out / ix.name
    if not path.is_file():
        return f"its sample index {ix.name} is listed in {listed} but missing"
    digest = sha256_file(path)
    if path.stat().st_size != ix.bytes or digest != ix.sha256:
        return f"its sample index {ix.name} has sha256 {digest[:16]}..., but {listed} lists {ix.sha256[:16]}..."
    return None


def _verify_shards(
    out: Path,
    manifests: list[TaskManifest],
    rewritten: dict[str, list[str]],
    stored: StoredShards | None,
    rewrites: dict[str, list[str]],
) -> None:
    """Every listed shard exists with the size and sha256 its task manifest gives, or refuse naming the task file.
    `rewritten`: the shards merge rewrites without ids repeated across tasks -> the ids they keep; one an earlier
    merge already rewrote is the one `rewrites` records it made of this task's shard (and is gone where it kept
    none); one holding the ids it keeps but other bytes is refused like any changed shard. `stored`: an --out in a
    store, whose shards are in the bucket and not in `out`: checked there by size (its task hashed the file it uploaded
    whole; `vlmprep verify URL` hashes every shard). Hashed on threads (hashlib and file reads release the GIL)."""
    jobs = [(i, s) for i, m in enumerate(manifests) for s in m.shards]

    def problem(job) -> str | None:
        i, s = job
        path, kept, listed = out / s.name, rewritten.get(s.name), task_file(i, ".json")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if kept == []:
                return None
            if stored is not None and s.name in stored.sizes:
                got = stored.sizes[s.name]
                if got != s.bytes:
                    return f"{got} bytes in the bucket, but {listed} lists {s.bytes}"
                return _index_problem(out, s, listed)
            return f"listed in {listed} but missing"
        made = (
            rewrites.get(s.name, [None])[-1] if kept is not None and rewrites.get(s.name, [""])[0] == s.sha256 else None
        )
        if size != s.bytes and made is None:
            return f"{size} bytes, but {listed} lists {s.bytes}"
        digest = sha256_file(path)
        if kept is not None and digest in (s.sha256, made):
            return None  # to be rewritten here (or rewritten by an earlier run), with its sample index
        if digest != s.sha256:
            return f"sha256 {digest[:16]}..., but {listed} lists {s.sha256[:16]}..."
        return _index_problem(out, s, listed)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for (i, s), why in zip(jobs, pool.map(problem, jobs)):
            if why:
                raise MergeError(
                    f"{out / s.name}: {why} (changed, cut short or removed after task {i} wrote it): {_rerun(out, i)}"
                )


def _records(lines: list[str]):
    """A task's sample rows grouped by the record they came from (a record's samples are consecutive)."""
    group: list[dict] = []
    for sample in map(json.loads, lines):
        if group and sample["source"] != group[0]["source"]:
            yield group
            group = []
        group.append(sample)
    if group:
        yield group


def _repeated_ids(
    out: Path, plan: Plan, manifests: list[TaskManifest], earlier: list
) -> tuple[list[list[list[dict]]], dict[str, list[str]], set[bytes]]:
    """Per task, its records (each: its sample rows) whose id an earlier task (no task can see another's ids) or an
    earlier version of the dataset (`earlier`: their id arrays) already has: rejected whole, as the one-task build
    rejects them; the shards holding them -> the ids each keeps; and the id digests of the samples that stay."""
    seen: set[bytes] = set()
    dups_per_task, rewritten = [], {}
    task_lines = [
        read_state(TaskFiles(out, i, shard_prefix(plan, i)).samples, LIST_BYTES).decode("utf-8").splitlines()
        for i in range(len(manifests))
    ]
    new = [id_digest(k) for lines in task_lines for line in lines for k in id_keys(json.loads(line))] if earlier else []
    before = seen_before(earlier, new)
    for lines in task_lines:
        dups = []
        for record in _records(lines):
            # bounded memory per id; a record's own id and its samples' (id_keys), so a split `a` meets a whole `a`
            keys = [id_digest(k) for s in record for k in id_keys(s)]
            if any(k in seen or k in before for k in keys):
                dups.append(record)
            else:
                seen.update(keys)
        dups_per_task.append(dups)
        if dups:
            drop = {s["id"] for record in dups for s in record}
            affected = {s["shard"] for record in dups for s in record}
            for name in affected:
                rewritten[name] = []
            for sample in map(json.loads, lines):
                if sample["shard"] in affected and sample["id"] not in drop:
                    rewritten[sample["shard"]].append(sample["id"])
    return dups_per_task, rewritten, seen


def _reject_duplicate(record: list[dict], counters: list[collections.Counter]) -> None:
    """Take a landed record back as one duplicate_id reject: its samples out of the counts, its turns all lost (its
    own lost-turn rejects are taken out by _task_rejects)."""
    turns = record[0].get("turns", {})
    for counts in counters:
        for sample in record:
            count_sample(counts, sample, sign=-1)
        counts.subtract(turns)
        counts.update(duplicate_turns(turns))
        count_reject(counts, {"reason": "duplicate_id"})


def _task_rejects(text: str, dups: list[list[dict]]) -> tuple[str, list[dict]]:
    """A task's rejects less the lost-turn lines of its records that merge rejects as duplicates (a record is
    rejected once, under one reason); and the lines taken out."""
    if not dups:
        return text, []
    gone = {(r[0]["source"]["file"], r[0]["source"]["line"]) for r in dups}
    kept, removed = [], []
    for line in text.splitlines(keepends=True):
        entry = json.loads(line)
        if (entry["source"]["file"], entry["source"]["line"]) in gone:
            removed.append(entry)
        else:
            kept.append(line)
    return "".join(kept), removed


def merge_tasks(out: Path, stored: StoredShards | None = None, removed=None) -> Manifest:
    """Check every task (its manifest is its own, its shards are there as it wrote them), then write rejects.jsonl
    and manifest.json (last). Returns the manifest. The caller owns the dir (builder/owner.py). stored: an --out in a
    store's shards `out` (the stage) lacks (those the merge rewrites are fetched); `removed`: the id digests of the
    samples this version replaces (builder/rewrite.py), no duplicate_id here."""
    out = Path(out)
    if (plan := load_plan(out)) is None:
        raise MergeError(f"{out}: no {PLAN_NAME}: not a planned build dir (run `vlmprep build --plan-only` first)")
    state_dir(out / TASKS_DIR)  # the task manifests and lists are read from a real dir of its own, never a link
    manifests = _task_manifests(out, plan)
    _check_claims(out, plan, manifests)
    _check_strays(out, plan, manifests)
    proc = out / plan.processor.dir
    if not proc.is_dir() or fingerprint_dir(proc) != plan.processor.fingerprint:
        raise MergeError(f"{proc}: missing or not the processor the plan was made with; plan again into a fresh dir")
    n = plan.version
    earlier = earlier_ids(out, plan, removed)  # an append: every earlier version's ids, each a duplicate_id here
    dups_per_task, rewritten, kept_ids = _repeated_ids(out, plan, manifests, earlier)
    if stored is not None:  # only shards a task manifest lists: a sample row's shard name is not trusted alone
        listed = {s.name for m in manifests for s in m.shards}
        for name in [n for n in rewritten if n in listed] + [n for n in [REWRITES_NAME] if n in stored.sizes]:
            if not (out / name).exists():
                stored.fetch(name, out / name)
    rewrites = _load_rewrites(out)
    _verify_shards(out, manifests, rewritten, stored, rewrites)

    totals, rejects = collections.Counter(), collections.Counter()
    by_input = [collections.Counter() for _ in plan.inputs]
    input_of = {inp.path: i for i, inp in enumerate(plan.inputs)}
    shards, reject_lines = [], []
    for i, (m, dups) in enumerate(zip(manifests, dups_per_task)):
        files = TaskFiles(out, i, shard_prefix(plan, i))
        totals.update(m.totals)
        for k, counts in m.inputs.items():
            by_input[int(k)].update(counts)
        rejects.update(m.rejects)
        text, removed = _task_rejects(read_state(files.rejects, LIST_BYTES).decode("utf-8"), dups)
        reject_lines.append(text)
        for entry in removed:
            rejects[entry["reason"]] -= 1
            for counts in (totals, by_input[input_of[entry["source"]["file"]]]):
                count_reject(counts, entry, sign=-1)
        drop = {s["id"] for record in dups for s in record}
        for info in m.shards:
            if info.name in rewritten:
                info = _filter_shard(out, info, drop, files.prefix, rewrites)
            if info is not None:
                shards.append(info)
        for record in dups:
            _reject_duplicate(record, [totals, by_input[input_of[record[0]["source"]["file"]]]])
            rejects["duplicate_id"] += 1
            reject_lines.append(json.dumps(duplicate_reject(record[0]), ensure_ascii=False, sort_keys=True) + "\n")
    shutil.rmtree(out / _SCRATCH, ignore_errors=True)
    write_text_atomic(out / rejects_file(n), "".join(reject_lines))
    versions_dir(out)
    write_bytes_atomic(out / ids_name(n), ids_bytes(kept_ids), tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")
    index = (
        dataset_index(out, shards, DATASET_INDEX_NAME) if n == 1 else None
    )  # an append's index holds its parent's rows (append.py)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        vlmprep_version=plan.vlmprep_version,
        processor=plan.processor,
        config=plan.config,
        image_format=plan.config["image_format"],
        inputs=tuple(
            InputEntry(path=inp.path, bytes=inp.bytes, totals=input_totals(counts))
            for inp, counts in zip(plan.inputs, by_input)
        ),
        plan=PlanRef(tasks=plan.tasks, sha256=plan_digest(plan)),
        shards=tuple(shards),
        totals=input_totals(totals, zeros=True),
        turns=turn_coverage(totals),
        rejects=dict(sorted((k, v) for k, v in rejects.items() if v)),
        sample_index=index,
    )
    write_energon_meta(out)  # .nv-meta/dataset.yaml: Megatron-Energon reads DIR through vlmprep/clients/energon.py
    if n == 1:  # an append's version is committed once it passed its checks (append.commit_version)
        write_json_atomic(out / MANIFEST_NAME, manifest.to_json())  # last: its presence means complete
    return manifest

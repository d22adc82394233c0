"""`vlmprep build --append` (docs/datasets-that-grow.md), the parts a whole build has not: the version an append builds
on (its parent: the latest, manifest.json repaired first), the options it must share with the dataset, the inputs
that are new, and, once merged and checked, the new version's record (the dataset as of vN: every version's shards,
inputs and totals) and its sample index; the record is then created exclusively (local: shards/versions.py
commit_record; a store: builder/store.py) and manifest.json copied from it, last.

    parent (manifest.json, repaired) --check_options, new_inputs--> AppendRef in plan.json (version N, parent sha256)
    --tasks, merge (ids of earlier versions rejected as duplicate_id)--> the version's own files
    --version_record--> samples.v00000N.index.npy, the record --commit--> versions/v00000N.json, manifest.json
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from vlmprep.builder.plan import AppendRef, Plan
from vlmprep.builder.rewrite import Removal, built_parent, less, replaced_inputs, replaced_rows, replaced_shards
from vlmprep.builder.totals import TOTAL_KEYS
from vlmprep.builder.workers import BuildError
from vlmprep.config import FIELDS, PER_VERSION, REQUIRED, BuildConfig, spelled_flag
from vlmprep.ingest import as_input, input_names, stamp
from vlmprep.shards.dataset import MANIFEST_NAME, TMP_SUFFIX, sha256_file, write_bytes_atomic
from vlmprep.shards.format import FORMAT_VERSION
from vlmprep.shards.manifest import FileEntry, InputEntry, Manifest, ShardEntry, ShardFormatError, dataset_path
from vlmprep.shards.reader import iter_shard, load_sample_index, read_index_file
from vlmprep.shards.summary import turn_coverage
from vlmprep.shards.versions import (
    CommitConflict,
    commit_record,
    highest_version,
    id_digest,
    id_keys,
    ids_bytes,
    index_file,
    load_ids,
    load_removed,
    manifest_number,
    parse_record,
    read_record,
    record_bytes,
    rejects_file,
    repair_manifest,
    versions_dir,
)
from vlmprep.shards.writer import write_dataset_index
from vlmprep.types import ManifestError, UserError
from vlmprep_schemas.boundary import UnsafeDataset, dataset_paths
from vlmprep_schemas.limits import LIMITS
from vlmprep_schemas.versions import ids_name, local_reader, version_name


class NothingToAppend(ManifestError):
    """Every --in input of an append is in the dataset already: nothing is built, the dataset stays as it is."""


@dataclass(frozen=True)
class Parent:
    """The version an append builds on: its number, its record's bytes and the record as a Manifest."""

    number: int
    data: bytes
    manifest: Manifest

    @property
    def sha256(self) -> str:
        """The sha256 of the record's bytes: what the plan and a tag pin."""
        return hashlib.sha256(self.data).hexdigest()

    @property
    def next_position(self) -> int:
        """The input position the next version's first record takes: after every record of the versions so far."""
        added = (self.manifest.version or {}).get("added", {})
        if "first_position" in added:
            return int(added["first_position"]) + int(added["records"])
        return int(self.manifest.totals["records"])  # version 1: its records are positions 0 ..


def parent_of(data: bytes, base: str) -> Parent:
    """A latest record's bytes (manifest.json's of the dataset at `base`, a dir or URL) -> Parent, every name it gives
    checked to stay inside the dataset (an append copies them into its own record)."""
    where = f"{base}/{MANIFEST_NAME}"
    manifest = parse_record(data, where)
    try:
        dataset_paths(str(base), manifest.to_json(), where=where)
    except UnsafeDataset as e:
        raise ShardFormatError(str(e)) from None
    return Parent(manifest_number(manifest), data, manifest)


def no_dataset(out) -> BuildError:
    """The refusal of --append where --out holds no finished dataset."""
    return BuildError(
        f"--append: --out {out} holds no finished dataset (no {MANIFEST_NAME}); drop --append for a first build"
    )


def local_parent(out: Path, say: Callable[[str], None]) -> Parent:
    """The latest version of the dataset in `out`, made ready for an append: manifest.json repaired where a kill left
    it behind its highest record, version 1 of a dataset built before versions copied to versions/v000001.json
    (byte for byte), and each version's id file derived from its shards where it has none."""
    out = Path(out)
    if not out.is_dir() or (not (out / MANIFEST_NAME).exists() and highest_version(out) is None):
        raise no_dataset(out)
    repair_manifest(out, say)
    try:
        data = local_reader(str(out))(MANIFEST_NAME, LIMITS.manifest_bytes)
    except ValueError as e:
        raise ShardFormatError(str(e)) from None
    if data is None:
        raise no_dataset(out)
    parent = parent_of(data, str(out))
    if parent.number == 1 and read_record(out, 1) is None:
        try:
            commit_record(out, 1, data)  # the dataset built before versions becomes version 1, unchanged
        except CommitConflict:
            if read_record(out, 1) != data:
                raise
    for k in range(1, parent.number + 1):
        if not (out / ids_name(k)).exists():
            say(f"deriving {ids_name(k)} from its shards (once)")
            record = parent.manifest if k == parent.number else parse_record(read_record(out, k), version_name(k))
            digests = ids_bytes(_shard_ids(out, record))
            write_bytes_atomic(out / ids_name(k), digests, tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")
    return parent


def _shard_ids(out: Path, record: Manifest):
    """The id digests of the samples a version added (their id_keys, read from its shards' metas)."""
    added = (record.version or {}).get("added", {}).get("shards")
    names = set(added) if added is not None else None
    for s in record.shards:
        if names is None or s.name in names:
            for sample in iter_shard(dataset_path(out, s.name), version=record.format_version):
                yield from map(id_digest, id_keys(sample.meta()))


def check_options(cfg: BuildConfig, parent: Parent, out) -> None:
    """An append renders as the dataset did: every option that is not per-version equals the dataset's (an option
    the dataset's config lacks counts as its default). BuildError naming the option and both values otherwise."""
    asked = {k: v for k, v in cfg.to_json().items() if k not in PER_VERSION}
    there = {k: v for k, v in parent.manifest.config.items() if k not in PER_VERSION}

    def value(config: dict, k: str):
        f = FIELDS.get(k)
        fallback = f.default if f is not None and f.default is not REQUIRED else None
        v = config.get(k, fallback)
        return list(v) if isinstance(v, tuple) else v

    differ = [k for k in sorted(set(asked) | set(there)) if value(asked, k) != value(there, k)]
    if differ:
        k = differ[0]
        more = f" (and {', '.join(differ[1:4])}{' ...' if len(differ) > 4 else ''})" if len(differ) > 1 else ""
        raise BuildError(
            f"--append: {spelled_flag(k, value(asked, k))} asked, but {out} was built with "
            f"{spelled_flag(k, value(there, k))}{more}; an append renders as the dataset did: pass the dataset's "
            "value, or build into another --out"
        )


# Sample options an append does not take from the dataset when they are not given: what the build may read (a file
# the dataset names, remote URLs). They must still equal the dataset's: check_options names them.
NOT_INHERITED = frozenset(("role_boundaries", "allow_remote"))


def inherit_options(values: dict, out: str, given) -> dict:
    """`build --append` on the command line: each sample-defining option (not per version) the user did not give
    (`given`: the option names they did) takes the value the dataset in `out` was built with, so an append need not
    repeat them; one they gave is kept and check_options judges it. Not taken: NOT_INHERITED and a chat template
    that is a file rather than a bundled name (vlmprep reads no file a dataset names for it). The library's
    BuildConfig is whole as given: no option is inherited there."""
    from vlmprep.processors.load import bundled_templates

    config = dataset_config(out)
    out_values = dict(values)
    for k, v in config.items():
        if k not in values or k in given or k in PER_VERSION or k in NOT_INHERITED:
            continue
        if k == "chat_template" and v is not None and v not in bundled_templates():
            continue
        out_values[k] = tuple(v) if isinstance(v, list) else v
    return out_values


def dataset_config(out: str) -> dict:
    """The build options of the dataset in --out: its manifest.json's config (a local dir whose manifest.json a kill
    left behind: its highest record's), bounded; {} where there is none to read (the append then refuses in its own
    words)."""
    from vlmprep.builder.store import Bucket, is_store
    from vlmprep_schemas.limits import load_json

    try:
        if is_store(out):
            bucket = Bucket(out)
            size = bucket.sizes([MANIFEST_NAME]).get(MANIFEST_NAME, LIMITS.manifest_bytes + 1)
            data = bucket.read(MANIFEST_NAME, size) if size <= LIMITS.manifest_bytes else None
        elif Path(out).is_dir():
            read, top = local_reader(str(out)), highest_version(Path(out))
            data = read(MANIFEST_NAME, LIMITS.manifest_bytes)
            if data is None and top is not None:
                data = read(version_name(top), LIMITS.manifest_bytes)
        else:
            data = None
        obj = load_json(data, f"{out}/{MANIFEST_NAME}", LIMITS.manifest_bytes) if data else None
    except (UserError, ValueError, OSError):  # said again, in one line, where the append reads the dataset
        return {}
    config = obj.get("config") if isinstance(obj, dict) else None
    return config if isinstance(config, dict) else {}


def check_processor(fingerprint: str, parent: Parent, spec: str, out) -> None:
    """The processor (with its chat template and pixel budget) renders as the dataset's saved one: same fingerprint."""
    if fingerprint != parent.manifest.processor.fingerprint:
        raise BuildError(
            f"--append: --processor {spec} (with its chat template and pixel budget) is not the processor {out} was "
            f"built with (fingerprint {fingerprint[:12]}..., the dataset's {parent.manifest.processor.fingerprint[:12]}"
            "...); an append renders with the dataset's own: pass its --processor and --chat-template"
        )


def new_inputs(files: list, parent: Parent, out, say: Callable[[str], None], replaced: list | None = None) -> list:
    """The inputs of `files` not in the dataset yet. One that is, unchanged (path, bytes, and the mtime / ETag where
    recorded), is skipped with a line; one that is there but changed since is refused (a built input is never
    rebuilt in place), unless `replaced` is a list (a watcher's --on-change rebuild): it is then new, and its entry's
    old stamp goes into `replaced` (the version replaces its samples: builder/rewrite.py). NothingToAppend where
    none is new."""
    built = {e.path: e for e in parent.manifest.inputs}
    fresh = []
    for f in files:
        e = built.get(str(f))
        if e is None:
            fresh.append(f)
            continue
        now = stamp(f)
        was = {"bytes": e.bytes, "mtime_ns": e.mtime_ns, "etag": e.etag}
        if replaced is not None and any(v is not None and now.get(k) != v for k, v in was.items()):
            fresh.append(f)
            replaced.append({"path": e.path, **was})
            continue
        if any(v is not None and now.get(k) != v for k, v in was.items()):
            shown = ", ".join(f"{k} {v}" for k, v in was.items() if v is not None)
            raise BuildError(
                f"--append: {f} is in {out} already ({shown}) and has changed since "
                f"({', '.join(f'{k} {now.get(k)}' for k, v in was.items() if v is not None)}); a built input is never "
                "rebuilt in place: put the new records in a new file"
            )
        say(f"{f} is in {out} already (unchanged): skipped")
    if not fresh:
        raise NothingToAppend(
            f"{out}: every --in input is in the dataset already: nothing to append; it stays at "
            f"v{parent.number} ({parent.manifest.totals['samples']} samples)",
            parent.manifest,
        )
    return fresh


def append_ref(parent: Parent, replaces: list | None = None) -> AppendRef:
    """What the plan of an append on `parent` records: the version it makes, the one it builds on (and the inputs
    whose samples it replaces, if any)."""
    return AppendRef(
        version=parent.number + 1,
        parent=parent.number,
        parent_sha256=parent.sha256,
        first_position=parent.next_position,
        replaces=replaces or None,
    )


def new_names(files: list, parent: Parent) -> list[str]:
    """The id names of the new inputs (records without an id get one from it), taken among every input of the
    dataset, so a new day's traces.jsonl in another dir never takes the name an earlier one had."""
    earlier = [as_input(e.path) for e in parent.manifest.inputs]
    return input_names(earlier + list(files))[len(earlier) :]


def earlier_ids(out: Path, plan: Plan, removed: np.ndarray | None = None) -> list[np.ndarray]:
    """The id arrays of every version before the one `plan` builds ([] for a whole build), less the ids a later
    version removed (versions/v00000N.removed.ids; `removed`: those `plan`'s own version removes). Each sample holds
    one digest and a split record one more (shards/versions.id_keys), so their total is between the parent's sample
    count and twice it (exactly it in id files written before record ids were kept): an id file cut short or of
    another dataset is refused, naming the fix."""
    if plan.append is None:
        return []
    parent = built_parent(out, plan)
    want, ids = int(parent.totals["samples"]), []
    gone = load_removed(out, plan.append.parent, 2 * (want + plan.append.first_position))  # samples ever removed
    if removed is not None:
        gone[plan.version] = removed
    for k in range(1, plan.append.parent + 1):
        try:
            ids.append(load_ids(out, k, 2 * want + sum(map(len, gone.values()))))
            later = [r for j, r in gone.items() if j > k and len(r)]
            if later:
                ids[-1] = ids[-1][~np.isin(ids[-1], np.concatenate(later))]
        except FileNotFoundError:
            raise ShardFormatError(
                f"{out / ids_name(k)} is missing; run the `build --append` command again: it derives it"
            ) from None
    total = sum(map(len, ids))
    if not want - (len(removed) if removed is not None else 0) <= total <= 2 * want:  # a sample removed: 1-2 ids
        raise ShardFormatError(
            f"{out}: the id files of versions 1..{plan.append.parent} hold {total} ids, but the dataset has {want} "
            f"samples; remove {out / 'versions'}/*.ids and run the `build --append` command again to derive them"
        )
    return ids


def dataset_index(
    out: Path, shards: list[ShardEntry], name: str, head: list[np.ndarray] | None = None
) -> FileEntry | None:
    """Every shard's sidecar rows in one file `name` (after the rows `head` of an append's parent), so a reader opens
    one file for the whole dataset's index; None (and no file) where a shard has no sidecar. The sidecars were
    checked against their task manifests (size, sha256) or written by the merge."""
    (out / name).unlink(missing_ok=True)
    head = head or []
    if not shards or not all(s.index for s in shards):
        return None

    def parts():
        yield from head
        for s in shards:
            rows = load_sample_index(out, s)
            if len(rows) != s.num_samples:
                raise ShardFormatError(
                    f"{out / s.index.name}: {len(rows)} rows for the {s.num_samples} samples "
                    f"of {s.name}: remove the task's files and run it again"
                )
            yield rows

    rows = sum(len(h) for h in head) + sum(s.num_samples for s in shards)
    return FileEntry.from_json(write_dataset_index(out, parts(), rows, name))


def _parent_rows(out: Path, parent: Manifest) -> list[np.ndarray] | None:
    """The parent's sample index rows, checked against its record (size, header, sha256); None where it has none."""
    entry = parent.sample_index
    if entry is None:
        return None
    path = dataset_path(out, entry.name)
    rows = read_index_file(path, entry, rows=int(parent.totals["samples"]))
    if sha256_file(path) != entry.sha256:
        raise ShardFormatError(f"{path}: its sha256 differs from its version record's; refusing to copy its rows")
    return [rows]


def _command() -> list[str]:
    """This process's command line, credentials in URLs (scheme://user:secret@) redacted."""
    return [re.sub(r"(://)[^/@\s]*@", r"\1***@", a) for a in [Path(sys.argv[0]).name or "python", *sys.argv[1:]]]


def version_record(out: Path, plan: Plan, added: Manifest, removal: Removal | None = None) -> bytes:
    """The record of the version `plan` builds, from its merged files (`added`: the merge's manifest of the new
    inputs alone) and its parent: every version's shards (the parent's first), inputs, totals and rejects, the
    cumulative sample index (written here), and the version's own facts; `removal`: the samples it replaces
    (builder/rewrite.py: the parent's shards, rows, inputs and counts as of it). Returns its bytes; nothing is
    committed."""
    parent, n = built_parent(out, plan), plan.version
    head = _parent_rows(out, parent)
    head = replaced_rows(out, parent, head[0], removal) if head is not None else None
    index = dataset_index(out, list(added.shards), index_file(n), head) if head is not None else None
    totals = less(collections.Counter(parent.totals), removal, "totals")
    rejects = less(collections.Counter(parent.rejects), removal, "rejects")
    totals.update(added.totals)
    rejects.update(added.rejects)
    stamps = [{"path": i.path, "bytes": i.bytes, "mtime_ns": i.mtime_ns, "etag": i.etag} for i in plan.inputs]
    inputs = tuple(InputEntry(**s, totals=e.totals) for s, e in zip(stamps, added.inputs))
    removed = {"removed": removal.record()} if removal is not None else {}
    record = Manifest(
        format_version=FORMAT_VERSION,
        vlmprep_version=added.vlmprep_version,
        processor=added.processor,
        config={**added.config, "inputs": [*parent.config.get("inputs", []), *added.config["inputs"]]},
        image_format=added.image_format,
        inputs=replaced_inputs(parent, inputs),
        plan=added.plan,
        shards=replaced_shards(parent, removal) + added.shards,
        totals={k: int(totals[k]) for k in dict.fromkeys([*TOTAL_KEYS, *totals])},
        turns=turn_coverage(totals),
        rejects=dict(sorted((k, int(v)) for k, v in rejects.items() if v)),
        sample_index=index,
        version={
            "number": n,
            "parent": n - 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": _command(),
            "added": {
                "inputs": stamps,
                "shards": [s.name for s in added.shards],
                "totals": dict(added.totals),
                "turns": added.turns,
                "rejects": dict(added.rejects),
                "rejects_file": rejects_file(n),
                "first_position": plan.append.first_position,
                "records": plan.records,
            },
            **removed,
        },
    )
    return record_bytes(record.to_json())


def commit_local(out: Path, n: int, data: bytes) -> Manifest:
    """Commit version `n` in a local dir: its record created exclusively (CommitConflict where another build did
    first), then manifest.json, its byte copy (atomic). Returns the record."""
    versions_dir(out)
    commit_record(out, n, data)
    write_bytes_atomic(out / MANIFEST_NAME, data)
    return parse_record(data, str(out / version_name(n)))

"""A version that replaces the samples of built inputs whose content changed (`vlmprep watch --on-change rebuild`,
docs/datasets-that-grow.md "Rebuild"): the changed inputs are built again as new inputs of version N+1, and their old
samples leave the dataset as of N+1. Every shard of the parent holding one of them is rewritten without them as a new
shard of N+1 (`shard-v00000N-r-000000.tar`: byte copies of the kept members, nothing rendered again), and N+1's
record lists the parent's shards with each such one replaced at its place by its rewrite (or dropped where nothing is
left), then the new shards. Earlier versions and their shards stay as they are (gc keeps a shard while a kept version
names it). Which shards hold an input's samples is found by its input positions in the parent's sample index, and
each sample dropped is checked by its meta's source file; the count must be the input's recorded samples.

    plan.append.replaces --remove_replaced (before the merge)--> rewrites, versions/v00000N.removed.ids: Removal
    --merge (earlier ids less the removed: not duplicate_id)--> version_record: shards, index, inputs, totals less
"""

from __future__ import annotations

import collections
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmprep.builder.plan import Plan, PlanError
from vlmprep.builder.store import StoredShards
from vlmprep.shards.dataset import TMP_SUFFIX, sha256_file, write_bytes_atomic
from vlmprep.shards.format import FORMAT_VERSION
from vlmprep.shards.manifest import InputEntry, Manifest, ShardEntry, ShardFormatError, dataset_path
from vlmprep.shards.reader import iter_shard, load_sample_index, read_index_file
from vlmprep.shards.rejects_file import iter_rejects
from vlmprep.shards.versions import (
    ID_BYTES,
    CommitConflict,
    id_digest,
    id_keys,
    ids_bytes,
    parse_record,
    read_record,
    rejects_file,
    removed_ids_name,
    rewrite_prefix,
    versions_dir,
)
from vlmprep.shards.writer import ShardWriter, copied
from vlmprep_schemas.versions import version_name


@dataclass
class Removal:
    """What a version removes: the replaced inputs' entries (old stamps and totals), each parent shard that held
    their samples -> its rewrite (None: emptied), the removed samples' id digests (sorted), their totals and rejects."""

    inputs: list[InputEntry]
    shards: dict[str, ShardEntry | None]
    ids: np.ndarray
    totals: collections.Counter
    rejects: collections.Counter

    def record(self) -> dict:
        """The version record's `version.removed`."""
        return {
            "inputs": [{"path": e.path, "bytes": e.bytes, "mtime_ns": e.mtime_ns, "etag": e.etag} for e in self.inputs],
            "shards": {k: (v.name if v is not None else None) for k, v in self.shards.items()},
            "totals": {k: int(v) for k, v in self.totals.items() if v},
            "rejects": {k: int(v) for k, v in sorted(self.rejects.items()) if v},
        }


def built_parent(out: Path, plan: Plan) -> Manifest:
    """The parent record an append's plan was made on, as `out` holds it now (versions/v00000P.json): refused where it
    changed since (the dataset moved on) or where version N is committed already (another build did)."""
    ref = plan.append
    if read_record(out, ref.version) is not None:
        raise CommitConflict(
            f"{out}: version {ref.version} was committed by another build meanwhile ({version_name(ref.version)} "
            "exists); nothing of this build was committed: run the command again to append on top of it"
        )
    data = read_record(out, ref.parent)
    if data is None or hashlib.sha256(data).hexdigest() != ref.parent_sha256:
        raise PlanError(
            f"{out}: {version_name(ref.parent)} is not the version {ref.parent} the plan was made on; run the "
            "`build --append` command again to plan the append anew"
        )
    return parse_record(data, str(out / version_name(ref.parent)))


def _local(out: Path, name: str, stored: StoredShards | None) -> Path:
    """A dataset file in `out`, fetched from the bucket into the stage first where `out` is a store's stage."""
    path = dataset_path(out, name)
    if stored is not None and not path.exists():
        stored.fetch(name, path)
    return path


def _record(out: Path, k: int, stored: StoredShards | None) -> Manifest:
    name = version_name(k)
    _local(out, name, stored)
    data = read_record(out, k)
    if data is None:
        raise ShardFormatError(f"{out}/{name} is missing: the dataset's versions are not whole; restore it")
    return parse_record(data, f"{out}/{name}")


def _origins(out: Path, parent: Manifest, paths: set[str], stored) -> dict[str, tuple[int, int, int]]:
    """Each replaced input -> (the version that built its samples, its first input position, one past its last): the
    latest version whose added inputs name it; positions run over a version's inputs in order from its first."""
    found: dict[str, tuple[int, int, int]] = {}
    k = int((parent.version or {}).get("number", 1))
    while k >= 1 and len(found) < len(paths):
        record = parent if k == int((parent.version or {}).get("number", 1)) else _record(out, k, stored)
        added = (record.version or {}).get("added")
        order = [i["path"] for i in added["inputs"]] if added else [e.path for e in record.inputs]
        pos = int(added.get("first_position", 0)) if added else 0
        entries = {e.path: e for e in record.inputs}
        for path in order:
            n = int((entries[path].totals or {}).get("records", 0)) if path in entries else 0
            if path in paths and path not in found:
                found[path] = (k, pos, pos + n)
            pos += n
        k -= 1
    missing = sorted(paths - set(found))
    if missing:
        raise ShardFormatError(f"{out}: no version added {missing[0]}; its samples cannot be found to replace")
    return found


def _affected(out: Path, parent: Manifest, ranges: list[tuple[int, int]], stored) -> dict[str, int]:
    """The parent's shards holding a sample of the replaced inputs -> how many, from the parent's sample index (its
    sha256 checked; no index: every shard is read, a dataset built without sidecars)."""
    entry = parent.sample_index
    if entry is None:
        return {s.name: -1 for s in parent.shards}
    path = _local(out, entry.name, stored)
    if not path.is_file() or sha256_file(path) != entry.sha256:
        raise ShardFormatError(f"{path}: missing or not the sample index its version record lists; restore it")
    rows = read_index_file(path, entry, rows=int(parent.totals["samples"]))["position"]
    hit = np.zeros(len(rows), dtype=bool)
    for lo, hi in ranges:
        hit |= (rows >= lo) & (rows < hi)
    out_, at = {}, 0
    for s in parent.shards:
        k = int(hit[at : at + s.num_samples].sum())
        if k:
            out_[s.name] = k
        at += s.num_samples
    return out_


def _rewrite(out: Path, s: ShardEntry, paths: set[str], j: int, n: int, stored) -> tuple[ShardEntry | None, list]:
    """Shard `s` of the parent without the samples of `paths`: (its rewrite, version n's j-th, or None where nothing
    is left; the metas dropped). The shard must be as its record lists it (size, sha256): one line otherwise."""
    path = _local(out, s.name, stored)
    if not path.is_file() or path.stat().st_size != s.bytes or sha256_file(path) != s.sha256:
        raise ShardFormatError(
            f"{path}: missing or not the shard its version record lists (size, sha256), so the samples of a changed "
            "input cannot be replaced; nothing was committed: restore the shard (or rebuild the dataset whole)"
        )
    writer = ShardWriter(out, samples_per_shard=1 << 62, shard_size_bytes=1 << 62, prefix=rewrite_prefix(n))
    writer.index = j
    dropped = []
    for x in iter_shard(path, version=FORMAT_VERSION):
        meta = x.meta()
        if meta["source"]["file"] in paths:
            dropped.append(meta)
        else:
            writer.write(copied(x, meta))
    writer.close()
    return (writer.shards[0].entry() if writer.shards else None), dropped


def _rejects(out: Path, origins: dict[str, tuple[int, int, int]], stored) -> collections.Counter:
    """The replaced inputs' rejects by reason: their lines in the rejects file of the version that built them, read
    as stats reads them (iter_rejects: bounded a line, one ShardFormatError line for a bad one; no FIFO waited on)."""
    counts = collections.Counter()
    for k in sorted({v[0] for v in origins.values()}):
        path = _local(out, rejects_file(k), stored)
        if not path.is_file():
            continue
        for entry in iter_rejects(path):
            if origins.get((entry.get("source") or {}).get("file"), (None,))[0] == k:
                counts[str(entry.get("reason"))] += 1
    return counts


def remove_replaced(out: Path, plan: Plan, stored: StoredShards | None = None) -> Removal | None:
    """Rewrite the parent's shards that hold samples of the inputs `plan` replaces (None where it replaces none),
    write versions/v00000N.removed.ids, and return what version N removes. Files of version N alone are written
    (none is named by a record until N's is created): a kill leaves the parent as it was, and a run again writes
    them anew. ShardFormatError, one line, where a shard is not as recorded or the samples found are not the
    input's recorded count."""
    if plan.append is None or not plan.append.replaces:
        return None
    parent, n = built_parent(out, plan), plan.version
    for p in out.glob(rewrite_prefix(n) + "*"):  # a killed attempt's rewrites and temp files
        p.unlink()
    built = {e.path: e for e in parent.inputs}
    entries = []
    for r in plan.append.replaces:
        e = built.get(r["path"])
        if e is None or (e.bytes, e.mtime_ns, e.etag) != (r["bytes"], r.get("mtime_ns"), r.get("etag")):
            raise ShardFormatError(f"{out}: {r['path']} is not in its parent version as the plan says; plan again")
        entries.append(e)
    paths = {e.path for e in entries}
    origins = _origins(out, parent, paths, stored)
    affected = _affected(out, parent, [v[1:] for v in origins.values()], stored)
    shards, dropped = {}, []
    for j, s in enumerate(s for s in parent.shards if s.name in affected):
        shards[s.name], metas = _rewrite(out, s, paths, j, n, stored)
        if affected[s.name] >= 0 and len(metas) != affected[s.name]:
            raise ShardFormatError(
                f"{out / s.name}: holds {len(metas)} samples of the changed inputs, its index says "
                f"{affected[s.name]}; nothing was committed: run `vlmprep verify {out}`"
            )
        dropped += metas
        if affected[s.name] < 0 and not metas:
            del shards[s.name]  # read for want of an index: it held none
            for p in out.glob(f"{rewrite_prefix(n)}{j:06d}.tar*"):
                p.unlink()
    totals = collections.Counter()
    for e in entries:
        totals.update(e.totals or {})
    if len(dropped) != totals["samples"]:
        raise ShardFormatError(
            f"{out}: found {len(dropped)} samples of the changed inputs, their version records list "
            f"{totals['samples']}; nothing was committed: run `vlmprep verify {out}`"
        )
    ids = ids_bytes(id_digest(k) for m in dropped for k in id_keys(m))
    versions_dir(out)
    write_bytes_atomic(out / removed_ids_name(n), ids, tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")
    array = np.frombuffer(ids, dtype=f"S{ID_BYTES}")
    return Removal(entries, shards, array, totals, _rejects(out, origins, stored))


def replaced_shards(parent: Manifest, removal: Removal | None) -> tuple[ShardEntry, ...]:
    """The parent's shards as of the new version: each rewritten one at its place (dropped where emptied)."""
    if removal is None:
        return parent.shards
    return tuple(removal.shards.get(s.name, s) for s in parent.shards if removal.shards.get(s.name, s) is not None)


def replaced_rows(out: Path, parent: Manifest, rows: np.ndarray, removal: Removal | None) -> list[np.ndarray]:
    """The parent's sample index rows as of the new version: each rewritten shard's rows its rewrite's sidecar."""
    if removal is None:
        return [rows]
    parts, at = [], 0
    for s in parent.shards:
        if s.name not in removal.shards:
            parts.append(rows[at : at + s.num_samples])
        elif removal.shards[s.name] is not None:
            parts.append(load_sample_index(out, removal.shards[s.name]))
        at += s.num_samples
    return parts


def replaced_inputs(parent: Manifest, new: tuple[InputEntry, ...]) -> tuple[InputEntry, ...]:
    """The parent's inputs with each rebuilt one's entry replaced at its place by its new one (its new stamp alone),
    then the inputs new to the dataset."""
    mine = {e.path: e for e in new}
    kept = tuple(mine.pop(e.path, e) for e in parent.inputs)
    return kept + tuple(e for e in new if e.path in mine)


def less(counts: collections.Counter, removal: Removal | None, key: str) -> collections.Counter:
    """Cumulative counts (`key`: totals or rejects) less what the version removes."""
    if removal is not None:
        counts.subtract(getattr(removal, key))
    return counts

"""A versioned dataset dir on disk (docs/datasets-that-grow.md): each version's file names (its record, shards,
rejects, sample index, id file), the highest version record, manifest.json repaired where a kill left it behind, and
the exclusive local commit of a new record (os.link: the second of two writers fails). The names and the reference
parser are vlmprep_schemas.versions', shared with the trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from vlmprep.shards.dataset import MANIFEST_NAME, REJECTS_NAME, TMP_SUFFIX, write_bytes_atomic
from vlmprep.shards.format import DATASET_INDEX_NAME
from vlmprep.shards.manifest import Manifest, ShardFormatError, dataset_path, open_dataset
from vlmprep.shards.rejects_file import iter_rejects
from vlmprep.shards.summary import turn_coverage
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeDataset, open_no_follow, state_dir
from vlmprep_schemas.limits import LIMITS, load_json
from vlmprep_schemas.versions import (
    VERSIONS_DIR,
    VersionError,
    ids_name,
    is_rewrite,
    local_reader,
    printable,
    record_number,
    version_name,
    version_number,
)

_RECORD = re.compile(r"^v([0-9]{6,})\.json$")
_SHARD_VERSION = re.compile(r"^shard-v([0-9]{6})-")
ID_BYTES = 16  # a blake2b digest of a sample id: what the duplicate check keeps of each id


class CommitConflict(UserError):
    """The version record this build was to create exists: another build committed that version first."""


def rejects_file(n: int) -> str:
    """Version `n`'s own rejects: rejects.jsonl (version 1), rejects.v00000N.jsonl."""
    return REJECTS_NAME if n == 1 else f"rejects.v{n:06d}.jsonl"


def rejects_paths(d: Path, manifest: Manifest, *, since: int = 0) -> list[tuple[int, Path]]:
    """The rejects files of versions since+1 .. the manifest's that DIR holds, in version order, each with its
    version: what a version's rejects are (stats, inspect --only rejected, the reject table). None is read through a
    link out of DIR."""
    found = []
    for n in range(since + 1, manifest_number(manifest) + 1):
        p = dataset_path(d, rejects_file(n))
        if p.is_file():
            found.append((n, p))
    return found


def added_since(d: Path, manifest: Manifest, since: str) -> tuple[int, Manifest]:
    """What the versions after `since` (vM or a tag, resolved as DIR@vM) up to `manifest`'s (vN) added: (M, a manifest
    of its own: the shards N lists that M does not, the inputs after M's, the totals, rejects and turns N has beyond
    M's; no sample index), for `stats DIR@vN --since vM`. ShardFormatError, one line, where M is not a version of DIR
    before N (a version gc removed among them)."""
    n = manifest_number(manifest)
    try:
        version_number(since)  # vM (M >= 1) or a tag name
    except VersionError:
        raise ShardFormatError(
            f"--since {printable(since)}: pass an earlier version of {d} (v1, v2, ...) or a tag"
        ) from None
    _, old = open_dataset(f"{d}@{since}")
    m = manifest_number(old)
    if m >= n or [i.path for i in manifest.inputs[: len(old.inputs)]] != [i.path for i in old.inputs]:
        raise ShardFormatError(
            f"--since {since}: v{m} is not a version before v{n} of {d}; pass an earlier one (`vlmprep versions {d}`)"
        )
    before = {s.name for s in old.shards}
    removed = [r for k, r in rebuilds(d, manifest).items() if k > m]  # a rebuild's removals count back in: added
    totals = collections.Counter({k: int(v) - int(old.totals.get(k, 0)) for k, v in manifest.totals.items()})
    rejects = collections.Counter({k: int(v) - int(old.rejects.get(k, 0)) for k, v in manifest.rejects.items()})
    for r in removed:
        totals.update(r["totals"])
        rejects.update(r["rejects"])
    was = {i.path: i for i in old.inputs}
    return m, dataclasses.replace(
        manifest,
        inputs=tuple(i for i in manifest.inputs if was.get(i.path) != i),  # new, and rebuilt (another stamp)
        shards=tuple(s for s in manifest.shards if s.name not in before and not is_rewrite(s.name)),
        totals=dict(totals),
        rejects={k: v for k, v in rejects.items() if v},
        turns=turn_coverage(totals) if manifest.turns is not None else None,
        sample_index=None,
    )


def index_file(n: int) -> str:
    """Version `n`'s dataset sample index (all its rows): samples.index.npy (version 1), samples.v00000N.index.npy."""
    return DATASET_INDEX_NAME if n == 1 else f"samples.v{n:06d}.index.npy"


def shard_prefix(n: int, task: int | None) -> str:
    """The shard names of version `n` (task `task` of several, or None for one task): version 1 keeps the names of a
    build before versions; a later version's carry its number, so no version ever overwrites another's."""
    version = "" if n == 1 else f"v{n:06d}-"
    return f"shard-{version}" + ("" if task is None else f"{task:05d}-")


def rewrite_prefix(n: int) -> str:
    """The names of version `n`'s rewrites of earlier shards without the samples it replaces (builder/rewrite.py):
    `shard-v00000N-r-000000.tar`, a name of version n's that no task's (digits) takes."""
    return f"{shard_prefix(n, None)}r-"


def removed_ids_name(n: int) -> str:
    """Version `n`'s removed-id file: the digests of the samples it replaced (absent where it replaced none)."""
    return ids_name(n)[: -len(".ids")] + ".removed.ids"


def load_removed(d: Path, parent: int, most: int) -> dict[int, np.ndarray]:
    """The removed-id files of versions 2..parent that DIR holds (version -> its sorted digests), `most` ids read
    in all at most: the ids an earlier version added that a later one removed are no longer in the dataset."""
    found = {}
    for k in range(2, parent + 1):
        try:
            found[k] = _load_digests(d, removed_ids_name(k), most, "restore it from a copy of the dataset")
        except FileNotFoundError:
            # Absent where version k replaced nothing; where its record says it did (a copy that left the file
            # behind), the ids it removed would read as present and make an appended record of one a false
            # duplicate_id reject: refused instead.
            n = (_removed_by(d, k) or {}).get("totals", {}).get("samples", 0)  # schema-checked: ints
            if n > 0:
                raise ShardFormatError(
                    f"{Path(d) / removed_ids_name(k)} is missing, but version {k} removed {n} samples; "
                    "restore it from a copy of the dataset (without it, an appended record with one of their ids "
                    "would be rejected as a duplicate)"
                ) from None
            continue
        most -= len(found[k])
    return found


def rebuilds(d: Path, manifest: Manifest) -> dict[int, dict]:
    """What versions 2..N (N: `manifest`'s) removed, by version (their records' version.removed, where present:
    `vlmprep watch --on-change rebuild`). Each record read bounded."""
    out: dict[int, dict] = {}
    top = manifest_number(manifest)
    for k in range(2, top + 1):
        removed = (manifest.version or {}).get("removed") if k == top else _removed_by(d, k)
        if removed:
            out[k] = removed
    return out


def _removed_by(d: Path, k: int) -> dict | None:
    """Version k's record's version.removed (None where it has none, or DIR holds no record of k: gc), read bounded
    and schema-checked."""
    data = read_record(Path(d), k)
    record = parse_record(data, str(Path(d) / version_name(k))) if data is not None else None
    return ((record.version if record is not None else None) or {}).get("removed")


def replaced_by_rebuilds(d: Path, manifest: Manifest) -> set[str]:
    """The shards of earlier versions that version N (`manifest`'s) may rightly no longer list, as the records DIR
    holds tell it: those versions 2..N replaced by rewrites, and, where a record among them is gone (gc), every
    shard an earlier record names (gc keeps a shard while a kept version names it)."""
    top = manifest_number(manifest)
    out = {name for removed in rebuilds(d, manifest).values() for name in removed["shards"]}
    records = {k: read_record(Path(d), k) for k in range(1, top)}  # each read once
    if any(records[k] is None for k in range(2, top)):
        for k, data in records.items():
            if data is not None:
                out.update(s.name for s in parse_record(data, str(Path(d) / version_name(k))).shards)
    return out


def stale_rejects(d: Path, manifest: Manifest) -> Callable[[int, dict], bool]:
    """Whether a reject line of version k is of an input a later version (up to `manifest`'s) rebuilt: no longer the
    dataset's, as that input's old samples are not."""
    gone = {k: {i["path"] for i in r["inputs"]} for k, r in rebuilds(d, manifest).items()}
    return lambda k, line: any(j > k and (line.get("source") or {}).get("file") in paths for j, paths in gone.items())


def dataset_rejects(d: Path, manifest: Manifest, *, since: int = 0) -> Iterator[tuple[int, dict]]:
    """The reject lines of versions since+1 .. the manifest's (rejects_paths), each with its version, read bounded a
    line (iter_rejects), less those of an input a later version rebuilt (stale_rejects: its records read only where
    a rejects file is there to filter)."""
    found = rejects_paths(d, manifest, since=since)
    stale = stale_rejects(d, manifest) if found else None
    for n, p in found:
        for r in iter_rejects(p):
            if not stale(n, r):
                yield n, r


def shard_version(name: str) -> int:
    """The version whose build wrote shard `name` (1 for the names without a version)."""
    m = _SHARD_VERSION.match(name)
    return int(m.group(1)) if m else 1


def id_digest(sample_id: str) -> bytes:
    """The 16-byte blake2b of an id (a sample's or a record's), as the repeated-id checks keep it."""
    return hashlib.blake2b(sample_id.encode("utf-8"), digest_size=ID_BYTES).digest()


def record_id(meta: dict) -> str:
    """The id of the record a landed sample came from (a split sample's id is `<id>#<S>`)."""
    return str(meta["id"]) if meta.get("split") is None else str(meta["id"]).rsplit("#", 1)[0]


def id_keys(meta: dict) -> tuple[str, ...]:
    """What a landed sample (its meta, or its row in a task's sample list) claims of the id space: its own id and,
    for a step sample of a split record, its record's. A record is a duplicate where any key of any of its samples
    was claimed before, so `a` split into a#0, a#1 and a whole record `a` (either first) are one id, and sample ids
    stay unique. A version's id file holds the digests of its samples' keys."""
    own = str(meta["id"])
    return (own,) if meta.get("split") is None else (own, record_id(meta))


def highest_version(d: Path) -> int | None:
    """The highest version record in DIR/versions (None where there is none); a versions/ that is not a plain dir
    of DIR's (a planted symlink, a file) is refused."""
    vdir = Path(d) / VERSIONS_DIR
    if not os.path.lexists(vdir):
        return None
    if vdir.is_symlink() or not vdir.is_dir():
        raise UnsafeDataset(f"{vdir}: not a plain directory (a symlink or a file); refusing to read versions from it")
    found = [int(m.group(1)) for p in os.scandir(vdir) if (m := _RECORD.match(p.name))]
    return max(found, default=None)


def read_record(d: Path, n: int) -> bytes | None:
    """Version `n`'s record bytes (None where absent), read inside DIR and bounded."""
    try:
        return local_reader(str(d))(version_name(n), LIMITS.manifest_bytes)
    except ValueError as e:  # UnsafeDataset and VersionError are ValueErrors
        raise ShardFormatError(str(e)) from None


def parse_record(data: bytes, where: str) -> Manifest:
    """A version record's (or manifest.json's) bytes -> Manifest, bounded and schema-checked."""
    try:
        return Manifest.from_json(load_json(data, where, LIMITS.manifest_bytes), where=where)
    except ValueError as e:
        raise ShardFormatError(str(e)) from None


def manifest_number(m: Manifest) -> int:
    """The version a manifest describes (1 for a dataset built before versions)."""
    return record_number(m.to_json())


def repair_manifest(d: Path, say: Callable[[str], None]) -> None:
    """manifest.json is the byte copy of the highest version record, written after it: where a kill came between
    the two, copy it again (saying so). A manifest.json ahead of the records, or one that differs from the record of
    its own version, is not ours to fix: ShardFormatError naming both files."""
    d = Path(d)
    top = highest_version(d)
    if top is None:
        return
    record = read_record(d, top)
    try:
        current = local_reader(str(d))(MANIFEST_NAME, LIMITS.manifest_bytes)
    except ValueError as e:
        raise ShardFormatError(str(e)) from None
    if current == record:
        return
    try:
        number = None if current is None else record_number(load_json(current, MANIFEST_NAME, LIMITS.manifest_bytes))
    except ValueError:
        number = None  # unreadable: cut short or damaged; the records are the truth
    if number is not None and number >= top:
        raise ShardFormatError(
            f"{d / MANIFEST_NAME} (version {number}) is not the byte copy of {d / version_name(top)}; a version "
            f"record is never rewritten: restore it with `cp {d / version_name(top)} {d / MANIFEST_NAME}`"
        )
    write_bytes_atomic(d / MANIFEST_NAME, record, tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")  # --task-index runs
    said = "missing or unreadable" if number is None else f"at version {number}"
    say(f"{d / MANIFEST_NAME} was {said}, behind {version_name(top)} (a commit cut short): repaired")


def versions_dir(d: Path) -> Path:
    """DIR/versions, made where absent; refused where a symlink or a file is planted there (boundary.state_dir:
    nothing is written through it)."""
    return state_dir(Path(d) / VERSIONS_DIR)


def commit_record(d: Path, n: int, data: bytes) -> None:
    """Create DIR/versions/v00000N.json with `data`, exclusively (create_file: of two builds committing version N
    exactly one wins; the other gets CommitConflict)."""
    versions_dir(d)
    try:
        create_file(Path(d) / version_name(n), data)
    except FileExistsError:
        raise CommitConflict(_conflict(d, n)) from None


def create_file(final: Path, data: bytes) -> None:
    """Create `final` with `data`, exclusively and durably: written whole to a temp file beside it, then hard-linked
    to its name (os.link fails where the name exists: FileExistsError); where the file system has no hard links, an
    O_EXCL create is the exclusive step. The dir is synced, so the new name is durable before anything points at it.
    Nothing is followed through a link at either name."""
    tmp = final.with_name(f"{final.name}.{os.getpid()}{TMP_SUFFIX}")
    with open_no_follow(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError:  # no hard links here (some network and FUSE file systems)
        _create_exclusive(final, data)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_exclusive(final: Path, data: bytes) -> None:
    fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)  # FileExistsError where it is
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _conflict(d, n: int) -> str:
    return (
        f"{d}: version {n} was committed by another build meanwhile ({version_name(n)} exists); nothing of this "
        "build was committed: run the command again to append on top of it"
    )


def ids_bytes(digests: Iterable[bytes]) -> bytes:
    """A version's id file: the digests of its samples' id_keys, sorted and unique, back to back."""
    return b"".join(sorted(set(digests)))


def load_ids(d: Path, n: int, most: int) -> np.ndarray:
    """Version `n`'s id file as a sorted array of 16-byte strings, at most `most` ids read (twice its dataset's
    sample count: a split record adds its own id): one that is longer, not whole digests or not sorted is refused,
    naming it. FileNotFoundError where absent."""
    return _load_digests(d, ids_name(n), most, "remove it and the append derives it again from the shards")


def _load_digests(d: Path, name: str, most: int, fix: str) -> np.ndarray:
    """An id file of DIR (a version's, or its removed ids) as a sorted array of 16-byte strings, read bounded to
    `most` ids; one that is longer, not whole digests or not sorted is one ShardFormatError naming it and `fix`."""
    path = Path(d) / name
    try:
        data = local_reader(str(d))(name, most * ID_BYTES)
    except ValueError as e:
        raise ShardFormatError(f"{e}; {fix}") from None
    if data is None:
        raise FileNotFoundError(path)
    ids = np.frombuffer(data, dtype=f"S{ID_BYTES}") if len(data) % ID_BYTES == 0 else None
    if ids is None or (len(ids) > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
        raise ShardFormatError(f"{path}: not sorted whole {ID_BYTES}-byte digests; {fix}")
    return ids


def seen_before(earlier: list[np.ndarray], digests: list[bytes]) -> set[bytes]:
    """The digests among `digests` that some earlier version's id array holds (a binary search each: O(new x log
    old), reading no shard)."""
    if not digests:
        return set()
    want = np.array(sorted(set(digests)), dtype=f"S{ID_BYTES}")
    hit = np.zeros(len(want), dtype=bool)
    for ids in earlier:
        if len(ids):
            at = np.minimum(np.searchsorted(ids, want), len(ids) - 1)
            hit |= ids[at] == want
    return {bytes(w).ljust(ID_BYTES, b"\0") for w in want[hit]}


def record_bytes(obj: dict) -> bytes:
    """A version record's bytes, as manifest.json is written (indented, sorted keys)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")

"""A dataset's versions as a catalog (docs/datasets-that-grow.md): its version records and tags, read and changed the
same way in a local dir or a bucket (DatasetFiles), listed (`vlmprep versions`) and tagged (`vlmprep tag`). Every
record is read bounded and schema-checked, every tag checked against the record it names; a file that is neither is
refused in one line naming it, before anything changes.

    DIR (or s3://.../ds) --read_catalog--> Catalog(records, tags) --version_rows--> the table `versions` prints
                                              --make_tag / drop_tag--> versions/tags/NAME.json
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vlmprep.builder.append import Parent
from vlmprep.builder.owner import own_out
from vlmprep.builder.store import Bucket, is_store, stage_for
from vlmprep.shards.dataset import MANIFEST_NAME, TMP_SUFFIX, write_bytes_atomic
from vlmprep.shards.manifest import ShardFormatError
from vlmprep.shards.versions import create_file, manifest_number, parse_record, repair_manifest
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeDataset, dataset_paths, state_dir
from vlmprep_schemas.limits import LIMITS
from vlmprep_schemas.versions import (
    MAX_TAG_BYTES,
    TAGS_DIR,
    VERSIONS_DIR,
    Tag,
    VersionError,
    local_reader,
    parse_tag,
    printable,
    resolve_ref,
    split_ref,
    tag_file,
    version_name,
)

LEASE_NAME = f"{VERSIONS_DIR}/.lease"  # a bucket's gc or tag in progress: created conditionally, removed after
_RECORD = re.compile(r"^v([0-9]{6,})\.json$")
_TAG_FILE = re.compile(r"^(.*)\.json$")


class CatalogError(UserError):
    """A dataset whose versions cannot be listed or changed as asked: one line naming the file or value and the fix."""


class DatasetFiles:
    """The files of a dataset by their names inside it (versions/v000001.json ...), in a local dir: read bounded
    without following a link out or waiting on a FIFO, created exclusively, replaced atomically, removed (a link
    removed is the link, never its target). StoreFiles is the same over a bucket."""

    def __init__(self, d: str):
        self.where = str(d).rstrip("/") or str(d)
        self.dir = Path(self.where)
        self._read = local_reader(self.where)

    def check(self) -> None:
        """Refuse a path that is no dataset dir, or a dir that holds no dataset (one line), before anything (a lock
        file included) is written into it."""
        if not self.dir.is_dir():
            raise CatalogError(f"{self.where}: no such dataset dir")
        if not any(os.path.lexists(self.dir / n) for n in (MANIFEST_NAME, VERSIONS_DIR)):
            raise CatalogError(f"{self.where}: no {MANIFEST_NAME} there: not a vlmprep dataset (give its dir)")

    def listed(self, under: str) -> list[str]:
        """The file names directly in dir `under` (versions, versions/tags), which must be a plain dir where present."""
        sub = self.dir / under
        if not os.path.lexists(sub):
            return []
        if sub.is_symlink() or not sub.is_dir():
            raise CatalogError(f"{sub}: not a plain directory (a symlink or a file); refusing to read versions from it")
        return [p.name for p in os.scandir(sub)]

    def read(self, name: str, limit: int) -> bytes | None:
        """The file's bytes (None where absent); a link out, a FIFO or more than `limit` bytes: one line."""
        try:
            return self._read(name, limit)
        except ValueError as e:  # UnsafeDataset, the bound
            raise CatalogError(str(e)) from None

    def create(self, name: str, data: bytes) -> None:
        """Create the file exclusively (FileExistsError where it exists), its dir made without following a link."""
        state_dir(self.dir / Path(name).parent, root=self.dir)
        create_file(self.dir / name, data)

    def replace(self, name: str, data: bytes) -> None:
        """Replace the file whole (temp + rename): a reader sees the old bytes or the new."""
        state_dir(self.dir / Path(name).parent, root=self.dir)
        write_bytes_atomic(self.dir / name, data, tmp_suffix=f".{os.getpid()}{TMP_SUFFIX}")

    def remove(self, names: list[str]) -> None:
        """Remove these files (one already gone is fine). Each is unlinked in its dir opened without following a
        link (O_NOFOLLOW per component below the dataset dir): a link at the name is removed, never its target, and
        a dir swapped for a link out of the dataset is refused, so nothing outside the dataset is ever removed."""
        for name in names:
            parent, leaf = os.path.split(name)
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for part in filter(None, parent.split("/")):
                    sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    os.close(fd)
                    fd = sub
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leaf, dir_fd=fd)
            except OSError as e:  # ELOOP / ENOTDIR: a link or a file where a dir was
                raise CatalogError(
                    f"{self.where}/{parent}: not a plain directory ({e.strerror}); nothing removed from it"
                ) from None
            finally:
                os.close(fd)

    def repair(self, say) -> None:
        """manifest.json copied again from the highest record where a kill left it behind (saying so)."""
        repair_manifest(self.dir, say)

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """The dataset dir is this process's alone (the --out lock a build, a merge and an append hold)."""
        with own_out(self.dir):
            yield


class StoreFiles(DatasetFiles):
    """DatasetFiles over a dataset prefix in a bucket (s3://, gs://, memory://): creates are conditional writes."""

    def __init__(self, url: str):
        self.where = url.rstrip("/")
        self.bucket = Bucket(self.where)
        self._have: dict[str, int] | None = None

    def have(self) -> dict[str, int]:
        """Every object under the prefix -> its size (listed once, again after a change)."""
        if self._have is None:
            self._have = self.bucket.names()
        return self._have

    def check(self) -> None:
        """Refuse a prefix that holds no dataset (one line)."""
        have = self.have()
        if MANIFEST_NAME not in have and not any(k.startswith(VERSIONS_DIR + "/") for k in have):
            raise CatalogError(f"{self.where}: no {MANIFEST_NAME} there: not a vlmprep dataset (give its prefix)")

    def listed(self, under: str) -> list[str]:
        """The object names directly under `under`."""
        cut = len(under) + 1
        return [k[cut:] for k in self.have() if k.startswith(under + "/") and "/" not in k[cut:]]

    def read(self, name: str, limit: int) -> bytes | None:
        """The object's bytes (None where absent); more than `limit` bytes, or one that changed while read: one line."""
        size = self.have().get(name)
        if size is None:
            return None
        if size > limit:
            raise CatalogError(f"{self.where}/{name} is {size} bytes, more than a reader accepts ({limit})")
        data = self.bucket.read(name, size)
        if data is None:
            raise CatalogError(f"{self.where}/{name} changed while it was read; run again")
        return data

    def create(self, name: str, data: bytes) -> None:
        """A conditional create (FileExistsError where the object exists)."""
        self._have = None
        self.bucket.create(name, data)

    def replace(self, name: str, data: bytes) -> None:
        """One PUT: the object is the old bytes or the new."""
        self._have = None
        self.bucket.put_bytes(name, data)

    def remove(self, names: list[str]) -> None:
        """Delete these objects."""
        self._have = None
        self.bucket.remove(names)

    def repair(self, say) -> None:
        """manifest.json copied again from the highest record where a kill left it behind (saying so)."""
        from vlmprep.builder.store_versions import repair_bucket_manifest

        self._have = None
        repair_bucket_manifest(self.bucket, self.bucket.names(), say)

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """The dataset's versions are this process's alone to change: the --out lock of this machine's stage of the
        URL (a build into it from here holds it), and a lease object (versions/.lease) created conditionally in the
        bucket, so a gc or tag from another machine is refused meanwhile. A store that ignores conditional writes
        could grant it twice: refused in one line before anything changes. An append elsewhere needs no lease: gc
        keeps the latest version, all an append reads (docs/datasets-that-grow.md)."""
        from vlmprep.builder.store_versions import check_conditional_writes

        check_conditional_writes(self.bucket)
        stage = stage_for(self.where)
        made = not stage.exists()
        note = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}).encode()
        try:
            with own_out(stage):
                try:
                    self.bucket.create(LEASE_NAME, note)
                except FileExistsError:
                    held = self.bucket.read(LEASE_NAME, self.bucket.sizes([LEASE_NAME]).get(LEASE_NAME, 0)) or b"?"
                    who = printable(held[:200].decode("utf-8", "replace"))
                    raise CatalogError(
                        f"{self.where} is in use by another gc or tag ({LEASE_NAME}: {who}); "
                        f"wait for it to end, or remove {self.where}/{LEASE_NAME} if none runs"
                    ) from None
                try:
                    yield
                finally:
                    self.bucket.remove([LEASE_NAME])
        finally:
            if made:
                shutil.rmtree(stage, ignore_errors=True)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def dataset_files(value: str) -> tuple[DatasetFiles, str | None]:
    """`DIR`, `DIR@vN`, `DIR@TAG` (a local dir or a store's URL) -> (its files, the reference or None)."""
    try:
        base, ref = split_ref(value)
    except VersionError as e:
        raise CatalogError(str(e)) from None
    files = StoreFiles(base) if is_store(base) else DatasetFiles(base)
    files.check()
    return files, ref


@dataclass(frozen=True)
class Record(Parent):
    """One version's record as the catalog holds it: its number, bytes (their sha256 is what a tag pins) and parsed
    manifest (an append's Parent is one)."""

    def names(self) -> set[str]:
        """Every file the record names inside the dataset: its shards, their sample indexes, its sample index."""
        m = self.manifest
        out = {s.name for s in m.shards} | {s.index.name for s in m.shards if s.index}
        return out | ({m.sample_index.name} if m.sample_index else set())


@dataclass(frozen=True)
class Catalog:
    """A dataset's versions: each record present (by number; a dataset built before versions: its manifest.json as
    version 1) and each tag (by name), the latest version, and whether the records are files (False: implicit v1)."""

    files: DatasetFiles
    records: dict[int, Record]
    tags: dict[str, Tag]
    versioned: bool

    @property
    def latest(self) -> int:
        """The highest version: what plain DIR reads."""
        return max(self.records)

    def tags_of(self, n: int) -> list[str]:
        """The tags that name version `n`, sorted."""
        return sorted(t.tag for t in self.tags.values() if t.version == n)


def read_catalog(files: DatasetFiles) -> Catalog:
    """Every record and tag of the dataset, each checked: a record bounded, schema-checked, naming only files inside
    the dataset and claiming its own number; a tag well formed, named as its file, naming a record here whose sha256
    is its own. CatalogError (one line, the file and the fix) for the first that is not."""
    numbers = sorted(int(m.group(1)) for n in files.listed(VERSIONS_DIR) if (m := _RECORD.match(n)))
    records = {n: _record(files, version_name(n), n) for n in numbers}
    versioned = bool(records)
    if not records:  # a dataset built before versions, or never appended to: its manifest.json is version 1
        data = files.read(MANIFEST_NAME, LIMITS.manifest_bytes)
        if data is None:
            raise CatalogError(f"{files.where}: no {MANIFEST_NAME}: not a finished vlmprep dataset")
        records = {1: _record(files, MANIFEST_NAME, 1, data)}
    tags = {}
    for name in sorted(n for n in files.listed(TAGS_DIR) if not n.endswith(TMP_SUFFIX)):  # not a replace's temp
        tag = _tag(files, name, records)
        tags[tag.tag] = tag
    return Catalog(files, records, tags, versioned)


def _record(files: DatasetFiles, name: str, n: int, data: bytes | None = None) -> Record:
    where = f"{files.where}/{name}"
    try:
        data = files.read(name, LIMITS.manifest_bytes) if data is None else data
        if data is None:
            raise CatalogError(f"{where}: gone while it was read; run again")
        manifest = parse_record(data, where)
        number = manifest_number(manifest)
    except (CatalogError, ShardFormatError, VersionError) as e:
        raise CatalogError(
            f"{e}; {where} is not a version record vlmprep reads: restore it from a copy (manifest.json is the "
            "latest record's)"
        ) from None
    if number != n:
        raise CatalogError(f"{where}: claims to be version {number}, not {n}; restore it from a copy")
    try:  # a name out of the dataset (a corrupt record) or a file that is a link out: refused, nothing changed
        dataset_paths(files.where, manifest.to_json(), where=where)
    except UnsafeDataset as e:
        fix = "" if "(a symlink)" in str(e) else f"; {where} is corrupt: restore it from a copy"
        raise CatalogError(f"{e}{fix}; nothing was changed") from None
    return Record(n, data, manifest)


def _tag(files: DatasetFiles, name: str, records: dict[int, Record]) -> Tag:
    """The tag file `name` of versions/tags, checked against the records; CatalogError naming the fix otherwise."""
    where = f"{files.where}/{TAGS_DIR}/{name}"
    m = _TAG_FILE.match(name)
    try:
        tag = tag_file(m.group(1)) if m else None
    except VersionError:
        tag = None
    if tag is None:
        raise CatalogError(f"{printable(where)}: not a tag file name (NAME.json, {_RULE}); remove it")
    try:
        parsed = parse_tag(files.read(tag, MAX_TAG_BYTES) or b"", where=where)
    except VersionError as e:
        raise CatalogError(f"{e}; remove it (`vlmprep tag {files.where} {m.group(1)} --delete`)") from None
    if parsed.tag != m.group(1):
        raise CatalogError(f"{where}: holds tag {parsed.tag!r}, not {m.group(1)!r}; remove it")
    record = records.get(parsed.version)
    if record is None or record.sha256 != parsed.manifest_sha256:
        why = "which is not in the dataset" if record is None else "whose record is not the one it was made for"
        raise CatalogError(
            f"{where}: names v{parsed.version}, {why}; remove it (`vlmprep tag {files.where} {parsed.tag} --delete`)"
        )
    return parsed


_RULE = "a letter then up to 63 letters, digits, '.', '_' or '-', not v<digits>"


def version_rows(catalog: Catalog) -> list[dict]:
    """One row per version, oldest first: number, tags, created, parent, inputs (added and in all), samples, tokens
    and bytes (as of it and added by it), turn coverage as of it, the record's file."""
    rows = []
    for n, r in sorted(catalog.records.items()):
        m = r.manifest
        info = m.version or {}
        added = info.get("added") if isinstance(info.get("added"), dict) else None
        if added is None:  # version 1 of a dataset: it added all it holds
            added = {"inputs": m.inputs, "shards": [s.name for s in m.shards], "totals": m.totals}
        mine = set(added.get("shards") or ())
        rows.append(
            {
                "version": n,
                "tags": catalog.tags_of(n),
                "created": info.get("created"),
                "parent": info.get("parent"),
                "inputs": len(m.inputs),
                "inputs_added": len(added.get("inputs") or ()),
                "samples": int(m.totals.get("samples", 0)),
                "samples_added": int((added.get("totals") or {}).get("samples", 0)),
                "tokens": int(m.totals.get("tokens", 0)),
                "tokens_added": int((added.get("totals") or {}).get("tokens", 0)),
                "bytes": sum(s.bytes for s in m.shards),
                "bytes_added": sum(s.bytes for s in m.shards if s.name in mine),
                "coverage": (m.turns or {}).get("coverage"),
                "record": version_name(n) if catalog.versioned else MANIFEST_NAME,
            }
        )
    return rows


def resolve(catalog: Catalog, ref: str | None) -> Record:
    """The record a reference names (None: what plain DIR reads, manifest.json), resolved as every reader resolves
    it (vlmprep_schemas.versions.resolve_ref); CatalogError naming what exists otherwise."""
    try:
        found = resolve_ref(ref, catalog.files.read, where=catalog.files.where)
    except VersionError as e:
        raise CatalogError(str(e)) from None
    if found is None or found.number not in catalog.records or catalog.records[found.number].data != found.data:
        raise CatalogError(f"{catalog.files.where}: {MANIFEST_NAME} is not a byte copy of a version record; run again")
    return catalog.records[found.number]


def _exists(catalog: Catalog) -> str:
    have = sorted(catalog.records)
    tags = f"; tags {', '.join(sorted(catalog.tags))}" if catalog.tags else ""
    return f"versions v{have[0]}..v{have[-1]} ({len(have)} kept){tags}; `vlmprep versions {catalog.files.where}`"


def make_tag(value: str, name: str, *, force: bool = False) -> tuple[str, Tag, Tag | None]:
    """`vlmprep tag DIR@vN NAME`: versions/tags/NAME.json naming version N (and the sha256 of its record), created
    exclusively. A tag of that name that exists is refused in one line, unless `force` moves it (replaced whole).
    Returns (the dataset, the tag, the one it replaced or None). Under the dataset's lock (a local dir), so gc cannot
    remove the version meanwhile."""
    files, ref = dataset_files(value)
    try:
        path = tag_file(name)  # the name's rule; v<digits> names a version, never a tag
    except VersionError as e:
        raise CatalogError(str(e)) from None
    with files.owned():
        catalog = read_catalog(files)
        record = resolve(catalog, ref)
        tag = Tag(name, record.number, record.sha256, _now())
        old = catalog.tags.get(name)
        if old is not None and not force:
            raise CatalogError(
                f"{files.where}: tag {name!r} exists (it names v{old.version}, made {printable(old.created)}); pick "
                f"another name, or pass --force to move it to v{record.number}"
            )
        if old is not None:
            files.replace(path, tag.to_bytes())
            return files.where, tag, old
        try:
            files.create(path, tag.to_bytes())
        except FileExistsError:
            raise CatalogError(
                f"{files.where}: tag {name!r} was made meanwhile; run `vlmprep versions` to see it"
            ) from None
        return files.where, tag, None


def drop_tag(value: str, name: str) -> Tag:
    """`vlmprep tag DIR NAME --delete`: remove tag NAME (a version in `value` must be the one it names). Returns it."""
    files, ref = dataset_files(value)
    with files.owned():
        catalog = read_catalog(files)
        tag = catalog.tags.get(name)
        if tag is None:
            raise CatalogError(f"{files.where}: no tag {printable(name)} ({_exists(catalog)})")
        if ref is not None and resolve(catalog, ref).number != tag.version:
            raise CatalogError(f"{files.where}: tag {name!r} names v{tag.version}, not {ref}; nothing removed")
        files.remove([tag_file(name)])
        return tag

"""What `vlmprep watch` compares each cycle: the input objects at its location, listed with the stamps the listing
gives (a store's size and ETag, a local file's size and mtime), against the inputs of the dataset's latest committed
version (its record: the source of truth). An object in no version is pending; one in a version whose size or ETag
(locally: size or mtime) is another now is changed. The attempt a kill interrupted is found by its plan (in --out;
for a bucket in this machine's stage, else the bucket), so a restart resumes it with the same inputs.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vlmprep.builder.append import Parent, parent_of
from vlmprep.builder.owner import own_out
from vlmprep.builder.plan import Plan, PlanError, PlanInput, load_plan
from vlmprep.builder.store import Bucket, is_store, stage_for
from vlmprep.builder.store_versions import store_parent
from vlmprep.ingest import (
    SUFFIXES,
    Input,
    InputError,
    LocationError,
    ReadLimits,
    RemoteFile,
    expand_inputs,
    is_url,
    iter_file_records,
    stamp,
    stamp_of_info,
    url_fs,
    why,
)
from vlmprep.shards.dataset import MANIFEST_NAME, PLAN_NAME
from vlmprep.shards.manifest import InputEntry, ShardFormatError
from vlmprep.shards.versions import highest_version, read_record, repair_manifest
from vlmprep.types import UserError
from vlmprep_schemas.limits import LIMITS
from vlmprep_schemas.versions import VERSIONS_DIR, local_reader, version_name


@dataclass(frozen=True)
class Listed:
    """An input object as the location's listing shows it, with its stamp (bytes, mtime_ns, and a store's etag)."""

    input: Input
    stamp: dict

    @property
    def path(self) -> str:
        """The path or URL a version records it by."""
        return str(self.input)


@dataclass(frozen=True)
class Changed:
    """A built object that is another now: its path, the stamp its version recorded, the stamp listed now."""

    path: str
    was: dict
    now: dict


def _web(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("http", "https")


def globbed(pattern: str) -> bool:
    """Whether an --in pattern is a glob."""
    return any(ch in pattern for ch in "*?[")


def list_location(patterns: tuple[str, ...]) -> dict[str, Listed]:
    """The input objects the patterns name now (dirs and prefixes walked for the input suffixes, globs matched),
    sorted by path: an empty dir, prefix or glob is no fault (nothing has landed yet). A store's listing is read
    fresh (its cache dropped) and gives each object's stamp; a local file is stat'ed; an http(s) index page gives none,
    so each object there is asked (a HEAD each)."""
    found: dict[str, Listed] = {}
    for pat in patterns:
        if is_url(pat) and not _web(pat):
            items = _list_store(pat)
        else:
            items = [Listed(f, stamp(f)) for f in _local_or_web(pat)]
        for item in items:
            found.setdefault(item.path, item)
    return dict(sorted(found.items()))


def _local_or_web(pat: str) -> list[Input]:
    if is_url(pat):
        return expand_inputs([pat])
    if globbed(pat):
        return sorted(Path(m) for m in glob.glob(pat, recursive=True) if Path(m).is_file() and m.endswith(SUFFIXES))
    try:
        return expand_inputs([pat])
    except InputError:
        if Path(pat).is_dir():
            return []  # a dir with no input file in it yet (the one refusal expand_inputs has for a dir)
        raise


def _list_store(pat: str) -> list[Listed]:
    fs, path = url_fs(pat)
    try:
        fs.invalidate_cache()  # a listing cached by the filesystem object would never show a new object
        if globbed(path):
            found = fs.glob(path, detail=True)
        else:
            try:
                info = fs.info(path)
            except FileNotFoundError:
                info = None  # an empty prefix does not exist in a bucket
            if info is None:
                found = {}
            elif info.get("type") == "directory":
                found = fs.find(path, detail=True)
            else:
                found = {path: info}
    except Exception as e:  # noqa: BLE001 - each backend raises its own kinds
        raise LocationError(f"cannot list {pat}: {why(e)}") from None
    memory = pat.split("://", 1)[0] == "memory"
    out = []
    for p, info in sorted(found.items()):
        if info.get("type", "file") != "file" or not p.endswith(SUFFIXES):
            continue
        url = f"memory://{p.lstrip('/')}" if memory else (fs.unstrip_protocol(p) if "://" not in p else p)
        out.append(Listed(RemoteFile(url), stamp_of_info(info)))
    return out


def _bounded(bucket: Bucket, name: str, size: int) -> bytes:
    if size > LIMITS.manifest_bytes:
        raise ShardFormatError(f"{bucket.url}/{name} is {size} bytes, more than a reader accepts")
    data = bucket.read(name, size)
    if data is None:
        raise LocationError(f"{bucket.url}/{name} changed while it was read; run again")
    return data


def latest_version(out: str) -> Parent | None:
    """The dataset's latest committed version (its highest record; manifest.json for a dataset built before
    versions), or None where --out holds no dataset yet. Read-only: a manifest.json behind the records is repaired by
    the next build."""
    if is_store(out):
        bucket = Bucket(out)
        try:
            bucket.fs.invalidate_cache()
            listed = bucket.fs.ls(f"{bucket.root}/{VERSIONS_DIR}", detail=True)
        except FileNotFoundError:
            listed = []
        except Exception as e:  # noqa: BLE001 - each store raises its own kinds
            raise LocationError(f"--out {bucket.url}: cannot list it: {why(e)}") from None
        sizes = {Path(i["name"]).name: int(i.get("size") or 0) for i in listed if i.get("type", "file") == "file"}
        numbers = [int(n[1:-5]) for n in sizes if n.startswith("v") and n.endswith(".json") and n[1:-5].isdigit()]
        if numbers:
            name = version_name(max(numbers))
            return parent_of(_bounded(bucket, name, sizes[Path(name).name]), bucket.url)
        have = bucket.sizes([MANIFEST_NAME])
        return parent_of(_bounded(bucket, MANIFEST_NAME, have[MANIFEST_NAME]), bucket.url) if have else None
    d = Path(out)
    if not d.is_dir():
        return None
    top = highest_version(d)
    try:
        data = read_record(d, top) if top else local_reader(str(d))(MANIFEST_NAME, LIMITS.manifest_bytes)
    except ValueError as e:
        raise ShardFormatError(str(e)) from None
    return parent_of(data, str(d)) if data else None


def repair(out: str, say) -> None:
    """manifest.json copied again from the highest record where a kill came between the two (saying so), as the next
    build would: a watcher that finds nothing new still leaves plain DIR naming the latest version."""
    if is_store(out):
        if latest_version(out) is not None:
            store_parent(Bucket(out), say)
    elif Path(out).is_dir():
        repair_manifest(Path(out), say)


def _compared(recorded: InputEntry | PlanInput, path: str) -> dict:
    """What says an object is the one built: its size, and its ETag (a store's) or mtime (a local file's) where the
    version recorded one (version 1 of a dataset records sizes alone). A store's times are left out: a listing and a
    HEAD give them to other precisions."""
    keys = ["bytes", "etag" if is_url(path) else "mtime_ns"]
    return {k: getattr(recorded, k) for k in keys if getattr(recorded, k, None) is not None}


def compare(listed: dict[str, Listed], parent: Parent | None) -> tuple[list[Listed], list[Changed]]:
    """(pending: the listed objects in no version, changed: those in one whose stamp differs now). A local input a
    version recorded by a relative path is matched by that path made absolute too."""
    built: dict[str, InputEntry] = {}
    for e in parent.manifest.inputs if parent is not None else ():
        built[e.path] = e
        if not is_url(e.path) and not os.path.isabs(e.path):
            built.setdefault(os.path.abspath(e.path), e)
    pending, changed = [], []
    for path, item in listed.items():
        e = built.get(path)
        if e is None:
            pending.append(item)
            continue
        was = _compared(e, path)
        now = {k: item.stamp.get(k) for k in was}
        if now != was:
            changed.append(Changed(path, was, now))
    return pending, changed


def _plan_of(out: str) -> Plan | None:
    """The plan in --out (for a bucket: this machine's stage's, else the bucket's), None where none or unreadable."""
    try:
        if not is_store(out):
            return load_plan(Path(out)) if Path(out).is_dir() else None
        stage = stage_for(out)
        if (stage / PLAN_NAME).is_file():
            return load_plan(stage)
        bucket = Bucket(out)
        have = bucket.sizes([PLAN_NAME])
        if not have:
            return None
        return Plan.from_json(json.loads(_bounded(bucket, PLAN_NAME, have[PLAN_NAME])))
    except (PlanError, ValueError):
        return None


def interrupted(out: str, parent: Parent | None, listed: dict[str, Listed]) -> list[str] | None:
    """The inputs of the attempt a kill interrupted (the plan in --out of the version after `parent`, or of the first
    build where there is no dataset), where every one is still listed as the plan stamped it: built again with the
    same inputs, the attempt resumes (its finished shards kept; in a bucket, its claim of the version passes). None
    where there is no such attempt."""
    plan = _plan_of(out)
    if plan is None:
        return None
    if parent is None:
        ours = plan.append is None
    else:
        ours = plan.append is not None and (plan.append.parent, plan.append.parent_sha256) == (
            parent.number,
            parent.sha256,
        )
    if not ours or not plan.inputs:
        return None
    for inp in plan.inputs:
        item = listed.get(inp.path)
        if item is None or any(item.stamp.get(k) != v for k, v in _compared(inp, inp.path).items()):
            return None
    return [inp.path for inp in plan.inputs]


def forget_attempt(out: str) -> None:
    """Where --out holds no dataset yet, the plan of a first build that can no longer resume (an input of it changed
    or is gone) is removed, so the next first build plans anew (nothing was committed: nothing is lost). Locally under
    the --out lock: never the plan of a build running there."""
    if is_store(out):
        Bucket(out).remove([PLAN_NAME])
        (stage_for(out) / PLAN_NAME).unlink(missing_ok=True)
    elif (Path(out) / PLAN_NAME).exists():
        with own_out(Path(out)):
            (Path(out) / PLAN_NAME).unlink(missing_ok=True)


def count_records(items: list[Listed], *, limits: ReadLimits, cache: dict) -> int:
    """The records the objects hold (a line, a table row, a .json array item; a file-level fault counts one), each
    object read once per stamp (`cache` keeps its count), as the plan's scan reads it: lines, not JSON."""
    total = 0
    for item in items:
        key = (item.path, tuple(sorted((k, str(v)) for k, v in item.stamp.items())))
        if key not in cache:
            try:
                records = iter_file_records(
                    RemoteFile(item.path) if isinstance(item.input, RemoteFile) else item.input,
                    limits=limits,
                    scan=True,
                )
                cache[key] = sum(1 for _ in records)
            except UserError:
                cache[key] = 1  # read as a build reads it: a file that cannot be read is one fault record
        total += cache[key]
    return total


def stamp_text(st: dict) -> str:
    """A stamp as a message shows it: `bytes 120, etag "abc"` (the keys it has)."""
    return ", ".join(f"{k} {v}" for k, v in st.items() if v is not None)

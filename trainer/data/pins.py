"""Dataset versions as the trainer reads them (docs/datasets-that-grow.md): a --data reference (`DIR@vN`, `DIR@TAG`,
plain `DIR`: the latest, resolved once) -> the version record it names, read once through a bounded reader of the
local dir or store, with its sha256 (DatasetVersion) -> what RUN/run.json records of it, and the checks a resume or a
--follow switch makes against a record (still there, the same bytes, a later version of the same data).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from trainer.data.errors import DataError
from trainer.data.storage import StorageError, read_url
from vlmprep_schemas.boundary import MANIFEST_NAME, REMOTE, UnsafeDataset, dataset_file
from vlmprep_schemas.limits import LIMITS
from vlmprep_schemas.versions import Read, VersionError, local_reader, resolve_ref, version_name


@dataclass(frozen=True)
class DatasetVersion:
    """The version of a dataset a run reads: its number, its record's name inside the dataset and the sha256 of the
    record's bytes (what a resume checks), and the reference it was asked by."""

    number: int
    record: str  # versions/v00000N.json; manifest.json for a dataset that has no version records yet (version 1)
    sha256: str
    ref: str | None = None  # 'v3' or a tag as asked; None: plain DIR, the latest when the run resolved it

    def entry(self) -> dict:
        """This version as RUN/run.json records it."""
        return {"version": self.number, "record": self.record, "sha256": self.sha256, "ref": self.ref}


def dataset_reader(base: str) -> Read:
    """A bounded reader of the dataset at `base` (vlmprep_schemas.versions.Read): a local dir's files resolved inside
    it, never a FIFO waited on (local_reader); a URL's objects read as a stream cut one byte past the limit
    (storage.read_url), None for a missing one."""
    if not base.startswith(REMOTE):
        return local_reader(base)

    def read(name: str, limit: int) -> bytes | None:
        url = dataset_file(base, name, where=base, what="file")
        try:
            return read_url(url, limit)
        except StorageError as e:
            if str(e).endswith(": no such file or object"):
                return None
            raise DataError(str(e)) from None

    return read


def read_version(
    base: str, ref: str | None, *, option: str = "--data", pinned: dict | None = None
) -> tuple[DatasetVersion, bytes] | None:
    """The version record `ref` names in the dataset at `base` (a tag, `vN`; None: the latest, manifest.json, which
    must be the byte copy of its version's record) and its bytes, each file read once and bounded; None where there is
    no manifest.json at all. `pinned`: what RUN/run.json recorded of the version a resumed run read
    (DatasetVersion.entry): plain DIR then reads that version, and the record must still be there with the same
    bytes. A missing version or tag, a lying record, a link or FIFO in its place: one DataError line naming
    `option`."""
    read = dataset_reader(base)
    try:
        if pinned is not None:
            got = _pinned(base, ref, read, pinned, option)
        elif ref is not None:
            found = resolve_ref(ref, read, where=base)
            got = _version(found.name, found.data, found.number, ref), found.data
        else:
            got = _latest(base, read, option)
    except (UnsafeDataset, VersionError) as e:
        raise DataError(f"{option} {e}") from None
    except ValueError as e:  # a file over its bound
        raise DataError(str(e)) from None
    if got is not None and pinned is not None:
        check_record(base, got[0], pinned, option=option)
    return got


def _latest(base: str, read: Read, option: str) -> tuple[DatasetVersion, bytes] | None:
    latest = resolve_ref(None, read, where=base)
    if latest is None:
        return None
    # the record manifest.json copies (what the run pins, and what a resume reads back), compared by bytes: one
    # read and one parse of manifest.json at start-up, whatever the number of versions
    name = version_name(latest.number)
    data = read(name, LIMITS.manifest_bytes)
    if data is None and latest.number == 1:  # no version records yet: manifest.json is version 1
        return _version(MANIFEST_NAME, latest.data, 1, None), latest.data
    if data is None:
        raise DataError(
            f"{option} {base}: its {MANIFEST_NAME} says version {latest.number}, but "
            f"{version_name(latest.number)} is not there: the dataset is damaged or half copied; copy it again "
            "(or pass DIR@vN of a version it holds)"
        )
    if data != latest.data:
        raise DataError(
            f"{option} {base}: its {MANIFEST_NAME} is not the byte copy of {name} (version "
            f"{latest.number}) that a build writes: it was edited or replaced; copy the dataset again, or pass "
            f"DIR@v{latest.number}"
        )
    return _version(name, data, latest.number, None), data


def _pinned(base: str, ref: str | None, read: Read, pinned: dict, option: str) -> tuple[DatasetVersion, bytes]:
    number = pinned.get("version")
    try:
        found = resolve_ref(ref if ref is not None else f"v{number}", read, where=base)
    except VersionError as e:
        if ref is not None:
            raise
        raise DataError(
            f"{option} {base}: this run trained on its version {number} (RUN/run.json), which the dataset no "
            f"longer holds ({e}); it was removed (`vlmprep gc` keeps tagged versions): restore it, or pass "
            "--no-resume to start over on the data as it is"
        ) from None
    return _version(found.name, found.data, found.number, ref), found.data


def _version(name: str, data: bytes, number: int, ref: str | None) -> DatasetVersion:
    return DatasetVersion(number, name, hashlib.sha256(data).hexdigest(), ref)


def check_record(base: str, got: DatasetVersion, want: dict, *, option: str = "--data") -> None:
    """A resume's check of a version record against what RUN/run.json recorded of it (`want`: DatasetVersion.entry):
    the same number and the same bytes (sha256), else one DataError line naming both."""
    if got.number != want.get("version"):
        raise DataError(
            f"{option} {base}@{got.ref} is version {got.number}, but this run trained on version "
            f"{want.get('version')} (RUN/run.json): resume with {base} (the run's own version) or "
            f"{base}@v{want.get('version')}, or pass --no-resume to start over"
        )
    if got.sha256 != want.get("sha256"):
        raise DataError(
            f"{option} {base}: {got.record} (version {got.number}) is not the record this run trained on (sha256 "
            f"{str(want.get('sha256'))[:12]}... recorded in RUN/run.json, {got.sha256[:12]}... now): the version "
            "changed after the run read it; restore it, or pass --no-resume to start over on the data as it is"
        )


def source_entry(spec, ds) -> dict:
    """One dataset of the run (`spec`: its DataSpec, `ds`: its DataSource) as RUN/run.json records the version it
    reads: its name, path, base, shard and sample counts, and the version (number, record, sha256; None for shards
    named without a dataset: a pattern without a manifest beside it, pipe:)."""
    counted = all(s.num_samples is not None for s in ds.shards)
    return {
        "name": spec.name,
        "path": spec.path,
        "dataset": ds.base or None,
        "shards": len(ds.shards),
        "samples": sum(s.num_samples for s in ds.shards) if counted else None,
        **(ds.version.entry() if ds.version else {"version": None, "record": None, "sha256": None, "ref": None}),
    }


def epoch_entry(epoch: int, step: int, specs, datasets) -> dict:
    """The versions the run's datasets are read at from `epoch` on (which began after `step` steps)."""
    return {"epoch": epoch, "step": step, "datasets": [source_entry(s, d) for s, d in zip(specs, datasets)]}


def run_versions(specs, datasets, eval_specs, eval_sets, recorded: dict | None) -> dict:
    """RUN/run.json's `versions`: `data`, the versions the datasets were read at, one entry per epoch where they
    changed (a resumed run keeps its `recorded` history; a fresh one starts it at epoch 0), `eval_data`, the
    versions of the eval sets this start read, and a --follow run's `schedule_steps` where it recorded one."""
    history = list((recorded or {}).get("data") or []) or [epoch_entry(0, 0, specs, datasets)]
    out = {"data": history, "eval_data": [source_entry(s, d) for s, d in zip(eval_specs, eval_sets)]}
    if "schedule_steps" in (recorded or {}):  # a --follow run's LR schedule length, fixed at its start
        out["schedule_steps"] = recorded["schedule_steps"]
    return out


def _entry_ok(e) -> bool:
    return (
        isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and isinstance(e.get("path"), str)
        and (
            e.get("version") is None
            or isinstance(e["version"], int)
            and not isinstance(e["version"], bool)
            and isinstance(e.get("sha256"), str)
        )
        and isinstance(e.get("shards"), int)
    )


def check_pins(value, where: str) -> dict | None:
    """RUN/run.json's `versions` as read back (None: a run from before versions were recorded), checked for the shape
    run_versions writes; DataError naming `where` otherwise."""
    if value is None:
        return None
    history = value.get("data") if isinstance(value, dict) else None
    ok = (
        isinstance(history, list)
        and history
        and all(
            isinstance(h, dict)
            and all(
                isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0 for k in ("epoch", "step")
            )
            and isinstance(h.get("datasets"), list)
            and all(_entry_ok(e) for e in h["datasets"])
            for h in history
        )
        and [h["epoch"] for h in history] == sorted({h["epoch"] for h in history})
        and isinstance(value.get("eval_data", []), list)
        and (type(value.get("schedule_steps", 1)) is int and value.get("schedule_steps", 1) > 0)
        and all(_entry_ok(e) for e in value.get("eval_data", []))
    )
    if not ok:
        raise DataError(
            f"{where}: its `versions` (the dataset versions the run read) are not what the trainer writes; refusing "
            "to resume on data it cannot name: pass --no-resume to start over, or another --out"
        )
    return value


def data_pin(pins: dict | None, i: int, spec) -> dict | None:
    """What a resumed run recorded of the version its `i`-th dataset (`spec`) reads now (its newest history entry),
    where it recorded one for a dataset of that name; None: resolve as a fresh run does."""
    history = (pins or {}).get("data") or []
    entries = history[-1]["datasets"] if history else []
    e = entries[i] if i < len(entries) else None
    return e if e is not None and e["name"] == spec.name and e["version"] is not None else None


def eval_pin(pins: dict | None, i: int, spec) -> dict | None:
    """What a resumed run recorded of the version its `i`-th eval set read, where that set is named as then (the eval
    sets may change on resume: another one is read as a fresh run reads it)."""
    entries = (pins or {}).get("eval_data") or []
    e = entries[i] if i < len(entries) else None
    same = e is not None and e["name"] == spec.name and e["path"] == spec.path
    return e if same and e["version"] is not None else None


def newer_version(ds, *, option: str = "--data") -> dict | None:
    """At an epoch boundary of a --follow run (rank 0): the version the dataset of `ds` (a DataSource read at a
    version) names now, as a pin ({version, sha256}) where it is newer than the one the run reads; None where its
    manifest.json still names that version with its bytes. A manifest.json that went back to an earlier version, that
    names the run's version with other bytes, or that is not its record's byte copy (replaced by another dataset's):
    one DataError line, never a silent switch."""
    base, now = ds.base, ds.version
    try:
        latest = resolve_ref(None, dataset_reader(base), where=base)
    except (UnsafeDataset, VersionError) as e:
        raise DataError(f"{option} {e}") from None
    except ValueError as e:
        raise DataError(str(e)) from None
    if latest is None:
        raise DataError(
            f"{option} {base}: its {MANIFEST_NAME} is gone while this run follows it (the dataset was removed or "
            "is being replaced); the run stops rather than guess its versions"
        )
    stop = "the run stops rather than switch to other data (`vlmprep versions` lists the dataset's versions)"
    if latest.number < now.number:
        raise DataError(
            f"{option} {base}: its {MANIFEST_NAME} went back to version {latest.number}, but this run already reads "
            f"version {now.number}: the dataset was replaced or restored from an older copy; {stop}"
        )
    if latest.number == now.number:
        if hashlib.sha256(latest.data).hexdigest() == now.sha256:
            return None
        raise DataError(
            f"{option} {base}: its {MANIFEST_NAME} names version {now.number}, the version this run reads, with "
            f"other bytes than its record {now.record}: the dataset was replaced (another dataset's manifest?); {stop}"
        )
    found = read_version(base, None, option=option)
    return None if found is None else {"version": found[0].number, "sha256": found[0].sha256}

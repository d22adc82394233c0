"""The dataset's manifests as frozen objects: DIR/manifest.json (Manifest, its ShardEntry list) and each task's
tasks/task-NNNNN.json (TaskManifest). JSON -> object at the boundary (Manifest.from_json checks format_version and
the schema's types once, as every reader needs them), object -> the same JSON with to_json (keys it does not know
kept). load_manifest: DIR -> Manifest, every path it names checked to stay inside DIR.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vlmprep.shards.dataset import MANIFEST_NAME, TaskFiles
from vlmprep.shards.format import LIMITS, READABLE_VERSIONS
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeDataset, dataset_file, dataset_paths, read_state
from vlmprep_schemas.limits import load_json, schema_problem
from vlmprep_schemas.versions import VersionError, local_reader, resolve_ref, split_ref


class ShardFormatError(UserError):
    """A dataset that is not a readable vlmprep dataset, or a member that breaks the format: one line naming it."""


class VersionRefError(ShardFormatError):
    """A version reference (DIR@vN, DIR@TAG) that is malformed, names no version the dataset keeps (gc removes old
    ones) or a tag whose record changed: the reference fails, not the dataset (verify says so in one line, not as a
    violation)."""


@dataclass(frozen=True, kw_only=True)
class JsonObject:
    """A frozen dataclass that is one JSON object: each field one key (KEYS names the key where it is no Python
    name), nested objects converted as NESTED says (a JsonObject class, [that class] for a list of them, or a
    (load, dump) pair), and the keys it does not know kept in `extra`, so that to_json(from_json(d)) == d. A field
    that defaults to None is absent from the JSON while it is None."""

    KEYS: ClassVar[dict[str, str]] = {}  # field name -> its JSON key, where they differ
    NESTED: ClassVar[dict[str, Any]] = {}  # field name -> how its value converts (above)
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, obj: dict):
        """The object a parsed JSON object describes (a missing required key: TypeError)."""
        known, keys = {}, set()
        for f in dataclasses.fields(cls):
            if f.name == "extra":
                continue
            key = cls.KEYS.get(f.name, f.name)
            keys.add(key)
            if key in obj:
                known[f.name] = _load(cls.NESTED.get(f.name), obj[key])
        return cls(**known, extra={k: v for k, v in obj.items() if k not in keys})

    def to_json(self) -> dict:
        """The JSON object (a dict, lists for tuples), as from_json read it."""
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.default is None):
                continue
            out[self.KEYS.get(f.name, f.name)] = _dump(self.NESTED.get(f.name), value)
        return out


def _load(kind, value):
    if kind is None:
        return value
    if isinstance(kind, list):
        return tuple(map(kind[0].from_json, value))
    return kind[0](value) if isinstance(kind, tuple) else kind.from_json(value)


def _dump(kind, value):
    if kind is None:
        return value
    if isinstance(kind, list):
        return [x.to_json() for x in value]
    return kind[1](value) if isinstance(kind, tuple) else value.to_json()


@dataclass(frozen=True, kw_only=True)
class FileEntry(JsonObject):
    """A file the manifest vouches for: a shard's sample index sidecar, or the dataset's sample index."""

    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class ShardEntry(JsonObject):
    """One shard as the manifest lists it: name, sample, token and image counts, size and sha256, its sidecar."""

    name: str
    num_samples: int
    num_tokens: int
    num_trainable_tokens: int
    num_images: int
    bytes: int
    sha256: str
    index: FileEntry | None = None

    NESTED = {"index": FileEntry}


@dataclass(frozen=True, kw_only=True)
class SavedProcessor(JsonObject):
    """The processor saved beside the dataset: the --processor spec it came from, its class, the fingerprint of the
    saved files and the dir (inside the dataset) that holds them; the model family it renders for and its tokenizer's
    size, every token id below it (None: a dataset built before they were recorded)."""

    spec: str
    class_name: str
    fingerprint: str
    dir: str
    family: str | None = None
    vocab_size: int | None = None

    KEYS = {"class_name": "class"}


@dataclass(frozen=True, kw_only=True)
class InputEntry(JsonObject):
    """One input file: its path, bytes and its share of the totals (None: a dataset built before they were kept)."""

    path: str
    bytes: int
    totals: dict | None = None
    mtime_ns: int | None = None  # the stamp it was built at: inputs an append added (a build before versions: none)
    etag: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanRef(JsonObject):
    """The plan a dataset was merged from: its task count and the sha256 of its plan.json."""

    tasks: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class Manifest(JsonObject):
    """DIR/manifest.json (schemas/manifest.schema.json), written last: its presence means the dataset is complete."""

    format_version: int
    vlmprep_version: str
    processor: SavedProcessor
    config: dict  # the resolved BuildConfig (BuildConfig.to_json) the dataset was built with
    image_format: str
    inputs: tuple[InputEntry, ...]
    shards: tuple[ShardEntry, ...]
    totals: dict  # counter name -> count (schema: the required ones, and any other)
    rejects: dict  # reject reason -> count, the reasons that occurred
    turns: dict | None = None  # the assistant-turn accounting (builder/totals.turn_coverage); None before it was kept
    plan: PlanRef | None = None
    sample_index: FileEntry | None = None
    version: dict | None = None  # a version record's own facts (number, parent, created, command, added); None: v1

    NESTED = {
        "processor": SavedProcessor,
        "inputs": [InputEntry],
        "shards": [ShardEntry],
        "plan": PlanRef,
        "sample_index": FileEntry,
    }

    @classmethod
    def from_json(cls, obj, *, where: str = MANIFEST_NAME) -> Manifest:
        """A parsed manifest (read from `where`), refused unless its format_version is one this vlmprep reads and its
        values have the schema's types (the paths it names are dataset_paths' to check)."""
        _check_manifest(obj, where)
        return super().from_json(obj)


def _check_manifest(manifest, where: str) -> None:
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise ShardFormatError(
            f"{where}: format_version {version!r} is not supported (this vlmprep reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}); upgrade vlmprep or rebuild the dataset"
        )
    problem = schema_problem(manifest, "manifest.schema.json")
    if problem:
        raise ShardFormatError(f"{where} does not match the manifest schema: {problem}")


@dataclass(frozen=True, kw_only=True)
class TaskManifest(JsonObject):
    """tasks/task-NNNNN.json, written last by its task: which plan, task and processor it belongs to, the records it
    read, its shards, totals (per input file too) and rejects. What merge reads; the first four may be missing from
    a file some other build left there (merge refuses it by them)."""

    plan: str | None = None  # the sha256 of the plan.json the task ran from
    task: int | None = None
    config: dict = field(default_factory=dict)
    fingerprint: str | None = None  # the saved processor's (key `processor`)
    records: dict  # the records the task read: {"first_position": its first input position, "count": how many}
    shards: tuple[ShardEntry, ...]
    totals: dict
    inputs: dict  # str(input file index) -> its share of the totals
    rejects: dict

    KEYS = {"fingerprint": "processor"}
    NESTED = {"shards": [ShardEntry]}

    @classmethod
    def from_json(cls, obj, *, where: str = "the task manifest") -> TaskManifest:
        """A parsed task manifest (read from `where`), refused in one line naming the field unless its shards, totals
        and rejects have the dataset manifest's types and bounds (a shard of -1 bytes would be blamed on storage)."""
        if not isinstance(obj, dict):
            raise ShardFormatError(f"{where} is not a JSON object; not a task manifest")
        for key in ("shards", "totals", "rejects"):
            problem = schema_problem(obj.get(key), f"manifest.schema.json#/properties/{key}")
            if problem:
                raise ShardFormatError(f"{where}: {key}{problem.removeprefix('it')}; remove it and run the task again")
        return super().from_json(obj)


def load_task_manifest(files: TaskFiles) -> TaskManifest | None:
    """A task's manifest, or None while the task is not complete."""
    try:
        return TaskManifest.from_json(json.loads(read_state(files.manifest)), where=str(files.manifest))
    except FileNotFoundError:
        return None


def dataset_path(d: Path, name: str) -> Path:
    """DIR/name for a file vlmprep reads by a fixed name (manifest.json, rejects.jsonl): refused when it is a symlink
    out of DIR, as every path a manifest names is."""
    try:
        return Path(dataset_file(str(d), name, where=str(d), what="file"))
    except UnsafeDataset as e:
        raise ShardFormatError(str(e)) from None


def open_dataset(value: str | Path) -> tuple[Path, Manifest]:
    """`DIR`, `DIR@vN` or `DIR@TAG` (vlmprep_schemas.versions.split_ref) -> (DIR, the manifest of that version; plain
    DIR: manifest.json, the latest), checked as load_manifest checks it: the one loader of every reader that takes a
    version. A missing version or tag, or a record that is not what its name says, is one ShardFormatError."""
    try:
        try:
            base, ref = split_ref(str(value))
        except VersionError as e:
            raise VersionRefError(str(e)) from None
        if ref is None:
            return Path(base), load_manifest(Path(base))
        d = Path(base)
        if not d.is_dir():
            raise ShardFormatError(f"{base}: no such dataset dir")
        try:
            found = resolve_ref(ref, local_reader(base), where=base)
        except VersionError as e:
            raise VersionRefError(str(e)) from None
        if found is None:
            raise ShardFormatError(f"{d}: manifest.json is missing: not a finished vlmprep build")
        where = str(d / found.name)
        manifest = Manifest.from_json(load_json(found.data, where, LIMITS.manifest_bytes), where=where)
        dataset_paths(base, manifest.to_json(), where=where)  # every name it gives stays inside DIR
    except ValueError as e:  # VersionError, UnsafeDataset, load_json's one line
        raise ShardFormatError(str(e)) from None
    return d, manifest


def load_manifest(d: Path) -> Manifest:
    """DIR/manifest.json, refused unless its format_version is one this vlmprep reads and every path it names stays
    inside DIR with a processor that asks for no custom code (vlmprep_schemas.boundary, as the trainer checks)."""
    p = dataset_path(d, MANIFEST_NAME)
    if not p.is_file():
        raise ShardFormatError(f"{d}: manifest.json is missing: not a finished vlmprep build (rerun `vlmprep build`)")
    try:
        size = p.stat().st_size
        if size > LIMITS.manifest_bytes:  # refused unread
            raise ValueError(f"{p} is {size} bytes, more than a reader accepts ({LIMITS.manifest_bytes})")
        raw = load_json(p.read_bytes(), str(p), LIMITS.manifest_bytes)
    except ValueError as e:
        raise ShardFormatError(str(e)) from None
    manifest = Manifest.from_json(raw, where=str(p))
    processor_dir(d, manifest)
    return manifest


def processor_dir(d: Path, manifest: Manifest) -> Path:
    """The dataset's saved processor dir, checked with every other path the manifest names (inside DIR, no custom
    code): the one way vlmprep finds it."""
    try:
        return Path(dataset_paths(str(d), manifest.to_json(), where=str(Path(d) / MANIFEST_NAME)).processor)
    except UnsafeDataset as e:
        raise ShardFormatError(str(e)) from None


def shard_paths(d: Path, manifest: Manifest, shard: str | None = None, *, present: bool = True) -> list[Path]:
    """The manifest's shards in order (or just `shard`, with or without .tar); each must exist (`present=False`:
    the caller checks each with shard_present as it reaches it, e.g. inspect's first samples from a partial copy)."""
    d = Path(d)
    names = [s.name for s in manifest.shards]
    if shard is not None:
        want = shard if shard.endswith(".tar") else shard + ".tar"
        if want not in names:
            raise ShardFormatError(
                f"--shard {shard}: no such shard in {d} (have {', '.join(names[:5]) or 'none'}"
                + (", ..." if len(names) > 5 else "")
                + ")"
            )
        names = [want]
    for n in names if present else ():
        shard_present(d / n)
    return [d / n for n in names]


def shard_present(path: Path) -> Path:
    """`path`, a shard the manifest lists; ShardFormatError where it is missing."""
    if not path.is_file():
        raise ShardFormatError(f"{path} is listed in the manifest but missing")
    return path

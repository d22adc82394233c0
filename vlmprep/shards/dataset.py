"""The dataset dir (--out): the names vlmprep gives its files, each task's state under tasks/, writes that land whole
or not at all (temp file, fsync, rename), and the sha256 that vouches for a finished file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vlmprep.shards.format import DATASET_INDEX_NAME
from vlmprep_schemas.boundary import open_no_follow
from vlmprep_schemas.versions import VERSIONS_DIR  # the version records, their id files and tags

MANIFEST_NAME = "manifest.json"  # written last: its presence means the dataset is complete
REJECTS_NAME = "rejects.jsonl"
# Beside a complete dataset that failed the build's checks (--max-reject-fraction, --min-turn-coverage): the error
# line. Such a dir is written to look at, not a finished dataset: a build with other options replaces it unasked.
FAILED_NAME = "build-failed.txt"
PLAN_NAME = "plan.json"
PROCESSOR_DIR = "processor"  # the saved processor that rendered the dataset
JOURNAL_NAME = "build-journal.json"  # an older build's journal: cleared with the rest of a dataset
NV_META = ".nv-meta"  # energon's MAIN_FOLDER_NAME
TASKS_DIR = "tasks"
LOCK_NAME = ".vlmprep.lock"  # held while a build or merge writes into the dir (builder/owner.py); removed after
# `vlmprep watch`'s own state in --out: WATCH_LOCK (a local --out: held while a watcher runs) and the leases of an --out
# in a bucket (WATCH_LEASE-000001 ...); never cleared by a build, never a dataset file (builder/watch_lease.py).
WATCH_LOCK = ".vlmprep.watch.lock"
WATCH_LEASE = ".vlmprep.watch.lease"
SHARD_GLOB = "shard-*.tar"  # every shard name plan.shard_prefix makes; a .tar of another name is never ours
TMP_SUFFIX = ".tmp"
# What a finished task leaves under tasks/: its manifest (written last), rejects and sample list.
TASK_SUFFIXES = (".json", ".rejects.jsonl", ".samples.jsonl")


# A later version's own rejects and sample index (shards/versions.py names them).
VERSION_FILES = ("rejects.v[0-9]*.jsonl", "samples.v[0-9]*.index.npy")


# The files of a dataset or plan in --out, by the names vlmprep gives them (shards and their temp and energon index
# files, manifest, rejects, plan and journal with their temp copies, the dataset's sample index, a later version's
# rejects and index): what a new plan clears, and nothing else.
DATASET_FILES = tuple(
    g
    for name in (
        SHARD_GLOB,
        MANIFEST_NAME,
        REJECTS_NAME,
        PLAN_NAME,
        JOURNAL_NAME,
        FAILED_NAME,
        DATASET_INDEX_NAME,
        *VERSION_FILES,
    )
    for g in (name, f"{name}.*")
)
# Everything a build writes into --out; anything else there is the user's, and a whole build refuses to mix in unasked.
BUILD_FILES = DATASET_FILES + (PROCESSOR_DIR, f"{PROCESSOR_DIR}.*", TASKS_DIR, NV_META, LOCK_NAME, VERSIONS_DIR)
BUILD_FILES += (WATCH_LOCK, f"{WATCH_LEASE}-*")


def is_ours(name: str, patterns: tuple[str, ...] = BUILD_FILES) -> bool:
    """Whether a name in --out (its first part, for a name inside a dir: `tasks/...`) is one vlmprep gives."""
    top = name.split("/", 1)[0]
    return any(fnmatch.fnmatch(top, g) for g in patterns)


def task_file(index: int, suffix: str) -> str:
    """tasks/task-00003.json (the task manifest), .journal.json, .rejects.jsonl, .samples.jsonl"""
    return f"{TASKS_DIR}/task-{index:05d}{suffix}"


def _task_file(suffix: str, doc: str) -> property:
    """A TaskFiles property: the task's file with this suffix."""
    return property(lambda self: self.path(suffix), doc=doc)


@dataclass(frozen=True)
class TaskFiles:
    """Where task `index` of a plan keeps its state inside the dataset dir (all but the shards under tasks/)."""

    out: Path
    index: int
    prefix: str  # its shard names start with this

    def path(self, suffix: str) -> Path:
        """The file of this task with `suffix` (tasks/task-NNNNN<suffix>)."""
        return self.out / task_file(self.index, suffix)

    manifest = _task_file(".json", "The task manifest, written last: its presence means the task is complete.")
    journal = _task_file(".journal.json", "The task's resume journal.")
    rejects = _task_file(".rejects.jsonl", "The task's rejects, once the task ends.")
    partial_rejects = _task_file(
        ".rejects.jsonl.partial", "The task's rejects while it runs (renamed to `rejects` when it ends)."
    )
    samples = _task_file(
        ".samples.jsonl",
        "The task's per-sample rows (a record's first also carries its turn accounting), which merge reads.",
    )
    partial_samples = _task_file(
        ".samples.jsonl.partial", "The task's per-sample rows while it runs (renamed to `samples` when it ends)."
    )

    def shards(self) -> list[Path]:
        """The task's shard files on disk, in name order."""
        return sorted(self.out.glob(f"{self.prefix}[0-9]*.tar"))


def write_bytes_atomic(path: Path, data: bytes, *, tmp_suffix: str = TMP_SUFFIX) -> None:
    """A reader, or a kill, sees the old file or the new one, never part of one. Where several processes may write
    the same file at once, each passes its own tmp_suffix."""
    path = Path(path)
    tmp = path.with_name(path.name + tmp_suffix)
    with open_no_follow(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    """Writes text (UTF-8) to `path` atomically (see write_bytes_atomic)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj) -> None:
    """Writes `obj` as indented, key-sorted JSON to `path` atomically: the same object is the same bytes."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

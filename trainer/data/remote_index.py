"""A remote sample index's local copy: a shard's sidecar fetched into the rank's shard cache dir, the dataset's one
index fetched once per node (one rank under a file lock, the others wait); each sha256-checked against the manifest
on the way in and kept for a resume. index.py reads them as it reads local ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from trainer import locks
from trainer.data.errors import DataError
from trainer.data.sources import IndexRef
from trainer.data.storage import StorageError, fetch
from vlmprep_schemas.boundary import UnsafeWrite, state_dir


def cache_name(url: str, name: str) -> str:
    """A remote file's name in the rank's shard cache: unique per URL, readable by its shard name."""
    return f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name.rsplit('/', 1)[-1][:80]}"


def fetched(ref: IndexRef, cache: Path) -> Path:
    """A remote index file's copy in the rank's cache dir (fetched, size and sha256 checked once; kept for a
    resume)."""
    local = Path(cache) / cache_name(ref.url, ref.url)
    if not local.is_file():
        _fetch(ref, local)
    return local


SHARED_INDEXES = "indexes"  # beside the ranks' cache dirs: the remote dataset indexes a node's ranks share


def fetched_shared(ref: IndexRef, cache: Path) -> Path:
    """A remote dataset's one sample index, which every rank reads: one copy per shard-cache dir (a node's ranks
    share it, or all ranks where that dir is on a shared filesystem), not one per rank: 48 bytes a sample of the
    dataset, fetched once under a file lock while the others wait, then kept for a resume. Named by the URL and the
    manifest's sha256 of it, so a dataset rebuilt at the same URL gets a copy of its own. Where the filesystem has no
    file locks, each rank fetches its own copy as before."""
    local = Path(cache).parent / SHARED_INDEXES / cache_name(f"{ref.url}#{ref.sha256}", ref.url)
    lock = local.with_name(local.name + ".lock")
    try:
        state_dir(local.parent)
        fd = locks.wait_for(lock, "the dataset's sample index, which one rank of a node fetches while the others wait")
    except (UnsafeWrite, TimeoutError) as e:
        raise DataError(str(e)) from None
    except OSError:  # no lock here (a read-only or lock-less file system): this rank fetches its own copy
        return fetched(ref, cache)
    if fd < 0:
        return fetched(ref, cache)
    try:
        if not local.is_file():
            _fetch(ref, local)  # to LOCAL.part, renamed once its size and sha256 are the manifest's
    finally:
        locks.unlock(fd)  # the lock file stays: a rank waiting on it must find the one it locks
    return local


def _fetch(ref: IndexRef, local: Path) -> None:
    """The index file at `ref` -> `local` (through LOCAL.part), its size and sha256 the manifest's, or a DataError."""
    try:
        state_dir(local.parent)
        fetch(ref.url, local, size=ref.num_bytes, sha256=ref.sha256)
    except (StorageError, UnsafeWrite) as e:
        raise DataError(str(e)) from None

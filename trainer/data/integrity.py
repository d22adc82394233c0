"""The data a run trains on is the data it started with: each shard's sha256 checked against the manifest the first
time a run reads it (a record in the rank's cache dir, keyed by the file's stat, spares a resume the hashing); every
read after that checks the file is still the one checked, and every step that the dataset's manifest still lists the
same shards. A change stops the run with one line naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.config import default
from trainer.data.errors import DataError
from trainer.data.index import ShardIndex, dataset_indexes, file_signature, index_shards, shard_index
from trainer.data.sources import REMOTE_OR_PIPE, DataSource, ShardRef
from vlmprep_schemas.boundary import MANIFEST_NAME, open_no_follow, read_state, state_dir
from vlmprep_schemas.limits import LIMITS
from vlmprep_schemas.versions import version_name

RECORD = "verified.json"  # in the rank's shard cache dir: the files this rank has hashed, by stat


def changed(where: str) -> DataError:
    """The one-line DataError for a dataset file (`where`) that changed or vanished while the run reads it."""
    return DataError(
        f"{where} changed or was removed while this run reads it (e.g. by a `vlmprep build --overwrite` "
        "of its dataset): the run stops rather than train on data other than it started with; start it "
        "again once the dataset is final"
    )


def check_unchanged(st: os.stat_result, signature: tuple[int, ...], where: str) -> None:
    """Refuse a file whose stat is not the one it had when this run checked it (no signature: nothing to check)."""
    if signature and file_signature(st) != signature:
        raise changed(where)


class ShardCheck:
    """One rank's sha256 checks of the shards it reads. `record` (a json file) remembers the files already hashed
    by (device, inode, size, mtime, ctime) and digest, so a resume hashes only what changed since; a file
    rewritten in any way gets a new ctime and is hashed again. enabled=False: only stats are taken. A shard verified
    with `defer` that needs hashing is only stat-ed and listed in `deferred`: a scheduled run's shard cache hashes it
    (verify_deferred) before any reader opens it, ahead of the read position, not all before step 1."""

    def __init__(self, record: Path | None, *, enabled: bool = default("verify_shards")):
        self.record, self.enabled, self.dirty = record, enabled, False
        self.known: dict[str, list] = {}
        self.deferred: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # path -> (url, sha256, its signature then)
        self._lock = threading.Lock()  # the shard cache's threads add to `known` while the training thread saves it
        self._hashing: dict[str, threading.Lock] = {}  # deferred path -> held while it is hashed (once)
        self._done: set[str] = set()  # deferred paths hashed and matched
        if record is not None and enabled:
            try:
                self.known = json.loads(read_state(record))
            except (OSError, ValueError):
                self.known = {}

    def verify(
        self, path: str, *, url: str, want: str | None, size: int | None = None, defer: bool = False
    ) -> tuple[int, ...]:
        """The file's signature, once it is there with the manifest's `size` (None: not checked) and its content is
        checked to hash to `want` (None: not checked; `defer`: left to verify_deferred). Each rank checks its own
        shards, so a missing or cut copy fails at start-up without every rank stat-ing the whole dataset."""
        try:
            st = os.stat(path)  # a stat, not an open, where nothing is to be hashed: one per shard of the rank
        except OSError as e:
            raise DataError(
                f"{url}: listed in its manifest but cannot be read ({e.strerror}); copy the dataset "
                "again or run `vlmprep verify`"
            ) from None
        if not stat.S_ISREG(st.st_mode):  # a dir's or a FIFO's size says nothing of a shard (nor "truncated")
            raise DataError(
                f"{url}: listed in its manifest as a shard, but it is not a plain file (a "
                f"{_kind(st.st_mode)}); copy the dataset again or run `vlmprep verify`"
            )
        if size is not None and st.st_size != size:
            raise DataError(
                f"{url}: {st.st_size} bytes but its manifest says {size}; the shard is truncated or was "
                "modified: copy it again and run `vlmprep verify DIR`"
            )
        signature = file_signature(st)
        # (a first start's record is empty: no abspath, a getcwd for a relative path, per shard)
        if not (self.enabled and want) or self.known and self.known.get(os.path.abspath(path)) == self._key(st, want):
            return signature
        if defer:
            self.deferred[path] = (url, want, signature)
            return signature
        return self._hash(path, url=url, want=want)

    def verify_deferred(self, path: str, *, between: Callable[[], None] = lambda: None) -> None:
        """Hash a deferred shard now; refuses it (one line) unless it is still the file start-up saw and hashes to
        its manifest's sha256. `between`: called between chunks, and while another thread hashes the same file."""
        url, want, signature = self.deferred[path]
        with self._lock:
            hashing = self._hashing.setdefault(path, threading.Lock())
        while not hashing.acquire(timeout=0.05):  # a shard in two sources of a mixture is gated twice, hashed once
            between()
        try:
            if path in self._done:
                return
            if self._hash(path, url=url, want=want, between=between) != signature:
                raise changed(url)
            self._done.add(path)
        finally:
            hashing.release()

    def _hash(self, path: str, *, url: str, want: str, between: Callable[[], None] = lambda: None) -> tuple[int, ...]:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                key = self._key(st, want)
                h = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    between()
        except OSError as e:
            raise DataError(f"cannot read shard {url}: {e}") from None
        got = h.hexdigest()
        if got != want:
            raise DataError(
                f"{url}: sha256 {got[:16]}..., but its manifest lists {want[:16]}...: the shard changed "
                "after it was built (modified, damaged, or a copy cut short); copy it again (or rebuild "
                "the dataset) and run `vlmprep verify DIR`"
            )
        with self._lock:
            self.known[os.path.abspath(path)] = key
            self.dirty = True
        return file_signature(st)

    @staticmethod
    def _key(st: os.stat_result, want: str) -> list:
        """What the record keeps of a hashed file: its signature, its ctime (any rewrite changes it) and digest."""
        return [*file_signature(st), st.st_ctime_ns, want]

    def save(self) -> None:
        """Writes the record of checked shards (atomically) when this run checked any new one."""
        with self._lock:
            if not (self.dirty and self.record is not None):
                return
            state_dir(self.record.parent)
            tmp = self.record.with_name(f"{self.record.name}.{os.getpid()}.tmp")
            with open_no_follow(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.known, sort_keys=True))
            os.replace(tmp, self.record)
            self.dirty = False


def _kind(mode: int) -> str:
    return {
        stat.S_IFDIR: "directory",
        stat.S_IFIFO: "FIFO",
        stat.S_IFSOCK: "socket",
        stat.S_IFCHR: "device",
        stat.S_IFBLK: "device",
        stat.S_IFLNK: "symlink",
    }.get(stat.S_IFMT(mode), "special file")


def expected_sha256(ds: DataSource) -> dict[str, str]:
    """Shard name -> sha256, from the dataset's manifest ({} without one: a pattern or pipe: source)."""
    return {s["name"]: s.get("sha256") for s in (ds.manifest or {}).get("shards", []) if isinstance(s, dict)}


def checked_index(
    shard: ShardRef, *, cache: Path, check: ShardCheck, want: str | None, defer: bool = False
) -> ShardIndex:
    """The shard's index (index.py); a local shard's content is checked first (`defer`: by the shard cache, later)
    and the signature it had then goes into the index (every read checks the file is still that one). A remote
    shard's bytes are checked by the shard cache as it fetches them (cache.py)."""
    if shard.url.startswith(REMOTE_OR_PIPE):
        return shard_index(shard, cache)
    signature = check.verify(shard.url, url=shard.url, want=want, size=shard.num_bytes, defer=defer)
    index = shard_index(shard, cache)
    if shard.index is not None:  # the build's sidecar: the tar itself is not read here
        return dataclasses.replace(index, signature=signature)
    if index.signature != signature:  # derived from the tar: the hash and the index read one file
        raise changed(shard.url)
    return index


def checked_indexes(
    shards: tuple[ShardRef, ...],
    ds: DataSource,
    *,
    cache: Path,
    check: ShardCheck,
    want: Callable[[ShardRef], str | None],
    defer: bool = False,
) -> tuple[ShardIndex, ...]:
    """checked_index of each of a dataset's shards (`want(shard)`: the sha256 to check it against, None: not
    hashed). Where the manifest lists the dataset's sample index, all their rows come from that one file
    (trainer/data/index.py dataset_indexes), so start-up opens one index file, not one per shard."""
    if ds.index is None or any(s.row is None for s in shards):
        return index_shards(shards, lambda s: checked_index(s, cache=cache, check=check, want=want(s), defer=defer))
    return dataset_indexes(
        ds.index,
        shards,
        rows=ds.index_rows,
        cache=cache,
        signature=lambda s: (
            ()
            if s.url.startswith(REMOTE_OR_PIPE)
            else check.verify(s.url, url=s.url, want=want(s), size=s.num_bytes, defer=defer)
        ),
    )


def check_local_shards(shards: list[ShardRef], ds: DataSource, check: ShardCheck) -> dict[str, tuple[int, ...]]:
    """Streamed local shards (eval sets): each checked, url -> signature; remote ones are left to their size and
    sample counts."""
    want = expected_sha256(ds)
    return {
        s.url: check.verify(s.url, url=s.url, want=want.get(s.name), size=s.num_bytes)
        for s in shards
        if not s.url.startswith(REMOTE_OR_PIPE)
    }


@dataclass
class _Watched:
    path: Path  # the version's record, or manifest.json of a dataset that has no version records yet
    signature: tuple[int, ...]
    listing: list
    sha256: str | None  # of the record's bytes, where the run read a version record


def _listing(manifest: dict) -> list:
    return [[s.get("name"), s.get("bytes"), s.get("sha256")] for s in manifest.get("shards", [])]


class DatasetWatch:
    """The local datasets' version records, checked every step (one stat each): the record of the version the run
    reads (versions/v00000N.json) removed, or rewritten with other bytes, means the version is being removed or
    replaced under the run. An append (a new version: a new record and manifest.json) changes neither. A dataset
    without version records is watched by its manifest.json: one removed or rewritten with another shard list means a
    build is replacing the dataset under the run; rewritten with the same list (the same build run again) changes
    nothing, and so does its first append (which records the same bytes as versions/v000001.json)."""

    def __init__(self, datasets: list[DataSource]):
        self.watched = []
        for ds in datasets:
            if ds.manifest is None or not ds.shards or ds.shards[0].url.startswith(REMOTE_OR_PIPE):
                continue
            base = Path(ds.base) if ds.base else Path(ds.shards[0].url).parent
            path = base / (ds.version.record if ds.version else MANIFEST_NAME)
            sha = ds.version.sha256 if ds.version else None
            try:
                self.watched.append(_Watched(path, file_signature(os.stat(path)), _listing(ds.manifest), sha))
            except OSError:
                raise changed(str(path)) from None

    def check(self) -> None:
        """Raises the `changed` DataError when a watched record is gone or holds other bytes, or a watched
        manifest.json lists other shards than at the start; a stat that still matches spares the read."""
        for w in self.watched:
            try:
                st = os.stat(w.path)
                if file_signature(st) == w.signature:
                    continue
            except OSError:
                st = None
            if w.path.name == MANIFEST_NAME and self._recorded(w):
                continue
            if st is None or not self._same(w):
                raise changed(str(w.path))
            w.signature = file_signature(st)

    @staticmethod
    def _same(w: _Watched) -> bool:
        try:
            data = read_state(w.path, LIMITS.manifest_bytes)
            if w.path.name != MANIFEST_NAME:
                return hashlib.sha256(data).hexdigest() == w.sha256
            return _listing(json.loads(data)) == w.listing
        except (OSError, ValueError, AttributeError):
            return False

    @staticmethod
    def _recorded(w: _Watched) -> bool:
        """A dataset without records appended to: its version 1 recorded as versions/v000001.json, the bytes the run
        read (the watch moves to it); False where there is no such record."""
        record = w.path.parent / version_name(1)
        try:
            data = read_state(record, LIMITS.manifest_bytes)
            st = os.stat(record)
        except (OSError, ValueError):
            return False
        if w.sha256 is None or hashlib.sha256(data).hexdigest() != w.sha256:
            return False
        w.path, w.signature = record, file_signature(st)
        return True

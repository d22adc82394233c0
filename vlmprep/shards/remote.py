"""A dataset URL (s3://, gs://, hf://, http(s)://; memory:// in tests) -> a local copy in the cache, which verify, stats
and inspect then read as any dataset dir: manifest.json first (bounded, its names checked), then exactly the files it
names, each bounded and checked against the manifest's size and sha256 where it gives them; manifest.json lands last.
A file the copy holds already is kept only while its object in the store still has the stamp (size, ETag / version,
time) it had when it was fetched (.stamps.json): one changed or gone in the store since is fetched again and checked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from vlmprep.ingest import READ_BLOCK, LocationError, stamp_of_info, url_fs
from vlmprep.shards.dataset import MANIFEST_NAME, sha256_file, write_bytes_atomic
from vlmprep.shards.manifest import Manifest, ShardFormatError
from vlmprep.shards.versions import manifest_number, rejects_file
from vlmprep.types import UserError
from vlmprep_schemas.boundary import (
    REMOTE,
    UnsafeDataset,
    UnsafeWrite,
    dataset_file,
    dataset_paths,
    is_plain_path,
    open_fd_no_follow,
    open_no_follow,
    read_state,
    state_dir,
)
from vlmprep_schemas.limits import LIMITS, load_json
from vlmprep_schemas.processor_dir import MAX_CONFIG_BYTES, MAX_VOCAB_BYTES, PROCESSOR_FILES
from vlmprep_schemas.versions import MAX_TAG_BYTES, resolve_ref, split_ref, tag_file, version_name, version_number

CACHE_SUBDIR = "datasets"  # under $VLMPREP_CACHE (default ~/.cache/vlmprep): one dir per dataset URL
LOCK_NAME = ".fetch.lock"  # held while a copy is fetched: two commands on one URL take turns, never mix .part files
STAMPS_NAME = ".stamps.json"  # each kept file -> its object's stamp when it was fetched (locations.stamp_of_info)
# rejects.jsonl has no size in the manifest: a bound all the same (stats holds every line in memory anyway).
REJECTS_BYTES = 4 << 30
_VOCABULARIES = ("tokenizer.json", "vocab.json", "tekken.json")  # tens of MB, where a config is KBs


class FetchError(UserError):
    """A dataset URL that cannot be copied: missing, unreadable, or its bytes not what its manifest says. One line
    naming the URL (never a credential: a URL with one is refused before it is used)."""


@dataclass(frozen=True)
class _File:
    """One file to copy: its name inside the dataset, the most bytes read of it, and what the manifest says of it."""

    name: str
    limit: int
    size: int | None = None
    sha256: str | None = None
    optional: bool = False  # absent at the URL: none here either (a file this processor does not have)


def is_dataset_url(value: str) -> bool:
    """Whether a command's DIR argument names a URL (any scheme://) rather than a local path."""
    head, sep, _ = value.partition("://")
    return bool(sep) and head.isascii() and head[:1].isalpha() and all(c.isalnum() or c in "+.-" for c in head)


def cache_dir(url: str) -> Path:
    """Where the copy of dataset `url` lives: $VLMPREP_CACHE/datasets/<sha256(url)[:16]> (~/.cache/vlmprep without
    $VLMPREP_CACHE), one dir per URL (a trailing / ignored; URL@v3 is another URL) so a second run finds what the
    first fetched."""
    from vlmprep.processors.builtin import default_cache_dir  # the one place the cache root is decided

    return default_cache_dir() / CACHE_SUBDIR / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def fetch_dataset(
    url: str,
    *,
    shards: Sequence[str] | Callable[[Manifest], Sequence[str] | None] | None = None,
    say: Callable[[str], None] | None = None,
    on_file: Callable[[int, int], None] | None = None,
    since: str | None = None,
) -> Path:
    """Dataset `url` -> its local copy (cache_dir), ready for any reader of a dataset dir. Fetched: manifest.json
    (at most LIMITS.manifest_bytes, its names checked as every reader checks them: plain names inside the dataset),
    the shards and their sample indexes, the dataset's sample index, rejects.jsonl and the processor's own files
    (vlmprep_schemas.processor_dir.PROCESSOR_FILES; not additional_chat_templates/, which no reader of shards needs).
    `shards`: only these of the manifest's shards (names with or without .tar; unknown names are left to the reader
    to refuse) and their indexes, or a function of the manifest that names them; None: all, with the dataset's
    index. Trade-off: a file the manifest gives a sha256
    for is kept when the copy already has it (read once to hash it); rejects.jsonl and the processor files are
    fetched on every call. Files of an older copy that the manifest no longer names are removed; manifest.json is
    written last. `say(line)`: one line when the copy starts; `on_file(done, total)`: after each file. `since` (vM
    or a tag, for `stats --since`): that version's record (and tag file) copied too, resolved and checked here.
    Raises FetchError (a UserError): one line."""
    if not url.startswith(REMOTE):
        raise FetchError(
            f"{url}: not a dataset location this vlmprep reads: a local dir, or a URL of "
            f"{', '.join(s for s in REMOTE if s != 'memory://')}"
        )
    try:
        base, ref = split_ref(url)  # URL@vN, URL@TAG: that version's record is the copy's manifest.json
        base = base.rstrip("/")
        fs, root = url_fs(base, where="the dataset URL")  # a URL with credentials in it: refused, never echoed
    except (LocationError, ValueError) as e:
        raise FetchError(str(e)) from None
    store = _Store(fs, root.rstrip("/"), base)
    name, data = MANIFEST_NAME, None
    try:
        if ref is None:
            data = store.read_or_none(MANIFEST_NAME, LIMITS.manifest_bytes)
        else:
            found = resolve_ref(ref, store.read_or_none, where=base)
            name, data = found.name, found.data
    except ValueError as e:  # VersionError, a record over its bound
        raise FetchError(str(e)) from None
    if data is None:
        raise FetchError(
            f"{url}: no {MANIFEST_NAME} there: not a vlmprep dataset, or not a finished one (a build writes its "
            "manifest last), or not at this URL"
        )
    manifest, named, processor = _manifest(data, base, name)
    extra = _since_files(store, base, since) if since is not None else {}
    files = _files(manifest, processor, shards(manifest) if callable(shards) else shards)
    dest = cache_dir(url)
    try:  # the copy's dir and every dir in it: no link planted there is written through or pruned
        state_dir(dest, root=dest.parent.parent)
        if say:
            say(f"copying {url} into {dest} (files already there with the manifest's sha256 are kept)")
        with _locked(dest / LOCK_NAME):
            was, now = _load_stamps(dest), {}
            for k, f in enumerate(files):
                now[f.name] = store.fetch(f, dest, was.get(f.name))
                if on_file:
                    on_file(k + 1, len(files))
            for extra_name, extra_data in extra.items():
                state_dir((dest / extra_name).parent, root=dest)
                write_bytes_atomic(dest / extra_name, extra_data)
            _prune(dest, keep=named | {f.name for f in files} | set(extra))
            stamps = json.dumps({k: v for k, v in now.items() if v}, sort_keys=True).encode()
            write_bytes_atomic(dest / STAMPS_NAME, stamps)
            write_bytes_atomic(dest / MANIFEST_NAME, data)
    except UnsafeWrite as e:
        raise FetchError(str(e)) from None
    return dest


def _since_files(store: _Store, base: str, since: str) -> dict[str, bytes]:
    """The record `since` names (and its tag file, for a tag), read and checked as resolve_ref checks them: what a
    copy needs to resolve DIR@since as the store does."""
    try:
        found = resolve_ref(since, store.read_or_none, where=base)
        out = {version_name(found.number): found.data}
        if version_number(since) is None:
            out[tag_file(since)] = store.read_or_none(tag_file(since), MAX_TAG_BYTES) or b""
    except ValueError as e:  # VersionError, a record over its bound
        raise FetchError(f"--since: {e}") from None
    return out


def _load_stamps(dest: Path) -> dict:
    """The copy's .stamps.json as far as it is well formed ({} where not: every file is then checked by a fetch)."""
    try:
        got = load_json(
            read_state(dest / STAMPS_NAME, LIMITS.manifest_bytes), str(dest / STAMPS_NAME), LIMITS.manifest_bytes
        )
    except (OSError, ValueError, UnsafeWrite):  # a link or FIFO planted there: every file checked by a fetch
        return {}
    return got if isinstance(got, dict) else {}


def _manifest(data: bytes, base: str, name: str = MANIFEST_NAME) -> tuple[Manifest, set[str], str]:
    """The manifest's bytes -> (the manifest, every file name it gives inside the dataset: shards and sample indexes,
    its processor dir's name), checked as every reader of a dataset checks them (Manifest.from_json,
    boundary.dataset_paths: plain names inside the dataset, no '..', absolute path or URL), before any is fetched."""
    where = f"{base}/{name}"
    try:
        manifest = Manifest.from_json(load_json(data, where, LIMITS.manifest_bytes), where=where)
        paths = dataset_paths(base, manifest.to_json(), where=where)
    except (ValueError, ShardFormatError) as e:  # UnsafeDataset is a ValueError
        raise FetchError(str(e)) from None
    cut = len(base) + 1
    named = {u[cut:] for u in (*paths.shards, *paths.indexes, paths.sample_index) if u is not None}
    return manifest, named, paths.processor[cut:]


def _files(manifest: Manifest, processor: str, shards: Sequence[str] | None) -> list[_File]:
    """What to copy, in the order a reader wants it: the processor's files, rejects.jsonl, the shards (each with its
    sample index), the dataset's sample index."""
    out = [
        _File(
            f"{processor}/{n}",
            MAX_VOCAB_BYTES if n in _VOCABULARIES or not n.endswith(".json") else MAX_CONFIG_BYTES,
            optional=True,
        )
        for n in PROCESSOR_FILES
    ]
    # every version's own rejects up to this one (rejects.jsonl, rejects.v000002.jsonl, ...)
    out += [_File(rejects_file(n), REJECTS_BYTES, optional=True) for n in range(1, manifest_number(manifest) + 1)]
    wanted = None if shards is None else {s if s.endswith(".tar") else s + ".tar" for s in shards}
    for s in manifest.shards:
        if wanted is None or s.name in wanted:
            out.append(_File(s.name, s.bytes, s.bytes, s.sha256))
            if s.index:
                out.append(_File(s.index.name, s.index.bytes, s.index.bytes, s.index.sha256))
    whole = manifest.sample_index
    if whole and shards is None:
        out.append(_File(whole.name, whole.bytes, whole.bytes, whole.sha256))
    return out


def _reason(e: BaseException) -> str:
    """A store library's exception -> the first line of what it says (each library raises its own kinds)."""
    if isinstance(e, FileNotFoundError):
        return "no such file or object"
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


@dataclass(frozen=True)
class _Store:
    """The dataset's prefix in its store: `root` is its path for fsspec, `base` its URL (what messages name)."""

    fs: object
    root: str
    base: str

    def chunks(self, name: str, limit: int) -> Iterator[bytes]:
        """File `name` in READ_BLOCK range reads, stopped one byte past `limit` whatever the server sends (one that
        ignores Range, never ends, or gzip-encodes far more than it sends). FileNotFoundError where it is absent;
        FetchError naming its URL on any other fault."""
        url = f"{self.base}/{name}"
        try:
            f = self.fs.open(f"{self.root}/{name}", "rb", block_size=READ_BLOCK, cache_type="readahead")
        except FileNotFoundError as e:
            # fsspec's HTTP calls every failed request "not found": a refused connection or a 403 is no missing file
            if e.__cause__ is None or getattr(e.__cause__, "status", None) in (404, 410):
                raise
            raise FetchError(f"cannot read {url}: {_reason(e.__cause__)}") from None
        except Exception as e:  # noqa: BLE001 - botocore, aiohttp, huggingface_hub each raise their own
            raise FetchError(f"cannot read {url}: {_reason(e)}") from None
        got = 0
        with f:
            while got <= limit:
                try:
                    chunk = f.read(min(READ_BLOCK, limit + 1 - got))
                except Exception as e:  # noqa: BLE001
                    raise FetchError(f"cannot read {url}: {_reason(e)}") from None
                if not chunk:
                    return
                got += len(chunk)
                yield chunk

    def read_or_none(self, name: str, limit: int) -> bytes | None:
        """A whole small file of at most `limit` bytes, None where it is absent (vlmprep_schemas.versions.Read)."""
        try:
            data = b"".join(self.chunks(name, limit))
        except FileNotFoundError:
            return None
        if len(data) > limit:
            raise FetchError(f"{self.base}/{name} is more than {limit} bytes, more than a reader accepts; refusing it")
        return data

    def stamp(self, name: str) -> dict | None:
        """The object's stamp in the store now (asked, never from a listing cached earlier); None where it is gone."""
        path = f"{self.root}/{name}"
        try:
            self.fs.invalidate_cache(path)
            return stamp_of_info(self.fs.info(path))
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - botocore, aiohttp, huggingface_hub each raise their own
            raise FetchError(f"cannot read {self.base}/{name}: {_reason(e)}") from None

    def fetch(self, f: _File, root: Path, was: dict | None = None) -> dict | None:
        """One file into the copy at `root` (NAME.part, opened without following a link, then renamed over NAME),
        unless the copy has it with the manifest's size and sha256 already and its object in the store still has
        stamp `was` (what it had when the copy was fetched). A size or sha256 other than the manifest's is one
        FetchError naming its URL, and nothing is kept of it. Returns the object's stamp (files with a sha256)."""
        url = f"{self.base}/{f.name}"
        if is_plain_path(f.name):  # the copy's dirs are real ones of its own: a link planted there is refused
            state_dir(Path(root, f.name).parent, root=root)
        try:  # and no link at a file's name is followed out of the copy
            dest = Path(dataset_file(str(root), f.name, where=str(root), what="file"))
        except UnsafeDataset as e:
            raise FetchError(str(e)) from None
        now = self.stamp(f.name) if f.sha256 else None  # taken before the read: a change after it shows next time
        if (
            f.sha256
            and now is not None
            and now == was
            and dest.is_file()
            and not dest.is_symlink()
            and dest.stat().st_size == f.size
            and sha256_file(dest) == f.sha256
        ):
            return now
        part = dest.with_name(dest.name + ".part")
        h, got = hashlib.sha256(), 0
        try:
            with open_no_follow(part, "wb") as out:
                for chunk in self.chunks(f.name, f.limit):
                    h.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
        except FileNotFoundError:
            part.unlink(missing_ok=True)
            if not f.optional:
                raise FetchError(f"cannot read {url}: no such file or object, but the manifest lists it") from None
            dest.unlink(missing_ok=True)  # an older copy's file this dataset no longer has
            return None
        except OSError as e:  # the cache's disk (full, read-only), or a link planted at NAME.part
            part.unlink(missing_ok=True)
            raise FetchError(f"cannot copy {url} into {root}: {_reason(e)}") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        problem = (
            f"more than {f.limit} bytes, more than a reader accepts"
            if got > f.limit
            else f"{got} bytes, but the manifest lists {f.size}"
            if f.size is not None and got != f.size
            else "its sha256 differs from the manifest's"
            if f.sha256 and h.hexdigest() != f.sha256
            else None
        )
        if problem:
            part.unlink()
            raise FetchError(f"{url}: {problem}: changed or damaged in storage; refusing it")
        os.replace(part, dest)
        return now


def _prune(root: Path, keep: set[str]) -> None:
    """Remove what the copy holds beyond `keep` (names inside it) and the lock: an older manifest's shards (verify
    would call them unlisted), a processor file the dataset no longer has, a .part a killed run left."""
    for top, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(top, n), root).replace(os.sep, "/")
            if rel not in keep and rel not in (LOCK_NAME, MANIFEST_NAME, STAMPS_NAME):
                os.unlink(os.path.join(top, n))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created; never through a planted link), released on exit."""
    fd = open_fd_no_follow(path, "lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

"""Where an input may be: a local path, or an object in a store read through fsspec (s3://, gs://, hf:// datasets,
http(s)://), each library taking credentials from its own environment and config; a URL with credentials in it is
refused, so none is ever printed or written into a plan or manifest. A remote input is read as a stream of range
reads (never fetched whole first) and stamped by its size and ETag / version, so a plan notices it changed; the plan's
stamp travels with it (RemoteFile.expect) and every read is checked against it. http(s) goes through web.py (bounded
waits, no length, one wording per failure), the other stores through fsspec.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import vlmprep.ingest.web as web
from vlmprep.types import UserError
from vlmprep_schemas.boundary import UnsafeDataset, refuse_credentials

URL = re.compile(r"^(s3|gs|gcs|hf|https?|memory)://", re.I)  # memory://: fsspec's in-process store (tests)
# The package each scheme needs beyond fsspec, and how to install it.
_EXTRAS = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp"}
READ_BLOCK = 4 << 20  # a remote input is read in range requests of this size


class LocationError(UserError):
    """An input URL that cannot be listed or read: one line naming it (never a credential)."""


@dataclass(frozen=True)
class RemoteFile:
    """An input object in a store, by its URL (what the plan and manifest record), and the stamp (stamp()) a read of
    it must find, where one was taken: the plan's."""

    url: str
    expect: dict | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        """The object's last path part, as Path.name."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        return self.url


Input = Path | RemoteFile


def is_url(value: str) -> bool:
    """Whether an --in value names a store's object (or prefix, or glob) rather than a local path."""
    return bool(URL.match(value))


def as_input(value: str, expect: dict | None = None) -> Input:
    """A plan's recorded input path back to an input (a remote one to be read as `expect`, its plan's stamp)."""
    return RemoteFile(value, expect) if is_url(value) else Path(value)


def _web(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("http", "https")


def url_fs(url: str, where: str = "--in"):
    """(fsspec filesystem, path) of a URL; a URL with credentials in it, or a scheme whose package is missing, is one
    line naming `where` it was given."""
    try:
        refuse_credentials(url, where=where)
    except UnsafeDataset as e:
        raise LocationError(str(e)) from None
    try:
        import fsspec

        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        scheme = url.split("://", 1)[0].lower()
        package = _EXTRAS.get(scheme, str(e.name))
        raise LocationError(f"{url}: {scheme}:// for {where} needs {package}: pip install {package}") from None


def why(e: BaseException) -> str:
    """A store library's exception as a short reason (its first line)."""
    if isinstance(e, FileNotFoundError):
        return "no such object"
    if isinstance(e, PermissionError):
        return "access denied"
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def expand_url(pattern: str, suffixes: tuple[str, ...]) -> list[RemoteFile]:
    """A URL -> the input objects it names, sorted: a glob, a prefix ("dir") listed recursively for `suffixes`, or
    one object."""
    if _web(pattern):
        return [RemoteFile(u) for u in _expand_web(pattern, suffixes)]
    fs, path = url_fs(pattern)
    scheme = pattern.split("://", 1)[0]
    try:
        if any(ch in path for ch in "*?["):
            found = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            found = [p for p in fs.find(path) if p.endswith(suffixes)]
        elif fs.isfile(path):
            found = [path]
        else:
            raise LocationError(f"input not found: {pattern}")
    except LocationError:
        raise
    except Exception as e:  # noqa: BLE001 - each backend raises its own kinds
        raise LocationError(f"cannot list {pattern}: {why(e)}") from None
    return [
        RemoteFile(fs.unstrip_protocol(p) if "://" not in p else p)
        if scheme != "memory"
        else RemoteFile(f"memory://{p.lstrip('/')}")
        for p in sorted(found)
    ]


def _expand_web(pattern: str, suffixes: tuple[str, ...]) -> list[str]:
    """A web URL's objects: one (its stamp read: it exists), a listing of an index page (ending in /), or a glob."""
    try:
        refuse_credentials(pattern, where="--in")
    except UnsafeDataset as e:
        raise LocationError(str(e)) from None
    try:
        if any(ch in pattern.split("://", 1)[1].split("/", 1)[-1] for ch in "*["):
            return web.glob(pattern)
        if pattern.endswith("/"):
            return web.listing(pattern, lambda url: url.endswith(suffixes))
        web.head(pattern)  # a web server lists no dirs: asking would GET the object whole to look for links in it
        return [pattern]
    except web.WebError as e:
        raise LocationError(str(e)) from None


class _Guarded(io.RawIOBase):
    """A store's file whose every fault is an OSError naming the URL (the readers turn it into a read_error reject
    after the records read before it), whatever exception its library raises."""

    def __init__(self, f, url: str):
        self._f, self._url = f, url

    def _call(self, fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 - botocore, aiohttp, huggingface_hub each raise their own
            raise OSError(f"cannot read {self._url}: {why(e)}") from None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._call(self._f.read, len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        pos = self._call(self._f.seek, offset, whence)
        return self._f.tell() if pos is None else pos  # some of fsspec's files return None

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def open_input(p: Input):
    """An input as a binary file: a local one as it is, a remote one as a seekable stream of READ_BLOCK range reads
    (an OSError naming the URL on any fault)."""
    if isinstance(p, Path):
        return open(p, "rb")
    if _web(p.url):
        return io.BufferedReader(web.WebFile(p.url, block=READ_BLOCK, expect=p.expect), buffer_size=1 << 20)
    fs, path = url_fs(p.url)
    try:
        f = fs.open(path, "rb", block_size=READ_BLOCK, cache_type="readahead")
    except Exception as e:  # noqa: BLE001
        raise OSError(f"cannot read {p.url}: {why(e)}") from None
    # The object opened must be the one planned; s3fs then sends If-Match its ETag with every range read it makes.
    details = getattr(f, "details", None)
    if p.expect and isinstance(details, dict) and details:
        now = stamp_of_info(details)  # by size and tag: the time some stores give only in a listing
        differ = [
            f"{k} {p.expect.get(k)} when planned, {now[k]} now" for k in ("bytes", "etag") if p.expect.get(k) != now[k]
        ]
        if differ:
            f.close()
            raise OSError(f"cannot read {p.url}: it changed after the plan was made ({'; '.join(differ)})")
    return io.BufferedReader(_Guarded(f, p.url), buffer_size=1 << 20)


def stamp(p: Input) -> dict:
    """What says an input is unchanged: bytes and mtime_ns (local); for a remote one its size, its time where the
    store gives one, and `etag` (ETag, version id or checksum; else a hash of the listing's fields)."""
    if isinstance(p, Path):
        st = p.stat()
        return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if _web(p.url):
        try:
            refuse_credentials(p.url, where="--in")
            return web.head(p.url).as_dict()
        except (web.WebError, UnsafeDataset) as e:
            raise LocationError(str(e)) from None
    fs, path = url_fs(p.url)
    try:
        info = fs.info(path)
    except Exception as e:  # noqa: BLE001
        raise LocationError(f"cannot read {p.url}: {why(e)}") from None
    return stamp_of_info(info)


def stamp_of_info(info: dict) -> dict:
    """A store's listing fields (fsspec's info) -> the stamp: size, time, and a tag (ETag, version, checksum; else a
    hash of them)."""
    tag = next(
        (str(info[k]) for k in ("ETag", "etag", "VersionId", "version_id", "md5Hash", "blob_id", "lfs") if info.get(k)),
        None,
    )
    when = next(
        (info[k] for k in ("LastModified", "last_modified", "mtime", "updated", "created") if info.get(k)), None
    )
    mtime_ns = int(when.timestamp() * 1e9) if hasattr(when, "timestamp") else 0
    if tag is None:
        tag = hashlib.sha256(repr(sorted((k, str(v)) for k, v in info.items())).encode()).hexdigest()[:16]
    return {"bytes": int(info.get("size") or 0), "mtime_ns": mtime_ns, "etag": tag}


def size_of(p: Input) -> int:
    """An input's bytes (0 where it cannot be read now)."""
    try:
        return os.path.getsize(p) if isinstance(p, Path) else stamp(p)["bytes"]
    except (OSError, LocationError):
        return 0

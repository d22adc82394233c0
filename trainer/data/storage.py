"""Remote bytes: a dataset URL (http(s)://, s3://, gs://, hf://, memory://) -> a streaming file, the whole object, or a
local copy checked against the manifest's size and sha256. Read through fsspec (s3fs, gcsfs, huggingface_hub), each
library taking credentials from its own environment and config; this module never sees, prints or stores them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import time
from pathlib import Path
from typing import Callable

from vlmprep_schemas.boundary import REMOTE, UnsafeWrite, open_no_follow

CHUNK = 4 << 20
READ_TIMEOUT_S = 60.0  # --read-timeout: no byte for this long fails a read; see Pace for a server that drips
MIN_RATE = 64 << 10  # bytes/s a read must average once READ_TIMEOUT_S has passed
# The package each URL scheme needs beyond fsspec, and the extra that installs it.
_EXTRAS = {
    "s3": ("s3fs", "vlmprep[s3]"),
    "gs": ("gcsfs", "vlmprep[gcs]"),
    "gcs": ("gcsfs", "vlmprep[gcs]"),
    "hf": ("huggingface_hub", "huggingface_hub"),
    "http": ("aiohttp", "aiohttp"),
    "https": ("aiohttp", "aiohttp"),
}


class StorageError(RuntimeError):
    """A remote read that failed: one line naming the URL (its scheme's library message, never a credential)."""


def is_remote(url: str) -> bool:
    """Whether a URL is read through fsspec (s3, gs, hf, http(s)) rather than from the local filesystem."""
    return url.startswith(REMOTE)


def set_read_timeout(seconds: float) -> None:
    """The run's --read-timeout (before its first remote read; DataLoader workers fork with it)."""
    global READ_TIMEOUT_S
    READ_TIMEOUT_S = float(seconds)


def _options(url: str) -> dict:
    """Each backend's own read timeouts: no limit on a whole transfer (a big shard over a slow link is fine), a limit
    on a silence (aiohttp's default instead ends any request after 5 minutes, naming no limit)."""
    scheme = url.split("://", 1)[0]
    if scheme in ("http", "https"):
        import aiohttp

        t = READ_TIMEOUT_S
        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t)}}
    if scheme == "s3":
        return {"config_kwargs": {"connect_timeout": READ_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    return {}


def _fs(url: str):
    """The fsspec filesystem of a URL and the path in it; a missing backend is one line saying what to install."""
    try:
        import fsspec

        return fsspec.core.url_to_fs(url, **_options(url))
    except ImportError as e:
        scheme = url.split("://", 1)[0]
        package, install = _EXTRAS.get(scheme, (str(e.name), str(e.name)))
        raise StorageError(f"{url}: reading {scheme}:// needs {package}: pip install '{install}'") from None


class Pace:
    """A read that has run READ_TIMEOUT_S and averages under MIN_RATE is stopped: a server that drips a byte a
    second never trips the silence timeout, and would hold a fetcher (and the readers waiting on it) for days."""

    def __init__(self, url: str, what: str):
        self.url, self.what, self.t0 = url, what, time.monotonic()

    def check(self, got: int) -> None:
        """Raise StorageError where `got` bytes so far are too few for the time taken."""
        elapsed = time.monotonic() - self.t0
        if elapsed > READ_TIMEOUT_S and got < MIN_RATE * elapsed:
            raise StorageError(
                f"cannot {self.what} {self.url}: {got} bytes in {elapsed:.0f} s, under "
                f"{MIN_RATE >> 10} KiB/s after --read-timeout {READ_TIMEOUT_S:g} s: the server is too "
                "slow or stalled; try again, or raise --read-timeout"
            )


def _fail(url: str, what: str, e: BaseException) -> StorageError:
    cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
    if cause == "TooManyRedirects":  # fsspec's HTTP calls every failed request "not found"
        return StorageError(f"cannot {what} {url}: the server redirects it in a loop (or more than 10 times)")
    if "RedirectClientError" in cause:  # aiohttp's NonHttpUrl..., InvalidUrl...
        return StorageError(
            f"cannot {what} {url}: the server redirects it to {str(e.__cause__)[:200]}, which is not "
            "an http(s) URL; refusing to follow it"
        )
    if isinstance(e, FileNotFoundError):
        return StorageError(f"cannot {what} {url}: no such file or object")
    if isinstance(e, TimeoutError) or "Timeout" in type(e).__name__:  # asyncio's, fsspec's FSTimeoutError, botocore's
        return StorageError(
            f"cannot {what} {url}: no answer for --read-timeout {READ_TIMEOUT_S:g} s; try again, or "
            "raise --read-timeout"
        )
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return StorageError(f"cannot {what} {url}: {text[:300]}")


def read_url(url: str, limit: int) -> bytes:
    """A whole small remote object (a manifest, a processor config), refused (StorageError) past `limit` bytes. Read
    as a stream that stops one byte past the limit whatever the server does: one that ignores Range and sends on, one
    that never ends, one whose gzip-encoded body decodes to far more than it sent. The pieces are joined only for an
    object within the limit: a refused one costs its limit in memory, once."""
    chunks, got, pace = [], 0, Pace(url, "read")
    try:
        with open_url(url) as stream:
            while got <= limit:
                chunk = stream.read(min(CHUNK, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
                pace.check(got)
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - each backend raises its own kinds (FileNotFoundError, ClientError, ...)
        raise _fail(url, "read", e) from None
    if got > limit:
        raise StorageError(f"{url} is more than {limit} bytes, more than a reader accepts")
    return b"".join(chunks)


def open_url(url: str):
    """A remote object as a sequential binary stream (one GET, no range requests), for reading a shard in order;
    a `pipe:` command's output through webdataset's gopen."""
    if url.startswith("pipe:"):
        from webdataset.gopen import gopen

        return gopen(url)
    fs, path = _fs(url)
    try:
        return fs.open(path, "rb", block_size=0) if fs.protocol[0].startswith("http") else fs.open(path, "rb")
    except Exception as e:  # noqa: BLE001
        raise _fail(url, "open", e) from None


def _continued(url: str, have: int, n: int):
    """(stream at byte `have`, its first chunk of up to n bytes) by a range read, or (None, b"") where the store
    answers none: fsspec's HTTP file says so only on its first read ("doesn't appear to support range requests"),
    so that read is made here, where a refusal means "from the start", not a failed fetch on every restart."""
    stream = None
    try:
        fs, path = _fs(url)
        stream = fs.open(path, "rb", block_size=CHUNK)
        stream.seek(have)
        return stream, stream.read(n)
    except Exception:  # noqa: BLE001 - no range reads here, or the object changed: the caller starts over
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()
        return None, b""


def fetch(
    url: str, dest: Path, *, size: int | None, sha256: str | None, stopped: Callable[[], bool] = lambda: False
) -> None:
    """Copy `url` to `dest`: streamed to DEST.part with the sha256 computed on the way, renamed only when its size and
    sha256 are the manifest's. A .part left by a killed run is continued with a range read where the store supports
    them (else fetched again from the start). Raises StorageError; `stopped()` True abandons the copy (part kept)."""
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    h = hashlib.sha256()
    if os.path.lexists(part) and not stat.S_ISREG(os.lstat(part).st_mode):  # a planted link: never read or written
        raise StorageError(
            f"{part} is a symlink or special file where the cache writes a shard: refusing to write "
            "through it (someone may have planted it in the cache dir); remove it and run again"
        )
    have = part.stat().st_size if part.is_file() else 0
    if size is not None and have > size:
        have = 0
    if have:
        with open(part, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    pace = Pace(url, "fetch")
    try:
        stream, first = (
            _continued(url, have, CHUNK if size is None else min(CHUNK, size + 1 - have)) if have else (None, b"")
        )
        if stream is None:  # nothing to continue, or the store answers no range read: from the start
            have, h, first = 0, hashlib.sha256(), b""
            stream = open_url(url)
        with stream, open_no_follow(part, "ab" if have else "wb") as out:
            got = have
            while not stopped():
                # A store that sends more than the manifest's size is cut off one byte past it (refused below), not
                # written to the cache disk to its end.
                chunk = first or stream.read(CHUNK if size is None else min(CHUNK, size + 1 - got))
                first = b""
                if not chunk:
                    break
                h.update(chunk)
                out.write(chunk)
                got += len(chunk)
                pace.check(got - have)
                if size is not None and got > size:
                    break
            else:
                return
    except StorageError:
        raise
    except UnsafeWrite as e:
        raise StorageError(str(e)) from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the cache's disk, not the store: say which
            raise StorageError(
                f"cannot fetch {url} into {part.parent}: no space left there ({e.strerror}); free "
                "space, lower --shard-cache-limit, or pass a --shard-cache on a larger disk"
            ) from None
        raise _fail(url, "fetch", e) from None
    except Exception as e:  # noqa: BLE001
        raise _fail(url, "fetch", e) from None
    got = part.stat().st_size
    if size is not None and got != size:
        part.unlink()
        raise StorageError(
            f"{url}: fetched {got} bytes but the manifest says {size}: the shard was replaced or cut "
            "short in storage; refusing it"
        )
    if sha256 is not None and h.hexdigest() != sha256:
        part.unlink()
        raise StorageError(
            f"{url}: its bytes do not match the manifest's sha256 ({h.hexdigest()[:12]}... vs "
            f"{sha256[:12]}...): the shard was modified or corrupted in storage; refusing it"
        )
    os.replace(part, dest)


def sha256_file(path: Path, *, between: Callable[[], None] = lambda: None) -> str:
    """The hex sha256 of a local file, read in CHUNK pieces (bounded memory); `between` is called after each."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            between()
    return h.hexdigest()

"""Shard tars read in sequence: a shard URL -> its members grouped per sample, in tar order (local files seekable, so
skipped members are never read; remote ones streamed through storage.py, pipe: commands through webdataset's
opener). Random access by sample is index.py's.
"""

from __future__ import annotations

import os
import re
import tarfile
from typing import Callable, Iterator

from trainer.data.errors import DataError
from trainer.data.sources import REMOTE_OR_PIPE
from trainer.data.storage import StorageError, open_url
from vlmprep_schemas.limits import LIMITS


def open_shard(url: str):
    """Local files stay seekable, so members a worker skips are never read; remote ones stream through fsspec
    (trainer/data/storage.py), pipe: commands through webdataset's gopen."""
    if url.startswith(REMOTE_OR_PIPE):
        try:
            return open_url(url)
        except StorageError as e:
            raise OSError(str(e)) from None
    return open(url, "rb")


SAMPLE_KEY = re.compile(r"^[^.]+$")


def member_key(ti: tarfile.TarInfo, url: str) -> tuple[str, str]:
    """A shard member's (sample key, extension) from its `<key>.<ext>` base name."""
    k, dot, ext = os.path.basename(ti.name).partition(".")
    if not dot or not SAMPLE_KEY.match(k):
        raise DataError(f"{url}: member {ti.name!r} has no '<key>.<ext>' name")
    return k, ext


def check_member_size(ti: tarfile.TarInfo, ext: str, url: str) -> None:
    """Before a member is read into memory: a regular member (a sparse one would expand its holes) within the reader
    limit (the meta's, for the json member)."""
    limit = LIMITS.meta_bytes if ext == "json" else LIMITS.member_bytes
    if ti.issparse() or ti.size > limit:
        raise DataError(
            f"{url}: member {ti.name!r} is {'sparse' if ti.issparse() else f'{ti.size} bytes'}: a reader "
            f"accepts plain members of at most {limit} bytes; refusing to read it"
        )


def iter_tar_samples(url: str, want: Callable[[int], bool]) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """Yield (index in shard, key, members) per sample, in tar order; members is None when want(index) is
    False, and then no member bytes were read from a seekable file."""
    try:
        stream = open_shard(url)
    except OSError as e:
        raise DataError(f"cannot open shard {url}: {e}") from None
    mode = "r|" if url.startswith(REMOTE_OR_PIPE) else "r:"
    finished = False
    try:
        with tarfile.open(fileobj=stream, mode=mode) as tar:
            index, key, members = -1, None, None
            for ti in tar:
                if not ti.isfile():
                    continue
                k, ext = member_key(ti, url)
                if k != key:
                    if key is not None:
                        yield index, key, members
                    index, key = index + 1, k
                    members = {} if want(index) else None
                if members is not None:
                    if ext in members:
                        raise DataError(f"{url}: sample {k} has member {ext!r} twice")
                    check_member_size(ti, ext, url)
                    members[ext] = tar.extractfile(ti).read()
            if key is not None:
                yield index, key, members
        finished = True
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{url}: unreadable, corrupt or truncated tar: {e}") from None
    finally:
        try:
            stream.close()
        except Exception as e:  # noqa: BLE001 - a reader stopped early kills curl/pipe; only a full read must succeed
            if finished:
                raise DataError(f"{url}: reader failed: {e}") from None

"""Random access to samples: a shard's sample index (the build's SHARD.tar.index.npy sidecar, checked against the
manifest's sha256; for an older build's shard, derived from its tar headers and each sample's meta json) -> each
sample's byte range and token counts -> one read per sample. Used by the epoch schedule (trainer/order.py) for
sample shuffling and mixtures; remote shards are read from the rank's shard cache (trainer/cache.py).
"""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.decode import check_member_names, sample_version
from trainer.shards import REMOTE, DataError, ShardRef, check_member_size, member_key, open_shard
from trainer.storage import StorageError, fetch
from vlmprep_schemas import load
from vlmprep_schemas.limits import LIMITS, load_json

INDEX_DTYPE = np.dtype([tuple(f) for f in load("shard_format.schema.json")["sample_index"]["fields"]])
FETCH_THREADS = 8  # sample indexes of remote shards fetched at once at start-up


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of a shard lies (its members' byte range) and its token counts, from the tar headers and
    each sample's meta json: what random access and the step predictor need without decoding a sample."""

    path: str  # the local file (for a remote shard: where the rank's shard cache keeps it)
    starts: np.ndarray  # int64, offset of the sample's first member header
    ends: np.ndarray  # int64, end of its last member's data block
    tokens: np.ndarray  # int64, num_tokens
    trained: np.ndarray  # int64, num_trainable_tokens
    signature: tuple[int, ...] = ()  # file_signature of the file indexed: a later read checks it is still that file

    @property
    def num_samples(self) -> int:
        """How many samples the shard holds."""
        return len(self.starts)


def file_signature(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: its device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def index_shard(path: str, *, url: str | None = None, expect: int | None = None) -> ShardIndex:
    """Derive a shard's index (an older build wrote none): scan its tar headers (a local file's data is skipped by
    seeking; a remote one is streamed once, not stored) and read each sample's `.json` meta. `path` is the local
    file, or where the shard cache will keep a remote `url`."""
    url = url or path
    starts, ends, tokens, trained, names, keys = [], [], [], [], [], []
    key = None
    remote = url != path and url.startswith(("pipe:",) + REMOTE)
    try:
        with (open_shard(url) if remote else open(path, "rb")) as f, \
                tarfile.open(fileobj=f, mode="r|" if remote else "r:") as tar:
            signature = () if remote else file_signature(os.fstat(f.fileno()))
            for ti in tar:
                if not ti.isfile():
                    continue
                k, ext = member_key(ti, url)
                if k != key:
                    key = k
                    starts.append(ti.offset)
                    names.append([])
                    keys.append(k)
                    ends.append(0)
                    tokens.append(-1)
                    trained.append(-1)
                ends[-1] = ti.offset_data + -(-ti.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # padded
                names[-1].append(ext)
                if ext == "json":
                    check_member_size(ti, ext, url)
                    meta = load_json(tar.extractfile(ti).read(), f"sample {k}'s meta", LIMITS.meta_bytes)
                    tokens[-1], trained[-1] = _count(meta["num_tokens"]), _count(meta["num_trainable_tokens"])
    except (tarfile.TarError, OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{url}: cannot index the shard (unreadable, corrupt or truncated tar, or a sample meta "
                        f"without token counts): {e}") from None
    for k, exts in zip(keys, names):  # refused here, before any member of the shard is decoded
        check_member_names(exts, url=url, key=k, version=sample_version(exts))
    if -1 in tokens:
        raise DataError(f"{url}: sample {len(tokens) - tokens[::-1].index(-1) - 1} has no .json meta")
    if expect is not None and len(starts) != expect:
        raise DataError(f"{url} holds {len(starts)} samples but the manifest says {expect}: truncated or replaced "
                        "shard")
    as64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return ShardIndex(path, as64(starts), as64(ends), as64(tokens), as64(trained), signature)


def _count(value) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise ValueError(f"token count {value!r} is not a count")
    return value


def load_index(shard: ShardRef, data: bytes, *, path: str) -> ShardIndex:
    """A shard's sample index from its sidecar's bytes: refused (one line naming it) unless they are the manifest's
    (size, sha256) and describe the shard the manifest lists (its sample count, byte size and token counts, byte
    ranges in order inside it); so the trainer never seeks to a range a dataset did not vouch for."""
    ix, where = shard.index, shard.index.url
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != ix.num_bytes or digest != ix.sha256:
        raise DataError(f"{where}: the sample index is not the one the manifest lists ({len(data)} bytes, sha256 "
                        f"{digest[:12]}... vs {ix.num_bytes}, {ix.sha256[:12]}...): copy the dataset again")
    try:
        rows = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{where}: not a sample index .npy ({e})") from None
    if not isinstance(rows, np.ndarray) or rows.dtype != INDEX_DTYPE or rows.ndim != 1:
        raise DataError(f"{where}: a sample index must be a 1-d array of {INDEX_DTYPE.descr}, got "
                        f"{getattr(rows, 'dtype', type(rows))}")
    starts, ends = rows["start"], rows["end"]
    tokens, trained = rows["num_tokens"], rows["num_trainable_tokens"]
    bad = []
    if shard.num_samples is not None and len(rows) != shard.num_samples:
        bad.append(f"{len(rows)} rows for {shard.num_samples} samples")
    if len(rows) and (starts[0] < 0 or (ends <= starts).any() or (starts[1:] < ends[:-1]).any()
                      or (shard.num_bytes is not None and ends[-1] > shard.num_bytes)):
        bad.append("byte ranges out of order or outside the shard")
    if (tokens < 0).any() or (trained < 0).any() or (trained > tokens).any():
        bad.append("negative or inconsistent token counts")
    if shard.num_tokens is not None and int(tokens.sum()) != shard.num_tokens:
        bad.append(f"{int(tokens.sum())} tokens, the manifest says {shard.num_tokens}")
    if bad:
        raise DataError(f"{where}: the sample index does not describe {shard.name} ({'; '.join(bad)}): a corrupt "
                        "or foreign dataset; run `vlmprep verify`")
    as64 = np.ascontiguousarray
    return ShardIndex(path, as64(starts), as64(ends), as64(tokens), as64(trained))


def cache_name(url: str, name: str) -> str:
    """A remote file's name in the rank's shard cache: unique per URL, readable by its shard name."""
    return f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{name.rsplit('/', 1)[-1][:80]}"


def shard_index(s: ShardRef, cache: Path) -> ShardIndex:
    """A shard's index: its sidecar (a local one read in place; a remote one fetched into `cache`, sha256-checked and
    kept for a resume), or for an older build's shard derived from its tar. A remote shard's own bytes are left to
    the shard cache (trainer/cache.py); the index's path is where that keeps them."""
    remote = s.url.startswith(("pipe:",) + REMOTE)
    path = str(Path(cache) / cache_name(s.url, s.name)) if remote else s.url
    if s.index is None:
        return index_shard(path, url=s.url, expect=s.num_samples)
    if not s.index.url.startswith(REMOTE):
        try:
            return load_index(s, Path(s.index.url).read_bytes(), path=path)
        except OSError as e:
            raise DataError(f"{s.index.url}: listed in the manifest but cannot be read ({e.strerror}); copy "
                            "the dataset again") from None
    local = Path(cache) / cache_name(s.index.url, s.index.url)
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            fetch(s.index.url, local, size=s.index.num_bytes, sha256=s.index.sha256)
        except StorageError as e:
            raise DataError(str(e)) from None
    return load_index(s, local.read_bytes(), path=path)


def index_shards(shards: tuple[ShardRef, ...], index: Callable[[ShardRef], ShardIndex]) -> tuple[ShardIndex, ...]:
    """`index(shard)` of every shard, in order; several at a time where remote sidecars are to be fetched."""
    if len(shards) > 1 and any(s.url.startswith(REMOTE) for s in shards):
        with ThreadPoolExecutor(FETCH_THREADS) as pool:
            return tuple(pool.map(index, shards))
    return tuple(index(s) for s in shards)


def read_indexed(index: ShardIndex, i: int, f=None) -> tuple[str, dict[str, bytes]]:
    """Sample i of an indexed shard: (key, members), one read of its byte range."""
    a, z = int(index.starts[i]), int(index.ends[i])
    own = f is None
    f = f or open(index.path, "rb")
    try:
        f.seek(a)
        chunk = f.read(z - a)
    finally:
        if own:
            f.close()
    members: dict[str, bytes] = {}
    key = None
    try:
        with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as tar:
            for ti in tar:
                if not ti.isfile():
                    continue
                k, _, ext = os.path.basename(ti.name).partition(".")
                key = key or k
                if k != key or ext in members:
                    raise DataError(f"{index.path}: sample {i} is not one run of members (the shard changed since "
                                    "it was indexed)")
                check_member_size(ti, ext, index.path)
                members[ext] = tar.extractfile(ti).read()
    except (tarfile.TarError, OSError) as e:
        raise DataError(f"{index.path}: sample {i} unreadable: {e}") from None
    if key is None:
        raise DataError(f"{index.path}: sample {i} holds no members (the shard changed since it was indexed)")
    return key, members

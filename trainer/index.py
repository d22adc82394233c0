"""Random access to samples: a local shard's tar headers -> a sample index (each sample's byte range and token
counts, read from its meta json) -> one read per sample. http(s):// and pipe: shards are first copied to local disk.
Used by the epoch schedule (trainer/order.py) for sample shuffling and mixtures.
"""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.gopen import gopen

from trainer.decode import check_member_names, sample_version
from trainer.shards import REMOTE, DataError, ShardRef, check_member_size, member_key
from vlmprep_schemas.limits import LIMITS, load_json


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of a shard lies (its members' byte range) and its token counts, from the tar headers and
    each sample's meta json: what random access and the step predictor need without decoding a sample."""

    path: str  # the local file
    starts: np.ndarray  # int64, offset of the sample's first member header
    ends: np.ndarray  # int64, end of its last member's data block
    tokens: np.ndarray  # int64, num_tokens
    trained: np.ndarray  # int64, num_trainable_tokens
    signature: tuple[int, ...] = ()  # file_signature of the file indexed: a later read checks it is still that file

    @property
    def num_samples(self) -> int:
        return len(self.starts)


def file_signature(st: os.stat_result) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: its device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def index_shard(path: str, *, url: str | None = None, expect: int | None = None) -> ShardIndex:
    """Scan a local tar's headers (data is skipped by seeking) and read each sample's `.json` meta."""
    url = url or path
    starts, ends, tokens, trained, names, keys = [], [], [], [], [], []
    key = None
    try:
        with open(path, "rb") as f, tarfile.open(fileobj=f, mode="r:") as tar:
            signature = file_signature(os.fstat(f.fileno()))
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


def local_copy(shard: ShardRef, cache: Path) -> str:
    """A local path for random access: local shards as they are; http(s):// and pipe: shards copied once into
    `cache` (streamed to a temp file, renamed when complete and of the manifest's size)."""
    if not shard.url.startswith(("pipe:",) + REMOTE):
        return shard.url
    digest = hashlib.sha256(shard.url.encode()).hexdigest()[:16]
    dest = Path(cache) / f"{digest}-{shard.name.rsplit('/', 1)[-1][:80]}"
    if dest.is_file() and (shard.num_bytes is None or dest.stat().st_size == shard.num_bytes):
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        stream = gopen(shard.url)
        try:
            with open(tmp, "wb") as out:
                while chunk := stream.read(1 << 20):
                    out.write(chunk)
        finally:
            stream.close()
    except Exception as e:  # noqa: BLE001 - curl / pipe exit status surfaces here
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot copy {shard.url} to {cache}: {e}") from None
    if shard.num_bytes is not None and tmp.stat().st_size != shard.num_bytes:
        size = tmp.stat().st_size
        tmp.unlink()
        raise DataError(f"{shard.url}: fetched {size} bytes but the manifest says {shard.num_bytes}")
    os.replace(tmp, dest)
    return str(dest)


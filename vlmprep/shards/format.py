"""The member-name rule and versions of the shard format, read from schemas/shard_format.schema.json (the trainer
reads the same file), so the writer, every reader in vlmprep and the trainer cannot disagree.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from vlmprep_schemas import load
from vlmprep_schemas.limits import LIMITS  # noqa: F401 - re-exported: what every reader here refuses
from vlmprep_schemas.views import VIEWS_MEMBER

_SPEC = load("shard_format.schema.json")
FORMAT_VERSION: int = _SPEC["format_version"]
READABLE_VERSIONS: tuple[int, ...] = tuple(_SPEC["readable_versions"])
META_MEMBER: str = _SPEC["meta_member"]
# The optional per-shard sample index sidecar (SHARD.tar.index.npy): one row per sample, in tar order.
INDEX_SUFFIX: str = _SPEC["sample_index"]["suffix"]
INDEX_DTYPE = np.dtype([tuple(f) for f in _SPEC["sample_index"]["fields"]])
# The dataset's sample index (DIR/samples.index.npy): every shard's sidecar rows in manifest order, in one file.
DATASET_INDEX_NAME: str = _SPEC["sample_index"]["dataset_file"]


@dataclass(frozen=True)
class ArraySpec:
    """One .npy member of a sample: its dtype, its number of dims, and the format version that added it."""

    dtype: np.dtype
    ndim: int
    since: int
    shape: tuple[int | str, ...]  # in terms of the meta: L = num_tokens, N = image occurrences, V = videos

    def shape_for(self, dims: dict[str, int]) -> tuple[int, ...]:
        """The shape this array must have in a sample whose meta gives `dims` (L, N, V)."""
        return tuple(dims[d] if isinstance(d, str) else d for d in self.shape)


ARRAYS: dict[str, ArraySpec] = {
    name: ArraySpec(np.dtype(a["dtype"]), a["ndim"], a["since"], tuple(a["shape"]))
    for name, a in _SPEC["arrays"].items()
}
_KEY = {
    5: re.compile(_SPEC["$defs"]["key"]["pattern"]),
    4: re.compile(_SPEC["$defs"]["key"]["pattern"]),
    3: re.compile(_SPEC["$defs"]["key"]["pattern"]),
    2: re.compile(_SPEC["$defs"]["key"]["pattern"]),
    1: re.compile(_SPEC["$defs"]["key_v1"]["pattern"]),
}
_IMAGE = {
    5: re.compile(_SPEC["$defs"]["image_member"]["pattern"]),
    4: re.compile(_SPEC["$defs"]["image_member"]["pattern"]),  # v4 added .pdelta.zst
    3: re.compile(_SPEC["$defs"]["image_member_v2"]["pattern"]),
    2: re.compile(_SPEC["$defs"]["image_member_v2"]["pattern"]),
    1: re.compile(_SPEC["$defs"]["image_member_v1"]["pattern"]),
}
_VIDEO = re.compile(_SPEC["$defs"]["video_member"]["pattern"])  # format v3 on


def arrays_of(version: int) -> dict[str, ArraySpec]:
    """The array members every sample of this format version has."""
    return {n: a for n, a in ARRAYS.items() if a.since <= version}


def is_key(key: str, version: int = FORMAT_VERSION) -> bool:
    """Whether `key` is a valid sample key (tar member stem) in format `version`."""
    return bool(_KEY[version].match(key))


def is_image_member(name: str, version: int = FORMAT_VERSION) -> bool:
    """Whether `name` is a valid image member name in format `version`."""
    return bool(_IMAGE[version].match(name))


def is_video_member(name: str, version: int = FORMAT_VERSION) -> bool:
    """Whether `name` is a valid video frame member name in format `version` (videos from v3)."""
    return version >= 3 and bool(_VIDEO.match(name))


def is_views_member(name: str, version: int = FORMAT_VERSION) -> bool:
    """Whether `name` is a valid views member name in format `version` (a kept photo's views, from v5)."""
    return version >= 5 and bool(VIEWS_MEMBER.match(name))


def is_member(name: str, version: int = FORMAT_VERSION) -> bool:
    """True for every member a sample of this version may hold; anything else is refused unread."""
    return (
        name == META_MEMBER
        or name in arrays_of(version)
        or is_image_member(name, version)
        or is_video_member(name, version)
        or is_views_member(name, version)
    )


def sample_key(position: int, split: int | None = None) -> str:
    """Input position (plus the split index of a record cut into several samples): stable, unique, dot-free."""
    key = f"{position:010d}" if split is None else f"{position:010d}_{split:04d}"
    assert is_key(key), f"sample key {key!r} breaks the shard format's key rule"
    return key


def index_name(shard_name: str) -> str:
    """The sample index sidecar of a shard: shard-000000.tar -> shard-000000.tar.index.npy."""
    return shard_name + INDEX_SUFFIX


def id_hash(sample_id: str) -> int:
    """The sample index's `id` column: blake2b-64 of the meta id (finds a sample by id without reading metas)."""
    return int.from_bytes(hashlib.blake2b(str(sample_id).encode("utf-8"), digest_size=8).digest(), "little")


def image_member_name(unique_index: int, ext: str) -> str:
    """The member name of a sample's `unique_index`-th stored image with extension `ext`."""
    name = f"img{unique_index:03d}.{ext}"
    assert is_image_member(name), f"image member {name!r} breaks the shard format's member rule"
    return name


_STORAGE = {
    ".pdelta.zst": "zstd-pdelta",
    ".delta.zst": "zstd-delta",
    ".npy.zst": "zstd",
    ".png": "png",
    ".webp": "webp",
}


def storage_of(member: str) -> str:
    """How an image member is stored, from its name alone (the --image-format that writes it): `img000.orig.jpg` ->
    original, `img001.pdelta.zst` -> zstd-pdelta, ... (an auto build's images are each one of these two)."""
    if ".orig." in member:
        return "original"
    return next((fmt for ext, fmt in _STORAGE.items() if member.endswith(ext)), "unknown")


def video_frame_member_name(video: int, frame: int, ext: str) -> str:
    """The member name of frame `frame` of the sample's video `video`, with extension `ext`."""
    name = f"vid{video:03d}.{frame:04d}.{ext}"
    assert is_video_member(name), f"video member {name!r} breaks the shard format's member rule"
    return name

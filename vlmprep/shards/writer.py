"""Write shards: RenderedSample -> ShardSample (npy/json/image members) -> deterministic WebDataset tars.
Each tar is written under a temp name and renamed when complete; the manifest is written last. Member names
follow shards/format.py; shards/reader.py is the matching reader.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlmprep.pixels import FRAME_EXT, encode_frame, encode_image, encode_views, image_storage, stored_ext, stored_views
from vlmprep.shards.dataset import TMP_SUFFIX, write_bytes_atomic
from vlmprep.shards.format import (
    ARRAYS,
    DATASET_INDEX_NAME,
    INDEX_DTYPE,
    META_MEMBER,
    id_hash,
    image_member_name,
    index_name,
    video_frame_member_name,
)
from vlmprep.shards.manifest import ShardEntry
from vlmprep.types import RenderedSample, ShardSample
from vlmprep_schemas.boundary import open_no_follow
from vlmprep_schemas.limits import index_head, npy_head
from vlmprep_schemas.tar_members import member_header as _member_header
from vlmprep_schemas.tar_members import tar_header as _tar_header  # noqa: F401 - the format contract test's reference
from vlmprep_schemas.views import views_member


def npy_bytes(arr: np.ndarray) -> bytes:
    """np.save's bytes of `arr` (format 1.0), its header built once per dtype and shape (npy_head): np.save builds it
    anew for each of a sample's eight arrays, which cost more than writing them."""
    if not arr.flags.c_contiguous or arr.dtype.hasobject:  # a Fortran-order header, or np.save's refusal
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return buf.getvalue()
    return npy_head(arr.shape, arr.dtype) + arr.tobytes()


def encode_sample(
    sample: RenderedSample, *, key: str, image_format: str, zstd_level: int, encoded: dict[str, bytes] | None = None
) -> ShardSample:
    """A RenderedSample -> its shard members (ShardSample): the token arrays as .npy, each distinct image once
    (encoded per --image-format: zstd-pdelta, zstd-delta or zstd of the resized pixels, png, webp, or the source bytes
    for original) with an index from occurrence to stored image, video frames, and the meta JSON. `encoded`: stored
    image bytes by source digest (zstd-pdelta: and the previous image's), shared by the samples of one record, so an
    image that several step samples hold after the same image is encoded once. Trade-off: storing processor-resized
    pixels makes shards about the source bytes in size (zstd-pdelta: 0.69x on real screenshots) but leaves the
    trainer no image decode or resize to repeat."""
    image_members, image_index, images_meta = _image_members(
        sample, image_format, zstd_level, {} if encoded is None else encoded
    )
    members = _array_members(sample, image_index)
    members.update(image_members)
    frame_members, videos_meta = _video_members(sample, image_format, zstd_level)
    members.update(frame_members)
    meta = _meta(sample, image_format, images_meta, videos_meta)
    members[META_MEMBER] = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
    return ShardSample(
        key=key,
        members=members,
        num_tokens=meta["num_tokens"],
        num_trainable_tokens=meta["num_trainable_tokens"],
        num_images=len(sample.images),
        meta=meta,
    )


def _image_members(
    sample: RenderedSample, image_format: str, zstd_level: int, encoded: dict[str, bytes]
) -> tuple[dict[str, bytes], list[int], list[dict]]:
    """Each distinct image of the sample stored once (member name -> bytes), the stored image of each occurrence,
    and each occurrence's meta (member, size, grid, span, source size and bytes; zstd-pdelta: the member it is
    compressed against; a source stored as it is: its sha256)."""
    images_meta, image_index, image_members = [], [], {}
    unique: dict[str, str] = {}  # source digest -> member name
    extra: dict[str, dict] = {}  # member -> what its meta entries add: prefix (zstd-pdelta), sha256 (original)
    previous, previous_storage = None, None
    assert len(sample.image_spans) == len(sample.images), "an image without its span in the tokens"
    for im, span in zip(sample.images, sample.image_spans):
        name = unique.get(im.digest)
        if name is None:  # identical images within a sample are stored once
            storage = image_storage(image_format, im)  # per image under auto
            name = unique[im.digest] = image_member_name(len(unique), stored_ext(storage, im))
            # The sample's previous stored image, never another sample's (each sample decodes on its own), and only
            # one stored as zstd-pdelta too: a prefix is the member numbered one less (pdelta_prefixes).
            prefix = previous if storage == previous_storage == "zstd-pdelta" and previous.shape == im.shape else None
            cached = im.digest if prefix is None else f"{im.digest}<{prefix.digest}"
            if cached not in encoded:
                encoded[cached] = encode_image(im, storage, zstd_level=zstd_level, prefix=prefix)
            data = image_members[name] = encoded[cached]
            extra[name] = {} if prefix is None else {"prefix": unique[prefix.digest]}
            if storage == "original":  # verify checks the source bytes a loader decodes against it
                extra[name]["sha256"] = im.digest if data is im.source.data else hashlib.sha256(data).hexdigest()
                views = stored_views(image_format, im)
                if views is not None:  # the trainer loads these instead of decoding the source (shards/format.py)
                    member = views_member(name)
                    if f"{im.digest}|views" not in encoded:  # a split trace's steps share their screens
                        encoded[f"{im.digest}|views"] = encode_views(views, zstd_level=zstd_level)
                    image_members[member] = encoded[f"{im.digest}|views"]
                    extra[name]["views"] = {
                        "member": member,
                        "canvas": [int(x) for x in views.canvas],
                        "global": [int(x) for x in views.glob],
                    }
            previous, previous_storage = im, storage
        image_index.append(list(unique).index(im.digest))
        height, width = im.shape
        images_meta.append(
            {
                "member": name,
                "height": int(height),
                "width": int(width),
                "grid_thw": [int(x) for x in im.grid_thw],
                "span": [int(x) for x in span],
                **extra[name],
            }
        )
        if im.source_size[0]:  # the size before the processor's resize: what `stats` shows and --max-pixels acts on
            images_meta[-1].update(source_width=int(im.source_size[0]), source_height=int(im.source_size[1]))
        if im.source is not None:  # what `stats` holds the stored bytes against
            images_meta[-1]["source_bytes"] = len(im.source.data)
    return image_members, image_index, images_meta


def _array_members(sample: RenderedSample, image_index: list[int]) -> dict[str, bytes]:
    """The sample's arrays as .npy members, in the format's dtypes."""
    arrays = {
        "input_ids.npy": sample.input_ids,
        "loss_mask.npy": sample.loss_mask,
        "mm_token_type_ids.npy": sample.mm_token_type_ids,
        "position_ids.npy": sample.position_ids,
        "image_grid_thw.npy": np.asarray(sample.image_grid_thw).reshape(-1, 3),
        # Occurrence -> stored image: repeated images are stored once, so sorted img* members alone are not the
        # occurrence order; this array makes the mapping explicit for any reader.
        "image_index.npy": np.asarray(image_index, dtype=np.int64),
        "video_grid_thw.npy": np.asarray(sample.video_grid_thw).reshape(-1, 3),
        "second_per_grid_ts.npy": np.asarray(sample.second_per_grid_ts, dtype=np.float32).reshape(-1),
    }
    assert set(arrays) == set(ARRAYS), "writer and shards/format.py disagree on the array members"
    return {name: npy_bytes(a.astype(ARRAYS[name].dtype, copy=False)) for name, a in arrays.items()}


def _video_members(sample: RenderedSample, image_format: str, zstd_level: int) -> tuple[dict[str, bytes], list[dict]]:
    """Each video's frames as members (vidVVV.FFFF.*, in frame order), and each video's meta."""
    members, videos_meta = {}, []
    for v, video in enumerate(sample.videos):
        ext = FRAME_EXT[image_format]
        for f, frame in enumerate(video.frames):
            members[video_frame_member_name(v, f, ext)] = encode_frame(frame, image_format, zstd_level=zstd_level)
        videos_meta.append(
            {
                "member": f"vid{v:03d}",
                "frames": int(len(video.frames)),
                "height": int(video.frames.shape[1]),
                "width": int(video.frames.shape[2]),
                "grid_thw": [int(x) for x in video.grid_thw],
                "fps": float(video.fps),
                "total_num_frames": int(video.total_num_frames),
                "frame_indices": [int(i) for i in video.frame_indices],
            }
        )
    return members, videos_meta


def _meta(sample: RenderedSample, image_format: str, images_meta: list[dict], videos_meta: list[dict]) -> dict:
    """The sample's meta (the json member, schemas/sample_meta.schema.json)."""
    meta = {
        "id": sample.id,
        "source": {"file": sample.source.file, "line": sample.source.line},
        "num_tokens": int(len(sample.input_ids)),
        "num_trainable_tokens": int(sample.loss_mask.sum()),
        "num_image_tokens": sum(int(b - a) for a, b in sample.image_spans),  # the whole units, wrappers included
        "num_images": len(sample.images),
        "num_tokens_before_truncation": int(sample.num_tokens_before_truncation),
        "truncated": bool(sample.truncated),
        "dropped_images": int(sample.dropped_images),
        "unrendered_tool_calls": int(sample.unrendered_tool_calls),
        "image_format": image_format,
        "images": images_meta,
        # Which input messages the sample holds and trains (indices into the record's messages), the input image
        # occurrences the --keep-images policy removed, and its number when --long-traces split cut the record.
        "messages": [int(i) for i in sample.source_messages],
        "trains": [int(i) for i in sample.trains],
        "removed_images": [int(i) for i in sample.removed_images],
        "split": sample.split,
    }
    if sample.videos or sample.dropped_videos:  # absent from image-only samples: their meta stays as in format v2
        meta.update(
            {
                "videos": videos_meta,
                "num_videos": len(sample.videos),
                "num_video_tokens": int((sample.mm_token_type_ids == 2).sum()),
                "dropped_videos": int(sample.dropped_videos),
            }
        )
    return meta


class _HashingFile:
    """Write-through file wrapper: the sha256 is known when the tar closes, no second read."""

    def __init__(self, f):
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, b):
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)

    def tell(self):
        return self.n


@dataclass
class ShardInfo:
    """One finished shard as the manifest lists it: name, sample, token and image counts, size and sha256."""

    name: str
    num_samples: int = 0
    num_tokens: int = 0
    num_trainable_tokens: int = 0
    num_images: int = 0
    bytes: int = 0
    sha256: str = ""
    index: dict | None = None  # the sample index sidecar: name, bytes, sha256 (absent from older builds' journals)

    def to_json(self) -> dict:
        """The shard's manifest entry (fields that are None left out)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def entry(self) -> ShardEntry:
        """The shard's manifest entry, as the manifests hold it."""
        return ShardEntry.from_json(self.to_json())


def copied(stored, meta: dict) -> ShardSample:
    """A stored sample (reader.StoredSample) as it is, to write into another shard: its key, every member's bytes
    unchanged (nothing rendered or encoded again) and its meta's counts."""
    return ShardSample(
        key=stored.key,
        members={n: stored.read(n) for n in stored.names},
        num_tokens=meta["num_tokens"],
        num_trainable_tokens=meta["num_trainable_tokens"],
        num_images=meta["num_images"],
        meta=meta,
    )


class ShardWriter:
    """Rolls tars at samples_per_shard or shard_size_bytes, whichever comes first. Beside each tar it writes the
    shard's sample index (SHARD.tar.index.npy: each sample's byte range and token counts, from what it wrote), so
    a reader finds any sample without reading the tar's headers or metas."""

    def __init__(
        self,
        out_dir: Path,
        *,
        samples_per_shard: int,
        shard_size_bytes: int,
        prefix: str = "shard-",
        done: list[ShardInfo] | None = None,
    ):
        self.out_dir = Path(out_dir)
        self.prefix = prefix  # a plan task's shards carry its index (plan.shard_prefix)
        self.samples_per_shard = samples_per_shard
        self.shard_size_bytes = shard_size_bytes
        self.shards: list[ShardInfo] = list(done or [])  # shards a resumed build already completed
        self.index = len(self.shards)
        self._file = None
        self._hf: _HashingFile | None = None
        self._info: ShardInfo | None = None
        self._rows: list[tuple] = []

    @property
    def shard_name(self) -> str:
        """The shard the next sample goes into."""
        return f"{self.prefix}{self.index:06d}.tar"

    def _open(self):
        self._info = ShardInfo(name=self.shard_name)
        self._file = open_no_follow(self.out_dir / (self._info.name + TMP_SUFFIX), "wb")
        self._hf = _HashingFile(self._file)

    def write(self, sample: ShardSample) -> bool:
        """Add one sample; True when this completed (closed and renamed) a shard."""
        if self._hf is None:
            self._open()
        start = self._hf.n
        blocks = []
        for ext, data in sample.members.items():
            # What tarfile's addfile writes (header block, data, zeros to a whole block), without its copy of the data
            # through a file object in 16 KiB pieces; the sample's blocks written (and hashed) at once.
            blocks += (_member_header(f"{sample.key}.{ext}", len(data)), data)
            if len(data) % tarfile.BLOCKSIZE:
                blocks.append(tarfile.NUL * (tarfile.BLOCKSIZE - len(data) % tarfile.BLOCKSIZE))
        self._hf.write(b"".join(blocks))
        self._rows.append(
            (
                int(sample.key[:10]),
                id_hash(sample.meta["id"]),
                start,
                self._hf.n,
                sample.num_tokens,
                sample.num_trainable_tokens,
            )
        )
        info = self._info
        info.num_samples += 1
        info.num_tokens += sample.num_tokens
        info.num_trainable_tokens += sample.num_trainable_tokens
        info.num_images += sample.num_images
        if info.num_samples >= self.samples_per_shard or self._hf.n >= self.shard_size_bytes:
            return self.finish_shard()
        return False

    def finish_shard(self) -> bool:
        """Closes the open shard (fsynced, renamed into place) and records it; False when none is open."""
        if self._hf is None:
            return False
        # tarfile's close: two zero blocks end the archive, then zeros up to a whole record
        end = self._hf.n + 2 * tarfile.BLOCKSIZE
        self._hf.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE + (-end) % tarfile.RECORDSIZE))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        info = self._info
        info.bytes = self._hf.n
        info.sha256 = self._hf.h.hexdigest()
        info.index = self._write_index(info.name)
        os.replace(self.out_dir / (info.name + TMP_SUFFIX), self.out_dir / info.name)
        self.shards.append(info)
        self.index += 1
        self._file = self._hf = self._info = None
        return True

    def _write_index(self, shard_name: str) -> dict:
        """The finished shard's sample index, written (atomically) before the tar gets its final name."""
        buf = io.BytesIO()
        np.save(buf, np.array(self._rows, dtype=INDEX_DTYPE), allow_pickle=False)
        data, self._rows = buf.getvalue(), []
        name = index_name(shard_name)
        write_bytes_atomic(self.out_dir / name, data)
        return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def close(self) -> list[ShardInfo]:
        """Finishes the open shard -> every shard this writer wrote."""
        self.finish_shard()
        return self.shards


def write_dataset_index(out_dir: Path, parts, rows: int, name: str = DATASET_INDEX_NAME) -> dict:
    """The dataset's sample index (DATASET_INDEX_NAME; a later version's: `name`): `parts`, each shard's sidecar rows
    in manifest order, `rows` in all, streamed into one .npy (the bytes np.save writes for their concatenation),
    written atomically. Returns its manifest entry: name, bytes, sha256."""
    path = Path(out_dir) / name
    tmp = path.with_name(path.name + TMP_SUFFIX)
    h, n = hashlib.sha256(), 0
    with open_no_follow(tmp, "wb") as f:
        head = index_head(rows, INDEX_DTYPE)
        for chunk in (head, *(np.ascontiguousarray(p, dtype=INDEX_DTYPE).tobytes() for p in parts)):
            f.write(chunk)
            h.update(chunk)
            n += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    assert n == len(head) + rows * INDEX_DTYPE.itemsize, f"{path}: {n} bytes for {rows} rows"
    os.replace(tmp, path)
    return {"name": name, "bytes": n, "sha256": h.hexdigest()}

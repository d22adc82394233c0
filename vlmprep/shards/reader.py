"""Read shards, the only code in vlmprep that opens them: the manifest's shard list (shards/manifest.py) -> safe tar
iterator (member names checked against shards/format.py before anything is read; unknown members refused undecoded)
-> StoredSample with arrays, meta, images in occurrence order and videos (frames stacked per video) in token order
(each image and frame decoded by shards/decode.py).
A dataset is untrusted input: every member is checked against the meta and the format's reader limits before it is
decoded or memory is allocated for it (json size and depth, .npy header shape and length, image header and grid).
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from vlmprep.shards.decode import DECODE_ERRORS, PayloadCache, decode_stored_image, pixels_of_payload, zstd_payload
from vlmprep.shards.format import (
    INDEX_DTYPE,
    LIMITS,
    META_MEMBER,
    arrays_of,
    is_image_member,
    is_key,
    is_member,
    is_video_member,
)
from vlmprep.shards.manifest import FileEntry, ShardEntry, ShardFormatError, dataset_path, load_manifest, shard_paths
from vlmprep_schemas.delta import PDELTA, pdelta_prefixes
from vlmprep_schemas.limits import check_grid_sizes, index_bytes_limit, index_rows, load_json, load_npy, schema_problem


@dataclass
class StoredSample:
    """One sample's members, each read on demand (a tar member, or bytes a client already holds), each checked
    against the format and the meta before it is decoded; every fault is one ShardFormatError naming the sample."""

    key: str
    where: str  # shard name or URL, for messages
    version: int
    names: tuple[str, ...]  # members that passed the name rule
    reader: Callable[[str], bytes] = field(repr=False)
    sizes: dict[str, int] = field(default_factory=dict, repr=False)  # member -> bytes, known before it is read
    unknown: tuple[str, ...] = ()  # members refused by the rule, never read (only with on_unknown="report")
    _meta: dict | None = field(default=None, repr=False)
    _prefixes: dict[str, str] | None = field(default=None, repr=False)
    _payloads: PayloadCache = field(default_factory=PayloadCache, repr=False)

    def _fail(self, what: str) -> ShardFormatError:
        return ShardFormatError(f"{self.where}: sample {self.key}: {what}")

    def read(self, name: str) -> bytes:
        """The bytes of member `name`; a member the sample does not hold, or one over the reader's size limit, is a
        ShardFormatError (refused unread)."""
        if name not in self.names:
            raise self._fail(f"has no member {name!r}")
        limit = LIMITS.meta_bytes if name == META_MEMBER else LIMITS.member_bytes
        if self.sizes.get(name, 0) > limit:  # refused unread
            raise self._fail(f"{name} is {self.sizes[name]} bytes, more than a reader accepts ({limit})")
        return self.reader(name)

    def meta(self) -> dict:
        """The json member, bounded in size and depth before it is parsed, and its types checked against the meta
        schema (every field a reader uses has the type the schema gives)."""
        if self._meta is None:
            try:
                meta = load_json(self.read(META_MEMBER), META_MEMBER, LIMITS.meta_bytes)
            except ValueError as e:
                raise self._fail(str(e)) from None
            problem = schema_problem(meta, "sample_meta.schema.json")
            if problem:
                raise self._fail(f"meta: {problem}")
            self._meta = meta
        return self._meta

    def _dims(self) -> dict[str, int]:
        """The meta's sizes that array shapes are given in (schemas/shard_format.schema.json `shapes`)."""
        meta = self.meta()
        return {"L": meta["num_tokens"], "N": len(meta["images"]), "V": len(meta.get("videos", ()))}

    def array(self, name: str) -> np.ndarray:
        """An array member (`input_ids`, ... without `.npy`): dtype and rank as the format says, shape as the meta
        says, checked from its header before it is read."""
        member = name if name.endswith(".npy") else name + ".npy"
        spec = arrays_of(self.version).get(member)
        if spec is None:
            raise self._fail(f"{member} is not an array of format v{self.version}")
        dims = self._dims()
        try:
            return load_npy(self.read(member), member, spec.dtype, spec.shape_for(dims))
        except ValueError as e:
            raise self._fail(str(e)) from None

    def image_index(self) -> np.ndarray:
        """Occurrence k -> unique image number u (member imgUUU.*). v1 datasets derive it from the meta."""
        if self.version >= 2:
            return self.array("image_index").astype(np.int64)
        members = [im["member"] for im in self.meta()["images"]]
        return np.array([int(m[3:6]) if re.fullmatch("[0-9]{3}", m[3:6]) else -1 for m in members], dtype=np.int64)

    def image_members(self) -> list[str]:
        """The stored member of each image occurrence, in token order."""
        by_number = {int(n[3:6]): n for n in self.names if is_image_member(n, self.version)}
        out = []
        for k, u in enumerate(self.image_index().tolist()):
            if u not in by_number:
                raise self._fail(f"image_index maps occurrence {k} to image {u}, but there is no member img{u:03d}.*")
            out.append(by_number[u])
        return out

    def stored_sizes(self) -> dict[str, tuple[int, int] | None]:
        """Each image and frame member's (height, width) as the meta gives it (for `orig.*`, the source's own size:
        the meta's source_height x source_width, None in a build that did not record it), checked before anything is
        decoded: every occurrence of a member agrees, no image exceeds the
        image limit and all of them together stay within the sample limit, and each is its grid row times one patch
        size (vlmprep_schemas.limits.check_grid_sizes: a reader here has no processor to say which)."""
        meta, out = self.meta(), {}
        for name, im in zip(self.image_members(), meta["images"]):
            size = (im["height"], im["width"])
            if min(size) < 1 or 3 * size[0] * size[1] > LIMITS.image_bytes:
                raise self._fail(f"meta gives {name} the impossible size {size[1]}x{size[0]}")
            if out.setdefault(name, size) != size:
                raise self._fail(f"meta gives {name} two sizes, {out[name][1]}x{out[name][0]} and {size[1]}x{size[0]}")
        total = sum(3 * h * w for h, w in out.values())
        for video, frames in zip(meta.get("videos", ()), self.video_members()):
            size = (video["height"], video["width"])
            if min(size) < 1 or 3 * size[0] * size[1] > LIMITS.image_bytes:
                raise self._fail(f"meta gives {video['member']} the impossible frame size {size[1]}x{size[0]}")
            out.update(dict.fromkeys(frames, size))
            total += 3 * size[0] * size[1] * len(frames)
        if total > LIMITS.sample_bytes:
            raise self._fail(
                f"its images and frames decode to {total} bytes, more than a reader accepts ({LIMITS.sample_bytes})"
            )
        try:
            check_grid_sizes([(im["height"], im["width"]) for im in meta["images"]], self.array("image_grid_thw"))
            if self.version >= 3:
                check_grid_sizes(
                    [(v["height"], v["width"]) for v in meta.get("videos", ())],
                    self.array("video_grid_thw"),
                    frames=True,
                )
        except ValueError as e:
            raise self._fail(str(e)) from None
        source = {
            im["member"]: (im["source_height"], im["source_width"]) for im in meta["images"] if "source_width" in im
        }
        return {n: source.get(n) if ".orig." in n else size for n, size in out.items()}

    def decode(self, name: str, size: tuple[int, int] | None, data: bytes | None = None) -> np.ndarray:
        """One image or frame member (its bytes `data` when already read), its declared size checked against `size`
        (stored_sizes) first; a `.pdelta.zst` member's prefixes are decoded first (_payload). Any order works; member
        order decompresses each member once with one payload cached."""
        try:
            data = self.read(name) if data is None else data
            if not name.endswith(PDELTA):
                return decode_stored_image(name, data, size)
            return pixels_of_payload(name, self._payload(name, size, data), size)
        except DECODE_ERRORS as e:  # the checks' own messages name the member; a decoder's do not
            raise self._fail(
                str(e) if str(e).startswith(name) else f"{name} does not decode: {type(e).__name__}: {e}"
            ) from None

    def _payload(self, name: str, size: tuple[int, int] | None, data: bytes) -> bytes:
        """A `.pdelta.zst` member's decompressed payload: the chain of prefixes it depends on (each the previous
        image, so the chain only goes back) decompressed from the nearest cached one (or its first member) on, each
        payload cached by member (PayloadCache): one decompression a member in member order, and in any order while
        the chain's payloads fit the cache."""
        cached = self._payloads.get(name)
        if cached is not None:
            return cached
        prefixes = self.prefixes()
        chain = [name]
        while chain[-1] in prefixes and self._payloads.get(prefixes[chain[-1]]) is None:
            chain.append(prefixes[chain[-1]])
        payload = self._payloads.get(prefixes.get(chain[-1]))
        for member in reversed(chain):
            payload = zstd_payload(member, data if member == name else self.read(member), size, payload)
            self._payloads.put(member, payload)
        return payload

    def prefixes(self) -> dict[str, str]:
        """Format v4: {`.pdelta.zst` member: the member it was compressed against}, from the meta, checked
        (vlmprep_schemas.delta.pdelta_prefixes)."""
        if self.version < 4:
            return {}
        if self._prefixes is None:  # once: every .pdelta.zst member's decode asks
            try:
                self._prefixes = pdelta_prefixes(self.meta()["images"], self.names)
            except ValueError as e:
                raise self._fail(str(e)) from None
        return self._prefixes

    def images(self) -> list[np.ndarray]:
        """Decoded images per occurrence (uint8 H x W x 3); a repeated image is decoded once and shared. Members
        decode in member order whatever order the occurrences list them in: each `.pdelta.zst` member's prefix (the
        one before it) is then the payload just cached."""
        sizes = self.stored_sizes()
        members = self.image_members()
        decoded = {name: self.decode(name, sizes[name]) for name in sorted(set(members))}
        return [decoded[name] for name in members]

    def video_members(self) -> list[list[str]]:
        """Per video (vidVVV, VVV = its video_grid_thw row, token order) its frame members vidVVV.FFFF.* in frame
        order: frames 0..n-1, one member each, n as the meta's `videos[VVV].frames` says."""
        if self.version < 3:
            return []
        by_video: dict[int, dict[int, list[str]]] = {}
        for n in self.names:
            if is_video_member(n, self.version):
                by_video.setdefault(int(n[3:6]), {}).setdefault(int(n[7:11]), []).append(n)
        rows = len(self.array("video_grid_thw"))
        listed = self.meta().get("videos") or []
        if sorted(by_video) != list(range(rows)) or len(listed) != rows:
            raise self._fail(
                f"video_grid_thw has {rows} rows, the meta lists {len(listed)} videos, the frame members "
                f"are of videos {sorted(by_video)}"
            )
        out = []
        for v in range(rows):
            frames, n = by_video[v], listed[v]["frames"]
            if len(frames) != n or sorted(frames) != list(range(n)) or any(len(m) > 1 for m in frames.values()):
                names = sorted(m for ms in frames.values() for m in ms)
                raise self._fail(
                    f"video {v}: frame members {names[:4]}{' ...' if len(names) > 4 else ''} are not "
                    f"frames 0..{n}-1 (the meta's count), one member each"
                )
            out.append([frames[f][0] for f in range(n)])
        return out

    def videos(self) -> list[np.ndarray]:
        """Decoded videos in token order, each its stored frames stacked: uint8 frames x H x W x 3."""
        sizes = self.stored_sizes()
        return [np.stack([self.decode(name, sizes[name]) for name in names]) for names in self.video_members()]

    def to_dict(self) -> dict:
        """Everything, decoded: `__key__`, `id`, the arrays (name without .npy), `images` per occurrence, `videos`
        per video in token order (empty before format v3), `meta`."""
        out = {"__key__": self.key, "id": str(self.meta().get("id"))}
        out.update({n.removesuffix(".npy"): self.array(n) for n in arrays_of(self.version)})
        out["image_index"] = self.image_index()
        out["images"] = self.images()
        out["videos"] = self.videos()
        out["meta"] = self.meta()
        return out


def _check_names(names, *, key: str, where: str, version: int, on_unknown: str) -> tuple[list[str], list[str]]:
    if not is_key(key, version):
        raise ShardFormatError(f"{where}: key {key!r} is not a vlmprep sample key; refusing to read it")
    ok = [n for n in names if is_member(n, version)]
    bad = [n for n in names if not is_member(n, version)]
    if bad and on_unknown == "raise":
        # Never decoded: .pyd / .pth / .pickle members are exactly what unpickling readers would execute.
        raise ShardFormatError(
            f"{where}: sample {key}: unexpected member(s) {sorted(f'{key}.{n}' for n in bad)} "
            "(not part of the vlmprep shard format); refusing to read them"
        )
    return ok, bad


def sample_from_members(members: dict[str, bytes], *, key: str, where: str, version: int) -> StoredSample:
    """A sample whose raw members a client already holds (webdataset, HF datasets, energon): names checked first."""
    return _checked_sample(
        members, key=key, where=where, version=version, reader=members.__getitem__, size=lambda n: len(members[n])
    )


def _checked_sample(names, *, key, where, version, reader, size=None, on_unknown: str = "raise") -> StoredSample:
    """A sample of these member names, the names checked first; `size(name)`, where given, is known before a read."""
    ok, bad = _check_names(list(names), key=key, where=where, version=version, on_unknown=on_unknown)
    sizes = {n: size(n) for n in ok} if size else {}
    return StoredSample(
        key=key, where=where, version=version, names=tuple(ok), unknown=tuple(bad), reader=reader, sizes=sizes
    )


def _read_range(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ShardFormatError(f"{path.name}: truncated: a member ends past the end of the file")
    return data


def iter_shard(path: Path, *, version: int, on_unknown: str = "raise") -> Iterator[StoredSample]:
    """A shard's samples in tar order. Member names and types are checked as they come; member bytes are read only
    when asked for (by offset, so a sample stays readable after the iteration moves on). on_unknown="report" lists
    refused members in `StoredSample.unknown` instead of raising."""
    path = Path(path)
    where = path.name

    def emit(key, spans):
        return _checked_sample(
            spans,
            key=key,
            where=where,
            version=version,
            reader=lambda n: _read_range(path, *spans[n]),
            size=lambda n: spans[n][1],
            on_unknown=on_unknown,
        )

    try:
        with tarfile.open(path, mode="r:") as tar:
            key, spans = None, {}
            for ti in tar:
                k, dot, ext = ti.name.partition(".")
                if ti.issparse():  # its holes would read as zeros: a member that claims more than it holds
                    raise ShardFormatError(
                        f"{where}: member {ti.name!r} is sparse (it claims {ti.size} bytes); refusing to read it"
                    )
                if not ti.isreg() or not dot or "/" in ti.name:
                    raise ShardFormatError(
                        f"{where}: member {ti.name!r} is not a plain KEY.EXT file; refusing to read it"
                    )
                if k != key and key is not None:
                    yield emit(key, spans)
                    spans = {}
                if ext in spans:
                    raise ShardFormatError(f"{where}: sample {k} has member {ext!r} twice")
                key = k
                spans[ext] = (ti.offset_data, ti.size)
            if key is not None:
                yield emit(key, spans)
    except tarfile.TarError as e:
        raise ShardFormatError(f"{where}: unreadable or truncated tar: {e}") from None


def load_sample_index(d: Path, entry: ShardEntry) -> np.ndarray | None:
    """A shard's sample index sidecar (manifest shard entry `index`), or None where the build wrote none; refused
    unless it is a plain .npy of the format's index dtype (never unpickled). Its sha256 is verify's to check."""
    if entry.index is None:
        return None
    return read_index_file(dataset_path(Path(d), entry.index.name), entry.index, rows=entry.num_samples)


def read_index_file(path: Path, listed: FileEntry, *, rows: int | None) -> np.ndarray:
    """A sample index file (a shard's sidecar, or the dataset's for `rows` samples in all) as the manifest lists it
    (`listed`: its bytes): its size is checked against the listing and the most `rows` rows take before a byte is
    read, then its header against the one np.save writes (limits.index_rows). ShardFormatError, one line, else."""
    limit = index_bytes_limit(rows if isinstance(rows, int) else 0, INDEX_DTYPE)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != listed.bytes or (rows is not None and size > limit):
                data = None
            else:
                data = f.read(size + 1)
        if data is not None:
            return index_rows(data, path.name, INDEX_DTYPE)
    except (ValueError, OSError) as e:
        raise ShardFormatError(f"{path.name}: not a readable sample index ({type(e).__name__}: {e})") from None
    raise ShardFormatError(
        f"{path.name}: {size} bytes, but the manifest lists {listed.bytes} (at most {limit} "
        f"for {rows} samples); refusing to read it"
    )


def sample_ranges(path: Path) -> list[tuple[str, int, int]]:
    """(key, start, end) of each sample of a shard from its tar headers: where its first member's header starts and
    its last member's padded data ends (what the sample index records)."""
    out: list[tuple[str, int, int]] = []
    try:
        with tarfile.open(path, mode="r:") as tar:
            for ti in tar:
                key = ti.name.partition(".")[0]
                end = ti.offset_data + -(-ti.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
                if out and out[-1][0] == key:
                    out[-1] = (key, out[-1][1], end)
                else:
                    out.append((key, ti.offset, end))
    except tarfile.TarError as e:
        raise ShardFormatError(f"{Path(path).name}: unreadable or truncated tar: {e}") from None
    return out


class StaleIndex(ShardFormatError):
    """A sample index row that does not land on its sample: the shard changed after the index was written."""


def sample_at(path: Path, start: int, end: int, *, version: int, position: int) -> StoredSample:
    """The one sample whose members lie in bytes [start, end) of a shard (a sample index row, with the input
    `position` its key starts with): read without scanning the shard."""
    try:
        samples = list(
            iter_shard_bytes(_read_range(Path(path), start, end - start), where=Path(path).name, version=version)
        )
    except ShardFormatError as e:
        raise StaleIndex(str(e)) from None
    if len(samples) != 1 or not samples[0].key.startswith(f"{position:010d}"):
        raise StaleIndex(
            f"{Path(path).name}: bytes {start}..{end} are not the sample at input position {position}: "
            "the sample index does not match the shard (run `vlmprep verify`)"
        )
    return samples[0]


def iter_shard_bytes(data: bytes, *, where: str, version: int) -> Iterator[StoredSample]:
    """The samples of a tar held in memory (a byte range of a shard), checked as iter_shard checks them."""
    spans: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for ti in tar:
                k, dot, ext = ti.name.partition(".")
                if not ti.isreg() or not dot or "/" in ti.name:
                    raise ShardFormatError(f"{where}: member {ti.name!r} is not a plain KEY.EXT file; refusing it")
                if ext in spans.setdefault(k, {}):
                    raise ShardFormatError(f"{where}: sample {k} has member {ext!r} twice")
                spans[k][ext] = (ti.offset_data, ti.size)
    except tarfile.TarError as e:
        raise ShardFormatError(f"{where}: unreadable tar bytes: {e}") from None
    for key, members in spans.items():
        yield _checked_sample(
            members,
            key=key,
            where=where,
            version=version,
            reader=lambda n, m=members: data[m[n][0] : m[n][0] + m[n][1]],
        )


def iter_dataset(d: Path, *, shard: str | None = None) -> Iterator[StoredSample]:
    """Every sample of a built dataset dir in manifest order."""
    manifest = load_manifest(d)
    for path in shard_paths(d, manifest, shard):
        yield from iter_shard(path, version=manifest.format_version)

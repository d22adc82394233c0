"""Dataset versions (docs/datasets-that-grow.md): the names a versioned dataset gives its version records and tags,
and a version reference (`DIR@vN`, `DIR@TAG`, plain `DIR`) -> the manifest file it names, read through a bounded
reader of the caller's (a local dir, a store). vlmprep and the trainer both call it, so both read one rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Callable

from vlmprep_schemas.boundary import MANIFEST_NAME, UnsafeDataset, dataset_file
from vlmprep_schemas.limits import LIMITS, load_json

VERSIONS_DIR = "versions"  # versions/v000001.json ...: each version's record, immutable once written
TAGS_DIR = f"{VERSIONS_DIR}/tags"  # versions/tags/NAME.json: a name for one version, created once
MAX_TAG_BYTES = 64 << 10  # a tag file is ~200 bytes
TAG_PATTERN = "[A-Za-z][A-Za-z0-9._-]{0,63}"
_TAG = re.compile(f"^{TAG_PATTERN}$")
_VERSION = re.compile(r"^v([0-9]+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_REWRITE = re.compile(r"^shard-v[0-9]{6}-r-")  # a rebuild's rewrite of an earlier shard: shard-v00000N-r-000000.tar

# A reader of one dataset: a file name inside it and the most bytes accepted -> its bytes, or None where it is absent
# (ValueError, one line, for more than the limit or a file that is not a plain one).
Read = Callable[[str, int], "bytes | None"]


class VersionError(ValueError):
    """A version reference that is malformed or names no version or tag of the dataset: one line naming it and what
    exists."""


def version_name(n: int) -> str:
    """The record of version `n` inside the dataset: versions/v000001.json."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise VersionError(f"version {n!r}: version numbers are whole numbers from 1")
    return f"{VERSIONS_DIR}/v{n:06d}.json"


def ids_name(n: int) -> str:
    """Version `n`'s id file: the 16-byte blake2b digests of its samples' ids, sorted (versions/v000001.ids)."""
    return version_name(n)[: -len(".json")] + ".ids"


def is_rewrite(shard: str) -> bool:
    """Whether shard `shard` is a rebuild's rewrite of an earlier shard (`vlmprep watch --on-change rebuild`: the
    samples it kept, not new ones), by its name."""
    return _REWRITE.match(shard) is not None


def check_tag_name(name) -> str:
    """`name` if it is a tag name (TAG_PATTERN, and not of the form v<digits>, which reads as a version); VersionError
    naming the rule otherwise."""
    if not isinstance(name, str) or not _TAG.match(name) or _VERSION.match(name):
        raise VersionError(
            f"tag {printable(name)}: a tag is a letter then up to 63 letters, digits, '.', '_' or '-', and not "
            "v<digits> (that names a version), e.g. `release-1`"
        )
    return name


def tag_file(name: str) -> str:
    """The file of tag `name` inside the dataset: versions/tags/NAME.json."""
    return f"{TAGS_DIR}/{check_tag_name(name)}.json"


def printable(value) -> str:
    """A value from a command line or a dataset as a message may show it: repr, control characters escaped."""
    return repr(value) if isinstance(value, str) else repr(str(value))


def version_number(ref: str) -> int | None:
    """A reference after the '@': `v12` -> 12 (leading zeros allowed), a tag name -> None; VersionError for
    anything else (v0, an empty or malformed name)."""
    m = _VERSION.match(ref) if isinstance(ref, str) else None
    if m:
        n = int(m.group(1))
        if n < 1:
            raise VersionError(f"@{ref}: version numbers start at v1")
        return n
    check_tag_name(ref)
    return None


def split_ref(url: str, *, exists: Callable[[str], bool] = os.path.lexists) -> tuple[str, str | None]:
    """`DIR@vN` / `DIR@NAME` / `DIR` (a local path or a dataset URL) -> (the dataset, the reference or None). The
    '@' is the last one after the last '/' (never in a URL's host part); a local path that exists with that very name
    is taken literally. VersionError (one line) for a reference that is neither vN nor a tag name."""
    url = str(url)
    whole = url.rstrip("/") or url
    remote = bool(_SCHEME.match(whole))
    if not remote and exists(whole):
        return url, None
    start = whole.find("/", whole.find("://") + 3) if remote else 0  # a URL's path starts after its host
    at = whole.rfind("@")
    if start < 0 or at < start or at < whole.rfind("/"):
        return url, None
    base, ref = whole[:at], whole[at + 1 :]
    if not base or base.endswith("/"):
        raise VersionError(f"{printable(url)}: no dataset before the '@'; pass DIR@v3 or DIR@TAG")
    try:
        version_number(ref)
    except VersionError:
        raise VersionError(
            f"{printable(url)}: {printable(ref)} after the '@' is neither a version (vN, N >= 1) nor a tag name "
            f"({TAG_PATTERN}, not v<digits>); pass DIR@v3 or DIR@TAG"
        ) from None
    return base, ref


@dataclass(frozen=True)
class Tag:
    """A tag file's content: the tag's name, the version it names, the sha256 of that version record's bytes (a
    record changed after it was tagged is refused) and when it was made (UTC ISO-8601)."""

    tag: str
    version: int
    manifest_sha256: str
    created: str

    def to_bytes(self) -> bytes:
        """The tag file's bytes (sorted keys: the same tag is the same file)."""
        return (json.dumps(self.__dict__, indent=2, sort_keys=True) + "\n").encode("utf-8")


def parse_tag(data: bytes, *, where: str) -> Tag:
    """A tag file's bytes (read from `where`) -> Tag, bounded and checked (name, a version number, a sha256, a time);
    VersionError naming the file otherwise."""
    try:
        obj = load_json(data, where, MAX_TAG_BYTES)
    except ValueError as e:
        raise VersionError(str(e)) from None
    ok = (
        isinstance(obj, dict)
        and isinstance(obj.get("tag"), str)
        and _TAG.match(obj["tag"]) is not None
        and isinstance(obj.get("version"), int)
        and not isinstance(obj["version"], bool)
        and obj["version"] >= 1
        and isinstance(obj.get("manifest_sha256"), str)
        and _SHA256.match(obj["manifest_sha256"]) is not None
        and isinstance(obj.get("created"), str)
    )
    if not ok:
        raise VersionError(
            f"{where}: not a tag file ({{tag, version, manifest_sha256, created}} with a tag name, a version "
            "number >= 1 and a sha256); refusing it"
        )
    return Tag(obj["tag"], obj["version"], obj["manifest_sha256"], obj["created"][:64])


def record_number(manifest) -> int:
    """The version a manifest (a parsed version record or manifest.json) describes: its `version.number`, 1 for a
    dataset built before versions (no `version` object)."""
    version = manifest.get("version") if isinstance(manifest, dict) else None
    number = version.get("number") if isinstance(version, dict) else None
    if version is None:
        return 1
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise VersionError(f"version.number {printable(number)} is not a version number (1, 2, ...)")
    return number


@dataclass(frozen=True)
class Resolved:
    """What a reference resolved to: the manifest file's name inside the dataset, its bytes, the version number."""

    name: str
    data: bytes
    number: int


def resolve_ref(ref: str | None, read: Read, *, where: str) -> Resolved | None:
    """A reference (after the '@'; None: the latest) -> the version record it names, read through `read` (bounded by
    LIMITS.manifest_bytes). None for the latest where manifest.json is absent (the caller says what that means).
    `vN`: versions/v00000N.json (v1 of a dataset that has no version records yet: its manifest.json); a tag: its tag
    file, then its version's record, whose sha256 must be the tag's. VersionError naming what is missing and the
    latest version. `where`: the dataset as the user named it."""
    if ref is None:
        data = read(MANIFEST_NAME, LIMITS.manifest_bytes)
        return None if data is None else Resolved(MANIFEST_NAME, data, _number_of(data, f"{where}/{MANIFEST_NAME}"))
    n, tag = version_number(ref), None
    if n is None:
        name = tag_file(ref)
        tagged = read(name, MAX_TAG_BYTES)
        if tagged is None:
            raise VersionError(
                f"{where}@{ref}: no version or tag {ref!r} ({_latest(read, where)}; `vlmprep versions {where}` "
                "lists them)"
            )
        tag = parse_tag(tagged, where=f"{where}/{name}")
        if tag.tag != ref:
            raise VersionError(f"{where}/{name}: holds tag {tag.tag!r}, not {ref!r}; refusing it")
        n = tag.version
    found = _version(n, read, where)
    if tag is not None and hashlib.sha256(found.data).hexdigest() != tag.manifest_sha256:
        raise VersionError(
            f"{where}@{ref}: {found.name} is not the record tag {ref!r} was made for (its sha256 differs from "
            "the tag's): changed after it was tagged; refusing it"
        )
    return found


def _version(n: int, read: Read, where: str) -> Resolved:
    name = version_name(n)
    data = read(name, LIMITS.manifest_bytes)
    if data is None and n == 1:  # a dataset built before versions, or not appended to yet: its manifest is v1
        latest = read(MANIFEST_NAME, LIMITS.manifest_bytes)
        if latest is not None and _number_of(latest, f"{where}/{MANIFEST_NAME}") == 1:
            return Resolved(MANIFEST_NAME, latest, 1)
    if data is None:
        top = _latest_number(read, where)
        gone = "no longer kept there: `vlmprep gc` removes old versions; " if isinstance(top, int) and n < top else ""
        raise VersionError(
            f"{where}@v{n}: no such version ({gone}{_latest(read, where)}; `vlmprep versions {where}` lists them)"
        )
    number = _number_of(data, f"{where}/{name}")
    if number != n:
        raise VersionError(f"{where}/{name}: claims to be version {number}, not {n}; refusing it")
    return Resolved(name, data, n)


def _number_of(data: bytes, where: str) -> int:
    try:
        return record_number(load_json(data, where, LIMITS.manifest_bytes))
    except VersionError as e:
        raise VersionError(f"{where}: {e}") from None


def _latest_number(read: Read, where: str) -> int | str:
    """The latest version's number, from manifest.json; what is wrong with it where there is none to read."""
    try:
        data = read(MANIFEST_NAME, LIMITS.manifest_bytes)
        return "no manifest.json there" if data is None else _number_of(data, where)
    except ValueError:
        return "its manifest.json is unreadable"


def _latest(read: Read, where: str) -> str:
    """`the latest is vN`, from manifest.json, for messages that list what exists."""
    top = _latest_number(read, where)
    return f"the latest is v{top}" if isinstance(top, int) else top


def read_plain_file(path: str | os.PathLike, limit: int) -> bytes:
    """A dataset's small file (a manifest, a version record, a tag, a processor config) read whole: opened without
    waiting on a FIFO, refused unless a regular file (UnsafeDataset, one line), and at most `limit` bytes read
    (ValueError for more, or a file that grows past it while read). FileNotFoundError where it is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | os.O_NOCTTY)
    except FileNotFoundError:
        raise  # the caller's to say (a Read: None)
    except OSError as e:
        raise UnsafeDataset(f"{path}: cannot read it ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeDataset(f"{path}: not a plain file (a FIFO, device or dir); refusing to read it")
        if st.st_size > limit:
            raise ValueError(f"{path} is {st.st_size} bytes, more than a reader accepts ({limit})")
        chunks, got = [], 0
        while got <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - got))):
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > limit:  # grew while read
        raise ValueError(f"{path} is more than {limit} bytes, more than a reader accepts")
    return b"".join(chunks)


def local_reader(base: str) -> Read:
    """A Read over a local dataset dir: each name resolved inside it (boundary.dataset_file: plain names, no symlink
    out), opened without waiting on a FIFO, refused unless a regular file, and read to at most `limit` bytes."""

    def read(name: str, limit: int) -> bytes | None:
        try:
            return read_plain_file(dataset_file(str(base), name, where=str(base), what="file"), limit)
        except FileNotFoundError:
            return None

    return read

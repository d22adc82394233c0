"""The tar header of a shard member as vlmprep's writer writes it (tarfile's own ustar bytes with fixed metadata), and
the readers' fast parse of a byte range made only of such headers: a header is taken without tarfile only where it is,
byte for byte, the header the writer writes for its name and size (so tarfile would read it as that regular member);
any other byte range (a foreign or older tar, links, long names, a bad checksum, trailing bytes) returns None and the
caller reads it with tarfile, every check as before. And a sample's format version from its member names
(sample_version), which every reader of a tar stream or byte range without a manifest calls.
"""

from __future__ import annotations

import re
import tarfile

from vlmprep_schemas.delta import PDELTA
from vlmprep_schemas.views import VIEWS_MEMBER

BLOCK = tarfile.BLOCKSIZE


def tar_header(name: str, size: int) -> bytes:
    """The tar header block of one member, fixed metadata: same input + config gives byte-identical tars."""
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")  # tarfile.open's own defaults


_BLANK = tar_header("", 0)
# The checksum (tarfile's: the byte sum, its own field counted as spaces) of the blank header less its name (all
# NUL) and size field: a member's is this plus the sums of its name and size field.
_BLANK_SUM = sum(_BLANK[:148]) + 8 * ord(" ") + sum(_BLANK[156:]) - sum(_BLANK[124:136])
_HEAD, _MID, _TAIL = _BLANK[100:124], _BLANK[136:148], _BLANK[155:]
_SIZE_FIELD = re.compile(rb"[0-7]{11}\0")


def member_header(name: str, size: int) -> bytes:
    """tar_header's bytes: for a short ASCII name (every member name of the format) the blank header with the name,
    size and checksum written in as tarfile writes them (a tenth of its time, ~10 headers a sample); tarfile's own
    header otherwise (tests/test_format_contract.py compares the two)."""
    raw = name.encode("ascii", "replace")
    if len(raw) > 100 or not name.isascii() or size >= 8**11:
        return tar_header(name, size)
    return _assemble(raw, b"%011o\0" % size)


def _assemble(raw: bytes, size_field: bytes) -> bytes:
    checksum = _BLANK_SUM + sum(raw) + sum(size_field)
    return b"".join((raw, bytes(100 - len(raw)), _HEAD, size_field, _MID, b"%06o\0" % checksum, _TAIL))


class PlainMember:
    """A member read by plain_members: its name, size and bytes, with the TarInfo methods the readers' checks ask."""

    __slots__ = ("name", "size", "data")

    def __init__(self, name: str, size: int, data: bytes):
        self.name, self.size, self.data = name, size, data

    def isfile(self) -> bool:
        """Always: the writer's header is a regular file's."""
        return True

    def issparse(self) -> bool:
        """Never: the writer's header is a regular file's."""
        return False


def plain_members(chunk: bytes) -> list[PlainMember] | None:
    """The members of `chunk` (whole member headers and data, from its start) where every header is the writer's own
    (member_header's bytes for its name and size: a regular file, a valid checksum) and the members fill the chunk to
    its end (the last one's padding may be cut); None otherwise (then tarfile decides what the bytes hold)."""
    out: list[PlainMember] = []
    at, n = 0, len(chunk)
    while at < n:
        header = chunk[at : at + BLOCK]
        end = header.find(0, 0, 100)
        size_field = header[124:136]
        if end <= 0 or len(header) < BLOCK or not _SIZE_FIELD.fullmatch(size_field):
            return None
        raw = header[:end]
        if not raw.isascii() or header != _assemble(raw, size_field):
            return None
        size = int(size_field[:11], 8)
        data_at = at + BLOCK
        if data_at + size > n:
            return None
        out.append(PlainMember(raw.decode("ascii"), size, chunk[data_at : data_at + size]))
        at = data_at + -(-size // BLOCK) * BLOCK
    return out or None


def sample_version(names) -> int:
    """A sample's format version from its member names (v2 added image_index.npy, v3 video_grid_thw.npy, v4
    .pdelta.zst images, v5 views members): a tar stream or a pipe: source has no manifest."""
    if "video_grid_thw.npy" in names:
        if any(VIEWS_MEMBER.match(str(n)) for n in names):
            return 5
        return 4 if any(str(n).endswith(PDELTA) for n in names) else 3
    return 2 if "image_index.npy" in names else 1

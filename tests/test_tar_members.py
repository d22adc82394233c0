"""vlmprep_schemas.tar_members: the readers' parse of a sample's byte range without tarfile takes exactly the headers
the writer writes (and gives what tarfile gives for them); every other byte range is left to tarfile (None)."""

from __future__ import annotations

import io
import tarfile

import pytest

from vlmprep_schemas.tar_members import member_header, plain_members, tar_header


def _writer_bytes(members: list[tuple[str, bytes]], *, pad_last: bool = True) -> bytes:
    """Members as the shard writer lays them out: its header, the data, zeros to a whole block."""
    out = b""
    for i, (name, data) in enumerate(members):
        out += member_header(name, len(data)) + data
        if pad_last or i < len(members) - 1:
            out += bytes(-len(data) % tarfile.BLOCKSIZE)
    return out


def _tarfile_members(chunk: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as tar:
        return [(ti.name, tar.extractfile(ti).read()) for ti in tar if ti.isfile()]


MEMBERS = [
    ("0000000007.json", b'{"id": "x"}'),
    ("0000000007.input_ids.npy", bytes(range(256)) * 3),
    ("0000000007.img000.orig.jpg", b"\xff\xd8" + b"j" * 1022),  # a whole number of blocks: no padding
    ("0000000007.empty.npy", b""),
]


@pytest.mark.parametrize("pad_last", [True, False])
def test_the_writers_members_read_as_tarfile_reads_them(pad_last):
    chunk = _writer_bytes(MEMBERS, pad_last=pad_last)
    plain = plain_members(chunk)
    assert plain is not None
    assert [(m.name, m.data) for m in plain] == _tarfile_members(chunk) == MEMBERS
    assert all(m.isfile() and not m.issparse() and m.size == len(m.data) for m in plain)


def test_the_fast_header_is_tarfiles_header():
    for name, data in MEMBERS:
        assert member_header(name, len(data)) == tar_header(name, len(data))


def _tar_of(*infos: tuple[tarfile.TarInfo, bytes], fmt=tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for ti, data in infos:
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, size: int = 0, **kw) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = size, 0o644, 0
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _hostile() -> dict[str, bytes]:
    good = _writer_bytes(MEMBERS[:2])
    bad_sum = bytearray(good)
    bad_sum[150] ^= 1  # a checksum digit
    other_field = bytearray(good)
    other_field[108] = ord("1")  # uid: tarfile still reads it (its checksum fixed), but it is not the writer's header
    other_field[148:155] = b"%06o\0" % (sum(other_field[:148]) + 256 + sum(other_field[156:512]))
    return {
        "bad checksum": bytes(bad_sum),
        "a field the writer never writes": bytes(other_field),
        "trailing zero blocks (the end of a tar)": good + bytes(1024),
        "trailing bytes": good + b"x" * 100,
        "data cut short": good[: len(good) - 600],
        "a symlink": _tar_of((_info("0000000007.json", type=tarfile.SYMTYPE, linkname="/etc/passwd"), None)),
        "a GNU long name": _tar_of((_info("k." + "a" * 120, 3), b"abc"), fmt=tarfile.GNU_FORMAT),
        "a pax header": _tar_of((_info("k.json", 3, pax_headers={"comment": "x"}), b"abc"), fmt=tarfile.PAX_FORMAT),
        "a mtime": _tar_of((_info("k.json", 3, mtime=5), b"abc")),
        "a non-ASCII name": _writer_bytes([("\u00e9.json", b"abc")]),
        "a name with no NUL": _writer_bytes([("a" * 100, b"abc")]),
        "an empty range": b"",
        "a short header": good[:300],
    }


@pytest.mark.parametrize("case", sorted(_hostile()))
def test_any_other_bytes_are_left_to_tarfile(case):
    assert plain_members(_hostile()[case]) is None

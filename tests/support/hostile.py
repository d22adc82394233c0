"""Hostile datasets for the readers' tests: members that claim far more than they hold (a zstd frame or PNG header
declaring gigabytes, a .npy header declaring terabytes, json nested 200,000 deep, a sparse tar member), forged into a
copy of a built dataset whose manifest is resealed; every reader run over it under an address-space limit, each
outcome reduced to what a user sees."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import resource
import shutil
import struct
import sys
import tarfile
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard
from PIL import Image

# --- members that claim more than they hold


def zstd_claiming(declared: int, payload: bytes = b"\x93NUMPY") -> bytes:
    """A zstd frame whose header declares `declared` content bytes (single segment), holding only `payload`."""
    block = (len(payload) << 3) | 1  # a raw block, the last one
    return struct.pack("<IBQ", 0xFD2FB528, 0xE0, declared) + block.to_bytes(3, "little") + payload


def png_claiming(width: int, height: int) -> bytes:
    """A valid 8x8 PNG whose IHDR (CRC fixed) claims width x height pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 120, 200)).save(buf, format="PNG")
    b = bytearray(buf.getvalue())
    b[16:24] = struct.pack(">II", width, height)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])) & 0xFFFFFFFF)
    return bytes(b)


def jpeg_claiming(width: int, height: int, data: bytes | None = None) -> bytes:
    """A JPEG (`data`, else a valid 64x48 one) whose SOF header claims width x height pixels: the scan after it holds
    the few pixels it had, so a decoder runs out of data long before the size it was told to allocate."""
    if data is None:
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (10, 120, 200)).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
    b = bytearray(data)
    at = next(i for i in range(2, len(b) - 9) if b[i] == 0xFF and b[i + 1] in (0xC0, 0xC1, 0xC2))
    b[at + 5 : at + 9] = struct.pack(">HH", height, width)  # marker, length, precision, then height and width
    return bytes(b)


def npy_claiming(shape: tuple, descr: str = "<i4", data: bytes = b"\0" * 16) -> bytes:
    """A .npy whose header declares `shape` of `descr`, followed by only `data`."""
    header = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode() + b" "
    header += b" " * (-(len(header) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + data


def black_pdelta(height: int, width: int) -> bytes:
    """A legal .pdelta.zst member without a prefix: a black height x width image (its filtered rows are zeros too),
    compressed as it streams, so a few KB that decode to 3 x height x width bytes, allocated nowhere here."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (height, width, 3)})
    header, size = buf.getvalue(), 3 * height * width
    z = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=len(header) + size)
    chunk, out = bytes(1 << 24), [z.compress(header)]
    for _ in range(size // len(chunk)):
        out.append(z.compress(chunk))
    out += [z.compress(bytes(size % len(chunk))), z.flush()]
    return b"".join(out)


def deep_json(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


# --- shards


def small_dataset(d: Path, *, images: int = 1, image_format: str = "zstd", photo: bool = False) -> Path:
    """d/ds: one shard of a sample with an image (or `images` of one size: zstd-pdelta then stores each later one
    against the one before; `photo`: JPEGs, which --image-format auto stores as their bytes, `orig.jpg`) and a
    4-frame video (Qwen2-VL, zstd members) and a text-only one."""
    import base64

    from tests.support.videos import encode, frames
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    (d / "clip.mp4").write_bytes(encode(frames(4, 64, 48), 2))
    parts = []
    for k in range(images):
        buf = io.BytesIO()
        Image.fromarray(frames(1, 224, 160, seed=3 + k)[0]).save(buf, format="JPEG" if photo else "PNG", quality=90)
        kind = "jpeg" if photo else "png"
        parts.append(
            {
                "type": "image_url",
                "image_url": {"url": f"data:image/{kind};base64," + base64.b64encode(buf.getvalue()).decode()},
            }
        )
    records = [
        {
            "id": "iv",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what happens?"},
                        *parts,
                        {"type": "video", "video": "clip.mp4"},
                    ],
                },
                {"role": "assistant", "content": "a square moves."},
            ],
        },
        {"id": "t", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    (d / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build(
        BuildConfig(
            inputs=(str(d / "r.jsonl"),),
            out=str(d / "ds"),
            processor="tiny:qwen2-vl",  # Qwen2-VL's classes over a small vocabulary: every reader loads it fast
            seq_len=4096,
            samples_per_shard=10,
            image_format=image_format,
            progress=False,
        )
    )
    return d / "ds"


def image_spec(d: Path):
    """The trainer's ImageSpec (with the video processor's) of dataset d."""
    from trainer.data.processors import load_image_processor_config, load_video_processor_config
    from trainer.data.vision import ImageSpec

    loc = str(d / "processor")
    return ImageSpec.from_config(load_image_processor_config(loc), load_video_processor_config(loc))


def read_members(tar: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(tar) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers() if m.isfile()]


def _sparse_header(name: str, data: bytes, claimed: int) -> bytes:
    """An old-GNU sparse member header ('S'): `data` stored at offset 0 of a file that claims `claimed` bytes, the
    rest a hole that a reader expanding it would fill with zeros."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.type = len(data), tarfile.GNUTYPE_SPARSE
    buf = bytearray(ti.tobuf(format=tarfile.GNU_FORMAT))
    buf[386:398] = tarfile.itn(0, 12, tarfile.GNU_FORMAT)  # first sparse struct: offset 0 ...
    buf[398:410] = tarfile.itn(len(data), 12, tarfile.GNU_FORMAT)  # ... len(data) bytes
    buf[482] = 0  # no extended sparse headers
    buf[483:495] = tarfile.itn(claimed, 12, tarfile.GNU_FORMAT)  # the size it claims
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf[:512])
    return bytes(buf)


def write_tar(
    path: Path,
    members: list[tuple[str, bytes]],
    *,
    sparse: dict[str, int] | None = None,
    types: dict[str, bytes] | None = None,
    fmt: int = tarfile.GNU_FORMAT,
) -> bytes:
    """The members as a tar: a member named in `sparse` as a GNU sparse member claiming that size, one named in
    `types` as that tar type (a symlink, hard link, directory, FIFO or device, linking to ../outside)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for name, data in members:
            if sparse and name in sparse:
                tf.fileobj.write(_sparse_header(name, data, sparse[name]))
                tf.fileobj.write(data + b"\0" * (-len(data) % 512))
                tf.offset += 512 + len(data) + (-len(data) % 512)
                continue
            ti = tarfile.TarInfo(name)
            if types and name in types:
                ti.type, ti.linkname = types[name], "../outside/secret.json"
                tf.addfile(ti)
                continue
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    path.write_bytes(out.getvalue())
    return out.getvalue()


def reseal(d: Path, shard: str = "shard-000000.tar") -> None:
    """The attacker's manifest: the shard's bytes and sha256 as they now are, so only the readers stand between
    the members and the reader's memory."""
    m = json.loads((d / "manifest.json").read_text())
    data = (d / shard).read_bytes()
    for s in m["shards"]:
        if s["name"] == shard:
            s.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (d / "manifest.json").write_text(json.dumps(m))


def copy_dataset(src: Path, dst: Path, *, processor: bool = True, indexes: bool = False) -> Path:
    """A dataset's manifest and shards (and its processor dir, or only the processor's small config files; with
    `indexes` its sample index files too)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and (p.suffix == ".tar" or p.name == "manifest.json" or (indexes and p.name.endswith(".npy"))):
            shutil.copyfile(p, dst / p.name)
    if processor:
        shutil.copytree(src / "processor", dst / "processor")
    else:
        (dst / "processor").mkdir()
        for p in (src / "processor").glob("*processor_config.json"):
            shutil.copyfile(p, dst / "processor" / p.name)
    return dst


def seal_indexes(d: Path, manifest: dict) -> None:
    """The attacker's manifest for sample index files: each one it lists (and d holds) with its bytes and sha256 as
    they now are, so only the readers' checks of the rows stand between them and the reader's memory."""
    shards = manifest.get("shards")
    listed = [s.get("index") for s in (shards if isinstance(shards, list) else []) if isinstance(s, dict)]
    listed.append(manifest.get("sample_index"))
    for entry in listed:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str) and (d / entry["name"]).is_file():
            data = (d / entry["name"]).read_bytes()
            entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


def patch_members(tar: Path, data: dict[str, bytes]) -> None:
    """Members' bytes replaced in place by as many others (member name -> bytes): every offset in the tar stays, so
    the sample index files still describe it."""
    with tarfile.open(tar) as tf:
        spans = {m.name: (m.offset_data, m.size) for m in tf.getmembers()}
    with open(tar, "r+b") as f:
        for name, b in data.items():
            offset, size = spans[name]
            assert len(b) == size, f"{name}: {len(b)} bytes for {size}"
            f.seek(offset)
            f.write(b)


def forge(src: Path, dst: Path, edit, *, sparse: dict[str, int] | None = None, processor: bool = True) -> Path:
    """A copy of dataset `src` whose first shard's members are `edit(members)` ([(name, bytes)] in tar order),
    resealed in the manifest."""
    copy_dataset(src, dst, processor=processor)
    write_tar(dst / "shard-000000.tar", edit(read_members(src / "shard-000000.tar")), sparse=sparse)
    reseal(dst)
    return dst


def replace_member(members, key: str, ext: str, data: bytes, *, rename: str | None = None):
    """members with KEY.EXT's bytes replaced (and the member renamed to KEY.RENAME)."""
    return [
        (f"{key}.{rename}" if rename and n == f"{key}.{ext}" else n, data if n == f"{key}.{ext}" else d)
        for n, d in members
    ]


# --- memory


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space(extra: int):
    """This process's address space capped at its current size + `extra` bytes for the block (RLIMIT_AS, soft limit
    only, restored after): an allocation a hostile member provokes fails as MemoryError instead of swapping."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + extra
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# --- every reader


@dataclass
class Outcome:
    reader: str
    ok: bool  # read to the end
    message: str  # the one line a user sees on refusal ("" when ok)
    samples: list | None = None  # what it read (ids), when ok
    crash: str = ""  # a traceback: anything but a clean refusal


READERS = ("verify", "inspect", "stats", "trainer-stream", "trainer-indexed", "wds", "hf", "energon", "collator")
# The trainer's start-up from the build's sample index files (the dataset's, or each shard's), then one read a sample:
# only over a dataset that holds them (forge leaves them out, copy_dataset(indexes=True) keeps them).
INDEX_READER = "trainer-rows"
# Readers whose tar is read by another library (webdataset's, energon's own reader, stood in for by tarfile here):
# what that library raises over a broken tar is its own error, before vlmprep is handed a sample.
THIRD_PARTY_TAR = ("wds", "energon", "collator")


def cli(args: list[str]) -> tuple[bool, str, str]:
    """`vlmprep ARGS` in process: (exit 0?, its output, the traceback of anything but SystemExit, else "")."""
    from typer.testing import CliRunner

    from vlmprep.cli import app

    res = CliRunner().invoke(app, args, env={"COLUMNS": "200", "TERM": "dumb"})
    crash = (
        ""
        if res.exception is None or isinstance(res.exception, SystemExit)
        else "".join(traceback.format_exception(res.exception))
    )
    return res.exit_code == 0, res.output, crash


def run_reader(reader: str, d: Path, *, spec=None, collator=None) -> Outcome:
    """One reader over dataset dir d, as a user runs it; a refusal is the exception's message (libraries) or the CLI's
    output and exit 1, anything else is a crash with its traceback."""
    from trainer.data.errors import DataError
    from vlmprep.shards.reader import ShardFormatError

    try:
        if reader in ("verify", "inspect", "stats"):
            args = {
                "verify": ["verify", str(d)],
                "inspect": ["inspect", str(d), "--limit", "100"],
                "stats": ["stats", str(d)],
            }[reader]
            ok, output, crash = cli(args)
            return Outcome(reader, ok, "" if ok else output.strip(), crash=crash)
        ids = [s["id"] if isinstance(s, dict) else s.id for s in _read(reader, d, spec, collator)]
        return Outcome(reader, True, "", ids)
    except Exception as e:  # noqa: BLE001 - anything but a clean refusal is what the tests must never see
        library = _raised_in(e, ("/webdataset/", "/tarfile.py"))
        if reader in THIRD_PARTY_TAR and library and not isinstance(e, (MemoryError, RecursionError)):
            return Outcome(reader, False, f"{d}: {library.strip('/')}: {type(e).__name__}: {e}".splitlines()[0])
        if isinstance(e, (DataError, ShardFormatError, ValueError)):
            return Outcome(reader, False, str(e))
        return Outcome(reader, False, "", crash="".join(traceback.format_exception(e)))


def _raised_in(e: BaseException, places: tuple[str, ...]) -> str:
    """Which of `places` (parts of a file path) the innermost frame of e's traceback is in, or ""."""
    frames = traceback.extract_tb(e.__traceback__)
    return next((p for p in places if frames and p in frames[-1].filename), "")


def _read(reader: str, d: Path, spec, collator) -> list:
    import vlmprep.clients.wds as wds_client
    from trainer.data.decode import OriginalResizer, decode_sample
    from trainer.data.sources import resolve_data
    from vlmprep.shards.reader import load_manifest, shard_paths

    if reader == "trainer-stream":
        from trainer.data.streams import RankStream

        return list(RankStream(list(resolve_data(str(d)).shards), start=0, spec=spec))
    if reader == INDEX_READER:
        from trainer.config import DataSpec
        from trainer.data.index import read_indexed
        from trainer.data.pipeline import rank_sources
        from trainer.data.sources import plan_shards

        data = resolve_data(str(d))
        (source,), _ = rank_sources(
            (DataSpec(path=str(d)),), [data], [plan_shards(data.shards, 1)], rank=0, world=1, cache=d / "shard-cache"
        )
        out = []
        for shard, index in zip(source.shards, source.indexes):
            for i in range(index.num_samples):
                key, members = read_indexed(index, i)
                out.append(
                    decode_sample(members, key=key, url=shard.url, spec=spec, resize_original=OriginalResizer(spec))
                )
        return out
    if reader == "trainer-indexed":
        from trainer.data.index import index_shard, read_indexed

        out = []
        for shard in resolve_data(str(d)).shards:
            index = index_shard(shard.url, expect=shard.num_samples)
            for i in range(index.num_samples):
                key, members = read_indexed(index, i)
                out.append(
                    decode_sample(members, key=key, url=shard.url, spec=spec, resize_original=OriginalResizer(spec))
                )
        return out
    if reader in ("wds", "collator"):
        import webdataset

        samples = list(
            webdataset.WebDataset(wds_client.shard_urls(d), shardshuffle=False, empty_check=False).map(
                wds_client.decode
            )
        )
        if reader == "collator" and samples:
            collator(samples)
        return samples
    if reader == "hf":
        from vlmprep.clients.hf import generate_samples

        manifest = load_manifest(d)
        return list(generate_samples([str(p) for p in shard_paths(d, manifest)], manifest.format_version))
    if reader == "energon":
        from vlmprep.clients.energon import sample_loader

        out = []
        for path in shard_paths(d, load_manifest(d)):  # the raw members energon's tar reader hands sample_loader
            raw: dict[str, dict] = {}
            for name, data in read_members(path):
                key, _, member = name.rpartition("/")[2].partition(".")
                raw.setdefault(key, {"__key__": key, "__shard__": path.name})[member] = data
            out += [sample_loader(r) for r in raw.values()]
        return out
    raise AssertionError(reader)


def every_reader(d: Path, *, spec, collator, readers=READERS, extra: int = 1 << 30) -> list[Outcome]:
    """Every reader over d, each under an address-space cap of its current size + `extra`."""
    out = []
    for reader in readers:
        with address_space(extra):
            out.append(run_reader(reader, d, spec=spec, collator=collator))
    return out


def one_line_refusal(o: Outcome, *names: str) -> str:
    """Assert a clean refusal: no traceback, a one-line message (verify: one line per violation) naming `names`."""
    assert not o.crash, f"{o.reader} crashed:\n{o.crash[-3000:]}"
    assert not o.ok, f"{o.reader} read the hostile dataset without a word"
    lines = [ln for ln in o.message.splitlines() if ln.strip()]
    assert "Traceback" not in o.message and lines, f"{o.reader}: {o.message[-2000:]}"
    if o.reader != "verify":
        assert len(lines) == 1, f"{o.reader} said more than one line:\n{o.message[-2000:]}"
    for name in names:
        assert any(name in ln for ln in lines), f"{o.reader} does not name {name!r}: {o.message[-2000:]}"
    print(f"{o.reader}: {lines[0][:200]}", file=sys.stderr)
    return lines[0]

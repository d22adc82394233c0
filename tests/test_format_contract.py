"""The shard-format contract between vlmprep and the trainer (which never import each other): one member-name rule
in schemas/, everything vlmprep can write the trainer accepts, v1 datasets still read, the package reads as the flow
(no import cycle, only shards/reader.py opens shard tars), and a normal wheel install carries the schemas."""

import ast
import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def test_vlmprep_and_trainer_read_the_same_rule():
    import trainer.data.decode as td
    import vlmprep.shards.format as vf

    assert {n: (a.dtype, a.ndim, a.since) for n, a in vf.ARRAYS.items()} == td.NPY_MEMBERS
    assert {n: a.shape for n, a in vf.ARRAYS.items()} == td.NPY_SHAPES
    assert all(len(a.shape) == a.ndim for a in vf.ARRAYS.values())
    assert vf.META_MEMBER == td.META_MEMBER
    for version in vf.READABLE_VERSIONS:
        assert vf._IMAGE[version].pattern == td.IMAGE_MEMBER[version].pattern
        assert td.arrays_of(version) == list(vf.arrays_of(version))
    names = [
        "img000.delta.zst",
        "img001.pdelta.zst",
        "img000.npy.zst",
        "img000.delta.npy",
        "img007.png",
        "img123.webp",
        "img000.orig.jpg",
        "img001.orig.png",
        "img002.orig.webp",
        "img000.orig.ppm",
        "img000.orig.tiff",
        "image_index.npy",
        "input_ids.npy",
        "json",
        "state.pyd",
        "x.pth",
        "img0000.png",
        "img000.npy",
    ]
    for version in vf.READABLE_VERSIONS:
        for n in names:
            trainer_ok = n in td.arrays_of(version) or n == td.META_MEMBER or bool(td.IMAGE_MEMBER[version].match(n))
            assert vf.is_member(n, version) == trainer_ok, (n, version)
    assert not vf.is_member("img000.orig.ppm", 2) and vf.is_member("img000.orig.ppm", 1)
    assert vf.is_member("img000.delta.zst", 3) and vf.is_video_member("vid000.0000.delta.zst", 3)
    assert not vf.is_member("img000.delta.zst", 1) and not vf.is_member("img000.delta.npy", 3)
    assert vf.is_member("img001.pdelta.zst", 4) and not vf.is_member("img001.pdelta.zst", 3)  # v4 added it
    assert td.sample_version(["video_grid_thw.npy", "img000.pdelta.zst"]) == 4
    assert td.sample_version(["video_grid_thw.npy", "img000.delta.zst"]) == 3
    assert vf.sample_key(12) == "0000000012" and vf.sample_key(12, 3) == "0000000012_0003"


def _img(mode, fmt, size=(70, 50), **kw):
    color = {
        "RGB": (200, 40, 90),
        "RGBA": (10, 120, 200, 90),
        "CMYK": (10, 20, 30, 40),
        "P": 3,
        "L": 90,
        "I;16": 40000,
        "LA": (90, 128),
    }[mode]
    im = Image.new(mode, size, color)
    if mode == "RGB":
        im.putpixel((3, 4), (0, 255, 0))
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


SOURCES = {  # every source kind vlmprep accepts as an image
    "png_rgb": _img("RGB", "PNG"),
    "jpeg": _img("RGB", "JPEG", quality=90),
    "webp": _img("RGB", "WEBP", lossless=True),
    "gif": _img("P", "GIF"),
    "bmp": _img("RGB", "BMP"),
    "tiff": _img("RGB", "TIFF"),
    "ppm": _img("RGB", "PPM"),
    "palette_png": _img("P", "PNG"),
    "rgba_png": _img("RGBA", "PNG"),
    "gray_png": _img("L", "PNG"),
    "gray16_png": _img("I;16", "PNG"),
    "cmyk_jpeg": _img("CMYK", "JPEG"),
    "la_png": _img("LA", "PNG"),
}


def _records(path: Path) -> Path:
    lines = []
    for i, (name, data) in enumerate(SOURCES.items()):
        uri = "data:image/x;base64," + base64.b64encode(data).decode()
        parts = [{"type": "text", "text": f"look {name}"}, {"type": "image_url", "image_url": {"url": uri}}]
        if i % 3 == 0:  # a repeated image: stored once, two occurrences
            parts.append({"type": "image_url", "image_url": {"url": uri}})
        lines.append(
            json.dumps(
                {
                    "id": name,
                    "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": f"seen {name}"}],
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def _trainer_samples(ds: Path):
    from trainer.data.decode import OriginalResizer, decode_sample
    from trainer.data.processors import load_image_processor_config
    from trainer.data.tars import iter_tar_samples
    from trainer.data.vision import ImageSpec

    spec = ImageSpec.from_config(load_image_processor_config(str(ds / "processor")))
    out = {}
    for shard in sorted(ds.glob("shard-*.tar")):
        for _, key, members in iter_tar_samples(str(shard), lambda i: True):
            out[key] = decode_sample(members, key=key, url=str(shard), spec=spec, resize_original=OriginalResizer(spec))
    return out


# The format tests of older datasets read what a build wrote, not the vocabulary: Qwen2-VL's classes over a small one.
TINY = "tiny:qwen2-vl"


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return _records(tmp_path_factory.mktemp("contract") / "all_sources.jsonl")


@pytest.mark.parametrize("fmt", ["auto", "zstd-pdelta", "zstd-delta", "zstd", "png", "webp", "original"])
def test_everything_vlmprep_writes_the_trainer_accepts(fmt, records, tmp_path, qwen2vl_processor):
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.shards.format import is_key, is_member
    from vlmprep.shards.reader import iter_dataset

    out = tmp_path / fmt
    res = build(BuildConfig(inputs=(str(records),), out=str(out), image_format=fmt, progress=False))
    assert res.manifest.totals["rejected"] == 0, (out / "rejects.jsonl").read_text()
    assert res.manifest.totals["samples"] == len(SOURCES)
    trained = _trainer_samples(out)
    assert len(trained) == len(SOURCES)
    for s in iter_dataset(out):
        assert is_key(s.key) and all(is_member(n) for n in s.names) and not s.unknown
        t = trained[s.key]
        np.testing.assert_array_equal(t.input_ids, s.array("input_ids"))
        assert t.image_index == s.image_index().tolist()
        members = s.image_members()
        for k, pixels in enumerate(s.images()):
            if ".orig." not in members[k]:  # orig members hold the source; the trainer resizes it at load time
                np.testing.assert_array_equal(np.asarray(t.images[t.image_index[k]]), pixels)
    if fmt == "auto":  # the JPEGs kept as their bytes, the rest as pixels: the trainer's pixels are zstd-pdelta's
        kinds = {m["member"].split(".", 1)[1] for s in iter_dataset(out) for m in s.meta()["images"]}
        assert kinds == {"orig.jpg", "pdelta.zst"}, kinds
        build(BuildConfig(inputs=(str(records),), out=str(tmp_path / "p"), image_format="zstd-pdelta", progress=False))
        stored = _trainer_samples(tmp_path / "p")
        for key, t in trained.items():
            for a, b in zip(t.images, stored[key].images, strict=True):
                np.testing.assert_array_equal(a, b)


def _without_new_meta_fields(src: Path, dst: Path) -> Path:
    """A copy of a v4 dataset as a build before per-image storage wrote it: no image entry has source_bytes or
    sha256 (the shards resealed, their sample index files dropped)."""
    from benchmarks.bench_loader import as_format

    def strip(meta: dict) -> dict:
        for im in meta["images"]:
            im.pop("source_bytes", None), im.pop("sha256", None)
        return meta

    return as_format(src, dst, 4, edit_meta=strip)


def test_a_v4_dataset_built_before_per_image_storage_still_reads(records, tmp_path):
    """The meta's source_bytes and sha256 are additive within format 4: a dataset without them (a zstd-pdelta build
    of before, and an `original` one) verifies, its stats show each storage's bytes without a ratio, and the trainer
    reads the pixels it read before."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.verify import verify_dataset

    for fmt in ("zstd-pdelta", "original"):
        new = tmp_path / fmt
        build(BuildConfig(inputs=(str(records),), out=str(new), image_format=fmt, progress=False, processor=TINY))
        old = _without_new_meta_fields(new, tmp_path / f"{fmt}-old")
        assert verify_dataset(old) == []
        storage = compute_stats(old)["image_storage"]
        assert storage and all(c["source_bytes"] == 0 and c["unknown"] == c["images"] for c in storage.values())
        a, b = _trainer_samples(new), _trainer_samples(old)
        assert a.keys() == b.keys()
        for key in a:
            for x, y in zip(a[key].images, b[key].images, strict=True):
                np.testing.assert_array_equal(x, y)


def test_a_split_sample_key_is_read_by_the_trainer(tmp_path, qwen2vl_processor):
    from trainer.data.decode import OriginalResizer, decode_sample
    from trainer.data.processors import load_image_processor_config
    from trainer.data.tars import iter_tar_samples
    from trainer.data.vision import ImageSpec
    from vlmprep.config import BuildConfig
    from vlmprep.ingest.records import iter_records
    from vlmprep.process import Renderer
    from vlmprep.processors.load import save_processor
    from vlmprep.shards.format import sample_key
    from vlmprep.shards.writer import ShardWriter, encode_sample

    recs = _records(tmp_path / "r.jsonl")
    renderer = Renderer(BuildConfig(inputs=(str(recs),), out=str(tmp_path), progress=False), qwen2vl_processor)
    raw = next(iter_records([recs]))
    writer = ShardWriter(tmp_path, samples_per_shard=10, shard_size_bytes=1 << 30)
    for split in range(2):
        writer.write(
            encode_sample(
                renderer.render(raw)[0], key=sample_key(raw.position, split), image_format="zstd", zstd_level=3
            )
        )
    writer.close()
    save_processor(qwen2vl_processor, tmp_path / "processor")
    spec = ImageSpec.from_config(load_image_processor_config(str(tmp_path / "processor")))
    keys = []
    for _, key, members in iter_tar_samples(str(tmp_path / "shard-000000.tar"), lambda i: True):
        decode_sample(members, key=key, url="x", spec=spec, resize_original=OriginalResizer(spec))
        keys.append(key)
    assert keys == ["0000000000_0000", "0000000000_0001"]


def test_v1_datasets_are_still_read_by_verify_stats_inspect_and_the_trainer(records, tmp_path):
    from typer.testing import CliRunner

    from benchmarks.bench_loader import as_format_v1
    from vlmprep.builder.pipeline import build
    from vlmprep.cli import app
    from vlmprep.config import BuildConfig
    from vlmprep.shards.reader import iter_dataset
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.verify import verify_dataset

    v2 = tmp_path / "v2"  # zstd: what builds wrote in the days of format v1 (its member rule has no .delta.zst)
    build(BuildConfig(inputs=(str(records),), out=str(v2), image_format="zstd", progress=False, processor=TINY))
    v1 = as_format_v1(v2, tmp_path / "v1")
    assert verify_dataset(v1) == []
    assert compute_stats(v1)["samples"] == compute_stats(v2)["samples"] and not compute_stats(v1)["mismatches"]
    new, old = list(iter_dataset(v2)), list(iter_dataset(v1))
    assert [s.version for s in old] == [1] * len(new) and "image_index.npy" not in old[0].names
    for a, b in zip(new, old):
        assert a.image_index().tolist() == b.image_index().tolist()
        for x, y in zip(a.images(), b.images()):
            np.testing.assert_array_equal(x, y)
    t1, t2 = _trainer_samples(v1), _trainer_samples(v2)
    assert t1.keys() == t2.keys()
    for k in t1:
        assert t1[k].image_index == t2[k].image_index
        np.testing.assert_array_equal(t1[k].input_ids, t2[k].input_ids)
    res = CliRunner().invoke(app, ["inspect", str(v1), "--limit", "20"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert res.exit_code == 0 and res.stdout.count("=== sample") == len(SOURCES)


def test_v4_v3_and_v2_datasets_are_still_read_by_verify_stats_and_the_trainer(records, tmp_path):
    """Format v5 added views members, v4 .pdelta.zst images, v3 the video members; a v4 and a v3 dataset (zstd-delta
    images) and an image-only v2 one (no video_grid_thw / second_per_grid_ts) read as before, everywhere, with the
    pixels a v5 build stores; a .pdelta.zst member in a v3 dataset is refused unread, as any member its version does
    not name."""
    from benchmarks.bench_loader import as_format
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig
    from vlmprep.shards.format import FORMAT_VERSION
    from vlmprep.shards.reader import ShardFormatError, iter_dataset
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.verify import verify_dataset

    v4, delta = tmp_path / "built", tmp_path / "delta"  # the loop below writes tmp_path / "v4"
    build(BuildConfig(inputs=(str(records),), out=str(v4), progress=False, processor=TINY))
    build(
        BuildConfig(inputs=(str(records),), out=str(delta), image_format="zstd-delta", progress=False, processor=TINY)
    )
    assert json.loads((v4 / "manifest.json").read_text())["format_version"] == FORMAT_VERSION == 5
    assert any(n.endswith(".pdelta.zst") for s in iter_dataset(v4) for n in s.names)
    t4 = _trainer_samples(v4)
    for version in (4, 3, 2):  # v5 added views members, which these images (small photos, tiny:qwen2-vl) have none of
        old_dir = as_format(delta, tmp_path / f"v{version}", version)
        assert verify_dataset(old_dir) == []
        assert compute_stats(old_dir)["samples"] == compute_stats(v4)["samples"]
        assert not compute_stats(old_dir)["mismatches"]
        old = list(iter_dataset(old_dir))
        assert [s.version for s in old] == [version] * len(old)
        assert ("video_grid_thw.npy" in old[0].names) == (version >= 3)
        t_old = _trainer_samples(old_dir)
        assert t_old.keys() == t4.keys()
        for k in t_old:
            np.testing.assert_array_equal(t_old[k].input_ids, t4[k].input_ids)
            for a, b in zip(t_old[k].images, t4[k].images, strict=True):
                np.testing.assert_array_equal(a, b)
    mixed = as_format(v4, tmp_path / "v3-with-pdelta", 3)
    with pytest.raises(ShardFormatError, match="pdelta.zst.*not part of the vlmprep shard format"):
        list(iter_dataset(mixed))


def _vlmprep_imports() -> dict[str, set[str]]:
    """module -> vlmprep modules it imports (top level or inside functions), from the source."""
    pkg = ROOT / "vlmprep"
    graph = {}
    for f in pkg.rglob("*.py"):
        mod = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmprep"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("vlmprep.")}
        graph[mod] = {d for d in deps if d != mod and d != "vlmprep"}
    return graph


def test_the_package_has_no_import_cycle_and_only_the_reader_opens_shard_tars():
    graph = _vlmprep_imports()
    assert "vlmprep.inspect" not in graph, "a module named inspect shadows the stdlib"
    assert not any(m.startswith(("vlmprep.demo", "vlmprep.families.tiny")) for m in graph), "test/demo code ships"
    state: dict[str, int] = {}

    def visit(m, path):
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])
    openers = sorted(
        f.relative_to(ROOT).as_posix()
        for f in (ROOT / "vlmprep").rglob("*.py")
        if re.search(r"^\s*(import tarfile|from tarfile)", f.read_text(), re.M)
    )
    assert openers == ["vlmprep/shards/reader.py", "vlmprep/shards/writer.py"], openers


@pytest.mark.slow  # ~15 s: pip wheel + install --target
def test_a_normal_wheel_install_verifies_a_dataset(tmp_path, qwen2vl_processor):
    """`pip install vlmprep` (not -e): schemas and templates ship inside the wheel, `vlmprep verify` runs."""
    from vlmprep.builder.pipeline import build
    from vlmprep.config import BuildConfig

    rec = tmp_path / "r.jsonl"
    rec.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n"
    )
    build(BuildConfig(inputs=(str(rec),), out=str(tmp_path / "ds"), progress=False))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    (wheel,) = wheels.glob("vlmprep-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    assert (site / "vlmprep_schemas" / "shard_format.schema.json").is_file()
    assert (site / "vlmprep" / "templates" / "qwen2_vl_tools.jinja").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import vlmprep, vlmprep_schemas, trainer.data.decode; print(vlmprep.__file__, vlmprep_schemas.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.count(str(site)) == 2, probe.stdout  # the wheel's copy, not the source tree
    res = subprocess.run(
        [sys.executable, "-c", "from vlmprep.cli import main; main()", "verify", str(tmp_path / "ds")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout + res.stderr


# The package's roles and which roles each may import: the folders are the data flow (see docs/development.md).
_ROLES = {
    "base": (
        "vlmprep",
        "vlmprep_schemas",
        "vlmprep.types",
        "vlmprep.config",
        "vlmprep.options",
        "vlmprep.rejects",
        "vlmprep.processors",
        "vlmprep.jobs",
        "vlmprep.families",
    ),
    "ingest": ("vlmprep.ingest",),
    "pixels": ("vlmprep.pixels",),
    "render": ("vlmprep.render",),
    "process": ("vlmprep.process",),
    "shards": ("vlmprep.shards",),
    "build": ("vlmprep.builder",),
    "tools": ("vlmprep.tools",),
    "clients": ("vlmprep.clients",),
    "cli": ("vlmprep.cli", "vlmprep.cli_versions", "vlmprep.__main__"),
}
_MAY_IMPORT = {
    "base": {"base"},
    "ingest": {"base", "ingest"},  # files, tables and stores -> one Conversation
    "pixels": {"base", "pixels"},  # image and video bytes -> the processor's pixels
    "render": {"base", "pixels", "render"},  # a Conversation + pixels -> tokens and the loss mask
    "process": {"base", "ingest", "pixels", "render", "shards", "process"},  # a record -> encoded shard samples
    "shards": {"base", "ingest", "pixels", "shards"},
    "clients": {"base", "ingest", "pixels", "shards", "clients"},
    "tools": {"base", "ingest", "pixels", "render", "process", "shards", "tools"},  # tools never import the build
    "build": {"base", "ingest", "pixels", "render", "process", "shards", "clients", "build"},
    "cli": set(_ROLES),
}


def _role(module: str) -> str:
    best = max(
        ((p, r) for r, ps in _ROLES.items() for p in ps if module == p or module.startswith(p + ".")),
        key=lambda pr: len(pr[0]),
        default=None,
    )
    assert best is not None, f"{module} has no role in the layering: add it to _ROLES (and docs/development.md's map)"
    return best[1]


def test_each_role_imports_only_the_layers_below_it():
    """types/config <- stages <- shards <- process <- build <- cli; shards <- tools <- cli; tools never import build."""
    bad = sorted(
        f"{m} ({_role(m)}) imports {d} ({_role(d)})"
        for m, deps in _vlmprep_imports().items()
        for d in deps
        if _role(d) not in _MAY_IMPORT[_role(m)]
    )
    assert not bad, "\n".join(bad)


def test_the_writers_tar_headers_are_tarfiles_own():
    """The writer's fast tar header (the blank header with name, size and checksum written in) is tarfile's, byte for
    byte, and a name it does not take goes to tarfile, faults included."""
    from vlmprep.shards.writer import _member_header, _tar_header

    def header(f, name, size):
        try:
            return f(name, size)
        except ValueError as e:
            return repr(e)

    names = ["0000000000.img000.pdelta.zst", "0000000001_0003.input_ids.npy", "", "x", "a" * 100, "a" * 101]
    for name in [*names, "d/" + "a" * 99, "\u00e9.json", "a\udcff.npy"]:
        for size in (0, 1, 511, 512, 513, 10**6, 123456789, 8**11 - 1, 8**11):
            assert header(_member_header, name, size) == header(_tar_header, name, size), (name, size)


def test_the_writers_npy_bytes_are_np_saves():
    """npy_bytes builds a header once per dtype and shape: its bytes must stay np.save's, for every layout."""
    from vlmprep.shards.writer import npy_bytes

    arrays = [
        np.arange(5, dtype=np.int32),
        np.arange(5, dtype=np.int32),  # the cached header
        np.zeros((0, 3), np.int64),
        np.ones((3, 7), np.uint8),
        np.zeros((3, 0), np.float32),
        np.arange(12, dtype=np.int64).reshape(3, 4).T,  # Fortran order: np.save's own header and byte order
        np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # neither order
        np.array(5, dtype=np.int16),
        np.arange(6, dtype=">i4"),
    ]
    for a in arrays:
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        assert npy_bytes(a) == buf.getvalue(), (a.dtype, a.shape, a.strides)

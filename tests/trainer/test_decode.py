import io
import json

import numpy as np
import pytest
from PIL import Image

from tests.trainer.conftest import build_dataset, read_all_samples
from trainer.data.decode import OriginalResizer, decode_image, decode_sample
from trainer.data.errors import DataError
from trainer.data.tars import iter_tar_samples
from vlmprep.types import PreparedImage


def _first_members(dataset):
    for _, key, members in iter_tar_samples(str(dataset / "shard-000000.tar"), lambda i: True):
        if b'"images": [{' in members["json"]:
            return key, members
    raise AssertionError("fixture needs a sample with images")


def _npy(arr, **kw):
    buf = io.BytesIO()
    np.save(buf, arr, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["evil.pyd", "model.pth", "x.pickle", "input_ids.pyd", "img000.jpg.pyd"])
def test_unknown_member_extensions_are_refused(dataset, image_spec, name):
    key, members = _first_members(dataset)
    members = {**members, name: b"\x80\x04K\x01."}  # a pickle stream: must never be loaded
    with pytest.raises(DataError, match=f"member '{name}' is not part of the vlmprep shard format v3; refusing"):
        decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def test_stray_video_frames_are_refused_in_one_line(dataset, image_spec):
    """A frame member that no video of the sample's meta owns is one DataError naming the member, never read."""
    key, members = _first_members(dataset)
    members = {**members, "vid000.0000.png": b"not read"}
    with pytest.raises(DataError, match="frame members \\['vid000.0000.png'\\] belong to no video in the meta"):
        decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def test_pickled_npy_is_refused(dataset, image_spec):
    key, members = _first_members(dataset)
    members = {**members, "input_ids.npy": _npy(np.array([1, "x"], dtype=object), allow_pickle=True)}
    with pytest.raises(DataError, match="u.tar: sample .*allow_pickle"):
        decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def test_wrong_dtype_and_grid_mismatch_are_refused(dataset, image_spec):
    key, members = _first_members(dataset)
    bad = {**members, "input_ids.npy": _npy(np.zeros(3, dtype=np.int64))}
    with pytest.raises(DataError, match="input_ids.npy is int64"):
        decode_sample(bad, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    grid = np.load(io.BytesIO(members["image_grid_thw.npy"]))
    grid[0, 1] += 2
    bad = {**members, "image_grid_thw.npy": _npy(grid)}
    with pytest.raises(DataError, match="but the sample stores grid"):
        decode_sample(bad, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def test_sample_fields(dataset, image_spec):
    key, members = _first_members(dataset)
    s = decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    assert s.key == key and s.id.startswith("trace-")
    assert s.input_ids.dtype == np.int32 and s.position_ids.shape == (3, s.num_tokens)
    assert len(s.image_index) == len(s.image_grid_thw) and all(im.dtype == np.uint8 for im in s.images)


def test_png_member_decodes_to_the_same_pixels(dataset, image_spec):
    key, members = _first_members(dataset)
    s = decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    buf = io.BytesIO()
    Image.fromarray(s.images[0]).save(buf, format="PNG")
    np.testing.assert_array_equal(decode_image("img000.png", buf.getvalue(), None), s.images[0])


def test_an_encoded_image_member_is_opened_once(dataset, image_spec, monkeypatch):
    """An encoded image member's header, read to check its size before anything is allocated, is the one its decode
    goes on from: Image.open runs once a member (twice before: a JPEG's header parse is a tenth of its decode)."""
    key, members = _first_members(dataset)
    resize = OriginalResizer(image_spec)
    want = decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=resize)
    meta = json.loads(members["json"])
    unique = list(dict.fromkeys(im["member"] for im in meta["images"]))
    png = {m: m.split(".", 1)[0] + ".png" for m in unique}
    pngs = {k: v for k, v in members.items() if k not in png}
    for m, arr in zip(unique, want.images):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        pngs[png[m]] = buf.getvalue()
    for im in meta["images"]:
        im["member"] = png[im["member"]]
    pngs["json"] = json.dumps(meta).encode()
    opens = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opens.append(1) or real_open(*a, **k))
    got = decode_sample(pngs, key=key, url="u.tar", spec=image_spec, resize_original=resize)
    assert len(opens) == len(unique) > 0
    for a, b in zip(got.images, want.images):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # make test-all: keeps make test within its budget
def test_original_format_is_resized_at_load_time_like_the_build(traces, dataset, image_spec, tmp_path):
    orig = build_dataset(traces, tmp_path / "orig", image_format="original")
    a, b = read_all_samples(dataset, image_spec), read_all_samples(orig, image_spec)
    assert [s.id for s in a] == [s.id for s in b] and sum(len(s.images) for s in a) > 0
    for x, y in zip(a, b):
        assert len(x.images) == len(y.images)
        for u, v in zip(x.images, y.images):
            np.testing.assert_array_equal(u, v)


def _zst(raw: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(raw)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda a: _zst(_npy(np.ascontiguousarray(a.transpose(1, 0, 2)))),
            r"holds uint8 \(\d+, \d+, 3\), expected uint8 \(\d+, \d+, 3\) as its meta says",
        ),
        (lambda a: _zst(_npy(a[:-2])), "declares .* decompressed bytes, not a"),
        (lambda a: _zst(_npy(a.astype(np.int16))), "declares"),
        (lambda a: _zst(_npy(np.array([object()] * 3, dtype=object), allow_pickle=True)), "declares"),
        (lambda a: _zst(_npy(a.view(np.int8))), "holds int8"),
        (lambda a: (lambda z: z[: len(z) // 2])(_zst(_npy(a))), "stream ends|EOF"),
        (lambda a: _zst(_npy(a) + b"junk"), "data after the array|header and pixels disagree|holds"),
        (lambda a: _zst(b"\x93NUMPY\x09\x00" + b"x" * 100), "npy|declares"),
    ],
)
def test_stored_image_must_match_its_meta_and_is_never_unpickled(dataset, image_spec, make, message):
    """Images are decoded straight into a buffer sized from the meta: a member whose header disagrees, that is
    cut short, carries trailing data or an object array is refused with the shard and sample named."""
    key, members = _first_members(dataset)
    s = decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    bad = {**members, "img000.npy.zst": make(s.images[0])}
    with pytest.raises(DataError, match=f"u.tar: sample {key}: .*({message})"):
        decode_sample(bad, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def test_original_member_of_a_transformed_source_decodes_to_the_stored_pixels(qwen2vl_processor, tmp_path):
    # EXIF-rotated, 16-bit, alpha, palette: `orig.*` holds either untouched bytes or vlmprep's normalized PNG, and the
    # trainer's plain PIL + processor resize of it gives exactly the pixels vlmprep counted tokens for.
    from trainer.data.processors import load_image_processor_config
    from trainer.data.vision import ImageSpec
    from vlmprep.families import FAMILIES
    from vlmprep.pixels.images import encode_image, prepare_image, stored_ext
    from vlmprep.types import ImageData

    qwen2vl = FAMILIES["Qwen2VLProcessor"]
    qwen2vl_processor.save_pretrained(str(tmp_path))
    spec = ImageSpec.from_config(load_image_processor_config(str(tmp_path)))
    resize = OriginalResizer(spec)
    rgb = np.zeros((60, 92, 3), np.uint8)
    rgb[:, :46] = (220, 30, 30)
    rgb[:6] = (30, 200, 30)
    rgba = np.dstack([rgb, np.linspace(0, 255, 92).astype(np.uint8)[None, :].repeat(60, 0)])
    gray16 = np.linspace(0, 65535, 60 * 92).reshape(60, 92).astype(np.uint16)
    sources = []
    for arr, fmt, orientation in (
        (rgb, "JPEG", 6),
        (rgba, "PNG", 8),
        (gray16, "PNG", None),
        (rgb, "JPEG", None),
        (rgba, "PNG", None),
    ):
        im = Image.fromarray(arr)
        exif = im.getexif()
        if orientation:
            exif[0x0112] = orientation
        buf = io.BytesIO()
        im.save(buf, format=fmt, exif=exif)
        sources.append(buf.getvalue())
    pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
    buf = io.BytesIO()
    pal.save(buf, format="PNG", transparency=0)
    sources.append(buf.getvalue())
    exts = []
    for data in sources:
        prepared = prepare_image(ImageData(data, "src"), qwen2vl_processor, qwen2vl, max_pixels=10**8)
        name = "img000." + stored_ext("original", prepared)
        exts.append(name)
        np.testing.assert_array_equal(decode_image(name, encode_image(prepared, "original"), resize), prepared.pixels)
    assert exts == ["img000.orig.png"] * 3 + ["img000.orig.jpg", "img000.orig.png", "img000.orig.png"]


def test_zstd_delta_dataset_decodes_to_the_zstd_datasets_pixels(traces, dataset, image_spec, tmp_path):
    """The default codec (zstd-delta) through the loader's decode: every image and sample equals the same build
    stored as plain zstd (the codec before it)."""
    delta = build_dataset(traces, tmp_path / "delta", image_format="zstd-delta")
    a, b = read_all_samples(dataset, image_spec), read_all_samples(delta, image_spec)
    assert [s.id for s in a] == [s.id for s in b] and sum(len(s.images) for s in a) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.input_ids, y.input_ids)
        assert len(x.images) == len(y.images) and x.image_index == y.image_index
        for u, v in zip(x.images, y.images):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda a: _delta(a)[:-1], "stream ends|EOF|frame"),
        (lambda a: _delta(a[:-2]), "declares .* decompressed bytes, not a"),
        (lambda a: _delta(np.ascontiguousarray(a.transpose(1, 0, 2))), r"holds uint8 \(\d+, \d+, 3\), expected uint8"),
        (lambda a: _zst(_npy(np.array([object()] * 3, dtype=object), allow_pickle=True)), "declares"),
    ],
)
def test_zstd_delta_member_must_match_its_meta(dataset, image_spec, make, message):
    """A .delta.zst member is bounded as a .npy.zst is: its zstd frame's declared size and its .npy header are checked
    against the meta before its rows are unfiltered."""
    from vlmprep.pixels.images import encode_image

    key, members = _first_members(dataset)
    s = decode_sample(members, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    meta = json.loads(members["json"])
    meta["images"] = [{**im, "member": im["member"].replace(".npy.zst", ".delta.zst")} for im in meta["images"]]
    good = {k.replace(".npy.zst", ".delta.zst"): v for k, v in members.items()} | {"json": json.dumps(meta).encode()}
    for name in good:
        if name.endswith(".delta.zst"):
            u = int(name[3:6])
            good[name] = encode_image(
                PreparedImage(pixels=s.images[u], grid_thw=(1, 1, 1), source=None, digest=""), "zstd-delta"
            )
    ok = decode_sample(good, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))
    assert all(np.array_equal(x, y) for x, y in zip(ok.images, s.images))
    bad = {**good, "img000.delta.zst": make(s.images[0])}
    with pytest.raises(DataError, match=f"u.tar: sample {key}: .*({message})"):
        decode_sample(bad, key=key, url="u.tar", spec=image_spec, resize_original=OriginalResizer(image_spec))


def _delta(a: np.ndarray) -> bytes:
    from vlmprep.pixels.images import encode_image

    return encode_image(PreparedImage(pixels=a, grid_thw=(1, 1, 1), source=None, digest=""), "zstd-delta")


@pytest.mark.parametrize(
    "name",
    ["qwen2.5-vl", "glm-4.1v", "gemma-3", "mistral-3", "llava-onevision", "smolvlm", "gemma-4", "llama-3.2-vision"],
)
def test_an_original_member_decodes_to_the_pixels_the_build_counted_in_every_resize_mode(name, tmp_path):
    """An `orig.*` member (a JPEG of each kind, a lossy WebP) through the trainer's load-time decode and resize
    (OriginalResizer, set up from the saved processor dir as a run sets it up) gives exactly the pixels vlmprep
    counted the tokens for, for each family's resize (smart resize, GLM's temporal one, Gemma's fixed size, Mistral's
    longest edge on its merged patch, the tiling families' source, and Gemma 4's, Mllama's and SmolVLM's first resize
    where it is a fixed point: the 2100 x 1500 photo)."""
    from tests.vlmprep.test_images import photo, save
    from trainer.data.processors import load_image_processor_config, load_processor_settings
    from trainer.data.vision import ImageSpec
    from vlmprep.families import resolve_family
    from vlmprep.pixels.images import encode_image, open_image, stored_ext
    from vlmprep.processors.load import load_processor
    from vlmprep.types import ImageData

    processor = load_processor(f"tiny:{name}")
    processor.save_pretrained(str(tmp_path))
    where = str(tmp_path)
    spec = ImageSpec.from_config(load_image_processor_config(where), None, load_processor_settings(where))
    resize = OriginalResizer(spec)
    family = resolve_family(processor)
    sources = [
        save(photo(333, 210), "JPEG", quality=90),
        save(photo(210, 333).convert("CMYK"), "JPEG", quality=90, progressive=True),
        save(photo(1500, 900).convert("L"), "JPEG", quality=85),
        save(photo(400, 300), "WEBP", quality=80),
        save(photo(2100, 1500), "JPEG", quality=90),  # auto may keep its pixels: stored as `original` here
    ]
    for data in sources:
        opened = open_image(ImageData(data, "src"), processor, family, max_pixels=10**8)
        fmt = "original" if data is sources[-1] else "auto"
        member = "img000." + stored_ext(fmt, opened)
        assert ".orig." in member and encode_image(opened, fmt) == data, member
        got = decode_image(member, data, resize)
        np.testing.assert_array_equal(got, opened.pixels)


def test_a_tiling_familys_kept_photo_is_its_source_or_its_resize_as_the_meta_says_and_nothing_else(tmp_path):
    """Gemma 4's kept photo (`orig.*`): the meta's height x width tells the load-time resize what the build stored, its
    first resize (a new dataset) or the source (built before, or a size kept as its source); any other size the meta
    claims is refused in one line naming the member, before the sample's pixels are used."""
    from tests.vlmprep.test_images import photo, save
    from trainer.data.decode import decode_image_into
    from trainer.data.processors import load_image_processor_config, load_processor_settings
    from trainer.data.vision import ImageSpec
    from vlmprep.processors.load import load_processor

    load_processor("tiny:gemma-4").save_pretrained(str(tmp_path))
    where = str(tmp_path)
    resize = OriginalResizer(
        ImageSpec.from_config(load_image_processor_config(where), None, load_processor_settings(where))
    )
    data = save(photo(2100, 1500), "JPEG", quality=90)
    name = "img000.orig.jpg"
    for shape in ((672, 912, 3), (1500, 2100, 3)):  # the stored resize; the source
        got = decode_image_into(name, data, np.empty(shape, np.uint8), shape, resize)
        assert got.shape == shape
    for lie in ((671, 912, 3), (100, 100, 3), (2100, 1500, 3)):
        with pytest.raises(ValueError, match=rf"{name} decodes to \(672, 912, 3\), but the meta says"):
            decode_image_into(name, data, np.empty(lie, np.uint8), lie, resize)

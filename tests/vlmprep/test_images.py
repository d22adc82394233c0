"""Image decode fidelity: what vlmprep stores equals what transformers' load_image + the saved processor give the
model at inference (EXIF orientation, bit depth), and alpha / palette follow the processor's own PIL path."""

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers.image_utils import load_image

from vlmprep.families import FAMILIES
from vlmprep.pixels.images import decode_image, encode_image, merged_patch, prepare_image, stored_ext
from vlmprep.types import ImageData, RecordError
from vlmprep_schemas.resize import resize, resize_mode

QWEN2VL = FAMILIES["Qwen2VLProcessor"]


def save(im, fmt="PNG", **kw):
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def asymmetric_rgb(w=92, h=60):
    """Left half red, right half blue, a green top row: any rotation or flip changes the pixels."""
    a = np.zeros((h, w, 3), np.uint8)
    a[:, : w // 2] = (220, 30, 30)
    a[:, w // 2 :] = (30, 30, 220)
    a[:6] = (30, 200, 30)
    return Image.fromarray(a)


def with_orientation(im, orientation, fmt="JPEG"):
    exif = im.getexif()
    exif[0x0112] = orientation
    return save(im, fmt, exif=exif, **({"quality": 95} if fmt == "JPEG" else {}))


def gray16_gradient(w=96, h=64):
    a = np.linspace(0, 65535, w * h).reshape(h, w).astype(np.uint16)
    return Image.fromarray(a), a


def half_transparent_rgba(w=64, h=48):
    a = np.zeros((h, w, 4), np.uint8)
    a[..., :3] = (200, 40, 10)
    a[..., 3] = np.linspace(0, 255, w).astype(np.uint8)[None, :]
    return Image.fromarray(a, "RGBA")


def palette_with_transparency(w=64, h=48):
    p = Image.new("P", (w, h), 1)
    p.putpalette([0, 0, 0, 250, 20, 20, 20, 20, 250] + [0] * (256 * 3 - 9))
    for x in range(w // 2):
        for y in range(h):
            p.putpixel((x, y), 2)
    p.putpixel((0, 0), 0)
    p.info["transparency"] = 0
    return p


def parity(processor, prepared, reference_pil):
    """Stored pixels through the saved processor (resize off) vs the processor on the reference PIL image."""
    ip = processor.image_processor
    ref = ip(images=[reference_pil], return_tensors="np")
    got = ip(images=[Image.fromarray(prepared.pixels)], do_resize=False, return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"][0], prepared.grid_thw)
    np.testing.assert_array_equal(got["image_grid_thw"], ref["image_grid_thw"])
    assert np.abs(got["pixel_values"] - ref["pixel_values"]).max() == 0


@pytest.mark.parametrize("orientation", [3, 6, 8])
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_orientation_matches_load_image(orientation, fmt, tmp_path, qwen2vl_processor):
    data = with_orientation(asymmetric_rgb(), orientation, fmt)
    path = tmp_path / f"photo.{fmt.lower()}"
    path.write_bytes(data)
    prepared = prepare_image(ImageData(data, "photo"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    parity(qwen2vl_processor, prepared, load_image(str(path)))
    upright = decode_image(ImageData(data, "photo"), max_pixels=10**8)
    assert upright.size == ((60, 92) if orientation in (6, 8) else (92, 60))
    assert upright.getexif().get(0x0112) is None  # applied once, then dropped


def test_exif_rotated_phone_photo_grid_is_upright(qwen2vl_processor):
    # The case: a landscape sensor image tagged 6 (rotate 90 CW) is a portrait photo.
    data = with_orientation(asymmetric_rgb(46 * 14, 34 * 14), 6)
    prepared = prepare_image(ImageData(data, "phone"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert prepared.grid_thw == (1, 46, 34)  # rows x cols of 14 px patches; sideways it was (1, 34, 46)
    assert prepared.pixels.shape[0] > prepared.pixels.shape[1]


def test_16bit_gray_is_scaled_not_clipped(qwen2vl_processor):
    im, a = gray16_gradient()
    data = save(im)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    prepared = prepare_image(ImageData(data, "g16"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert len(np.unique(prepared.pixels)) > 200  # PIL's convert("RGB") clips it: ~99% white
    # Documented deviation: load_image clips 16 bits; vlmprep equals load_image of the same image scaled to 8 bits.
    scaled = Image.fromarray(np.round(a / 257.0).astype(np.uint8), "L")
    parity(qwen2vl_processor, prepared, load_image(scaled))
    clipped = np.asarray(load_image(Image.open(io.BytesIO(data))))
    assert (clipped == 255).mean() > 0.95  # what a plain PIL convert would have stored


def test_32bit_int_gray_in_16bit_range_is_scaled_and_wider_is_refused():
    a = np.array([[0, 65535], [257, 32896]], np.int32).repeat(4, 0).repeat(4, 1)
    im = decode_image(ImageData(save(Image.fromarray(a, "I"), "TIFF"), "i32"), max_pixels=10**8)
    assert im.mode == "L" and sorted(np.unique(np.asarray(im))) == [0, 1, 128, 255]
    with pytest.raises(RecordError) as e:
        decode_image(ImageData(save(Image.fromarray(a * 4, "I"), "TIFF"), "i32"), max_pixels=10**8)
    assert e.value.reason == "unsupported_image_mode"


@pytest.mark.parametrize(
    "make", [half_transparent_rgba, palette_with_transparency, lambda: half_transparent_rgba().convert("LA")]
)
def test_alpha_and_palette_follow_the_processors_own_path(make, qwen2vl_processor):
    # Decision (docs/shard-format.md): a PIL image goes through the processor's process_image, whose
    # convert_to_rgb composites alpha onto white, i.e. exactly `processor(images=Image.open(path))`.
    src = make()
    data = save(src)
    prepared = prepare_image(ImageData(data, "alpha"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    parity(qwen2vl_processor, prepared, Image.open(io.BytesIO(data)))
    white = Image.new("RGBA", src.size, (255, 255, 255, 255))
    composited = Image.alpha_composite(white, Image.open(io.BytesIO(data)).convert("RGBA")).convert("RGB")
    parity(qwen2vl_processor, prepared, composited)


def test_rgba_differs_from_load_image_which_drops_alpha(tmp_path, qwen2vl_processor):
    # Pins the choice: load_image's convert("RGB") keeps the colour under transparent pixels instead of white.
    data = save(half_transparent_rgba())
    (tmp_path / "a.png").write_bytes(data)
    prepared = prepare_image(ImageData(data, "alpha"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    ip = qwen2vl_processor.image_processor
    dropped = ip(images=[load_image(str(tmp_path / "a.png"))], return_tensors="np")["pixel_values"]
    ours = ip(images=[Image.fromarray(prepared.pixels)], do_resize=False, return_tensors="np")["pixel_values"]
    assert np.abs(dropped - ours).max() > 1


@pytest.mark.parametrize(
    "data, ext",
    [
        (save(asymmetric_rgb(), "JPEG"), "orig.jpg"),
        (save(asymmetric_rgb()), "orig.png"),
        (save(asymmetric_rgb(), "WEBP", lossless=True), "orig.webp"),
        (save(half_transparent_rgba()), "orig.png"),
    ],
    ids=["jpeg", "png", "webp", "rgba-png"],
)
def test_original_keeps_source_bytes_when_no_transform_applies(data, ext, qwen2vl_processor):
    prepared = prepare_image(ImageData(data, "src"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert stored_ext("original", prepared) == ext
    assert encode_image(prepared, "original") == data


@pytest.mark.parametrize(
    "data",
    [
        with_orientation(asymmetric_rgb(), 6),
        with_orientation(half_transparent_rgba(), 8, "PNG"),
        save(gray16_gradient()[0]),
        save(asymmetric_rgb(), "BMP"),
        save(asymmetric_rgb(), "TIFF"),
        save(asymmetric_rgb(), "GIF"),
        save(palette_with_transparency(), "GIF"),
    ],
    ids=["exif6-jpeg", "exif8-rgba-png", "gray16-png", "bmp", "tiff", "gif", "transparent-gif"],
)
def test_original_stores_a_normalized_png_when_a_transform_applies(data, qwen2vl_processor):
    prepared = prepare_image(ImageData(data, "src"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert stored_ext("original", prepared) == "orig.png"
    stored = encode_image(prepared, "original")
    assert encode_image(prepared, "original") == stored  # deterministic
    with Image.open(io.BytesIO(stored)) as im:
        assert (
            im.format == "PNG" and im.getexif().get(0x0112) is None and im.mode in ("1", "L", "LA", "P", "RGB", "RGBA")
        )
        again = prepare_image(ImageData(stored, "png"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    np.testing.assert_array_equal(again.pixels, prepared.pixels)


def test_unidentifiable_image_message_is_deterministic():
    with pytest.raises(RecordError) as e:
        decode_image(ImageData(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "data-uri"), max_pixels=10**8)
    assert e.value.reason == "corrupt_image"
    assert "0x" not in e.value.message and "object" not in e.value.message


def test_multi_picture_phone_jpeg_is_its_first_picture(tmp_path, qwen2vl_processor):
    # Phones write MPO (a JPEG plus extra pictures); PIL reports 2 frames, load_image uses the first, as does vlmprep.
    buf = io.BytesIO()
    asymmetric_rgb().save(buf, format="MPO", save_all=True, append_images=[Image.new("RGB", (30, 20), (0, 0, 255))])
    data = buf.getvalue()
    (tmp_path / "p.jpg").write_bytes(data)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    prepared = prepare_image(ImageData(data, "mpo"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    parity(qwen2vl_processor, prepared, load_image(str(tmp_path / "p.jpg")))
    assert stored_ext("original", prepared) == "orig.png"


def test_a_cut_off_image_is_corrupt_even_when_another_library_loads_truncated_images(monkeypatch):
    """llama_models.llama4.preprocess sets PIL's process-wide LOAD_TRUNCATED_IMAGES on import (the vendor tests import
    it): decode must still refuse a cut-off PNG, and leave the other library's setting as it found it."""
    buf = io.BytesIO()
    Image.new("RGB", (300, 200), (10, 200, 30)).save(buf, "PNG")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RecordError) as e:
        decode_image(ImageData(data=buf.getvalue()[:150], origin="cut.png"), max_pixels=1 << 24)
    assert e.value.reason == "corrupt_image"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True


def _stored(pixels):
    from vlmprep.types import PreparedImage

    return PreparedImage(pixels=pixels, grid_thw=(1, 1, 1), source=None, digest="")


def _read_back(name, data, shape):
    """Both readers: vlmprep's (verify, inspect, the clients) and the trainer's loader (into a buffer)."""
    from trainer.data.decode import _decoded_size, decode_image_into
    from vlmprep.shards.decode import decode_stored_image

    buf = np.empty(_decoded_size(name, data, shape[0], shape[1]), np.uint8)
    return decode_stored_image(name, data), decode_image_into(name, data, buf, shape, None)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (3, 5), (29, 31), (56, 84)])
def test_zstd_delta_is_lossless_at_odd_sizes_and_extreme_values(shape):
    """Random pixels and the values where mod-256 arithmetic wraps (0 and 255 side by side, down and across)."""
    rng = np.random.default_rng(0)
    cases = [
        rng.integers(0, 256, (*shape, 3), dtype=np.uint8),
        np.zeros((*shape, 3), np.uint8),
        np.indices((*shape, 3)).sum(axis=0).astype(np.uint8) % 2 * 255,
    ]
    for pixels in cases:
        data = encode_image(_stored(pixels), "zstd-delta")
        assert data == encode_image(_stored(pixels.copy()), "zstd-delta")  # deterministic
        for got in _read_back("img000.delta.zst", data, pixels.shape):
            np.testing.assert_array_equal(got, pixels)


@pytest.mark.parametrize(
    "make",
    [
        lambda: asymmetric_rgb(),
        half_transparent_rgba,
        palette_with_transparency,
        lambda: gray16_gradient()[0],
        lambda: asymmetric_rgb().convert("L"),
        lambda: asymmetric_rgb(91, 57),
    ],
)
def test_zstd_delta_decodes_to_the_pixels_zstd_stores(make, qwen2vl_processor):
    """RGB, RGBA, palette, 16-bit and 8-bit gray, odd source sizes: after the processor's resize the default codec
    reads back bit-identical to the zstd codec before it, in both readers; its zstd frame holds the very .npy header
    the zstd codec writes, so the trainer bounds it the same way."""
    import zstandard

    prepared = prepare_image(ImageData(save(make()), "src"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    old = encode_image(prepared, "zstd")
    new = encode_image(prepared, "zstd-delta")
    assert stored_ext("zstd-delta", prepared) == "delta.zst" and stored_ext("zstd", prepared) == "npy.zst"
    reference = _read_back("img000.npy.zst", old, prepared.pixels.shape)
    for got in (*reference, *_read_back("img000.delta.zst", new, prepared.pixels.shape)):
        np.testing.assert_array_equal(got, prepared.pixels)
    header = len(zstandard.ZstdDecompressor().decompress(old)) - prepared.pixels.nbytes
    assert (
        zstandard.ZstdDecompressor().decompress(new)[:header] == zstandard.ZstdDecompressor().decompress(old)[:header]
    )


REAL_TRACES = Path(
    os.environ.get("VLMPREP_REAL_TRACES", Path(__file__).resolve().parents[3] / "shared" / "data" / "real_traces")
)
# One desktop (OpenCUA, PNG RGB) and one browser screenshot (WebVoyager, PNG RGBA).
REAL_SCREENSHOTS = ("opencua/task_example_0/0.png", "webvoyager/taskGitHub--0/screenshot3.png")


def test_zstd_delta_stores_real_screenshots_in_fewer_bytes_than_their_png(qwen2vl_processor):
    """The default codec's bytes on real screenshots, after the processor's resize: <= 1.0x the source PNG (plain
    zstd: ~1.3x), and a third below zstd (docs/performance.md has the whole table)."""
    paths = [REAL_TRACES / "images" / p for p in REAL_SCREENSHOTS]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"real screenshots not found under {REAL_TRACES} (VLMPREP_REAL_TRACES names another place)")
    source = new = old = 0
    for p in paths:
        data = p.read_bytes()
        prepared = prepare_image(ImageData(data, str(p)), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
        source += len(data)
        new += len(encode_image(prepared, "zstd-delta"))
        old += len(encode_image(prepared, "zstd"))
    assert new <= 1.0 * source and new <= 0.8 * old, (new / source, old / source)


def png_chunks(data):
    """A PNG's chunks as (type, body) pairs."""
    import struct

    out, pos = [], 8
    while pos < len(data):
        n, kind = struct.unpack_from(">I4s", data, pos)
        out.append((kind, data[pos + 8 : pos + 8 + n]))
        pos += 12 + n
    return out


def png_from_chunks(chunks):
    import struct
    import zlib

    return b"\x89PNG\r\n\x1a\n" + b"".join(
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body)) for kind, body in chunks
    )


def png_with_metadata_after_pixels(kind):
    """An upright-6 PNG whose orientation chunk follows its pixel data, where PIL reads it only on load."""
    if kind == b"eXIf":
        chunks = png_chunks(with_orientation(asymmetric_rgb(), 6, "PNG"))
        exif = [c for c in chunks if c[0] == b"eXIf"]
        rest = [c for c in chunks if c[0] != b"eXIf"]
        return png_from_chunks(rest[:-1] + exif + rest[-1:])
    chunks = png_chunks(save(asymmetric_rgb()))
    xmp = b"XML:com.adobe.xmp\x00\x00\x00\x00\x00<x:xmpmeta><tiff:Orientation>6</tiff:Orientation></x:xmpmeta>"
    return png_from_chunks(chunks[:-1] + [(b"iTXt", xmp)] + chunks[-1:])


def xmp_oriented_png():
    chunks = png_chunks(save(asymmetric_rgb()))
    xmp = b'XML:com.adobe.xmp\x00\x00\x00\x00\x00<x:xmpmeta tiff:Orientation="8"/>'
    return png_from_chunks(chunks[:1] + [(b"iTXt", xmp)] + chunks[1:])


HEADER_CASES = {
    **{f"jpeg-exif{o}": with_orientation(asymmetric_rgb(), o) for o in range(1, 9)},
    "png-exif6": with_orientation(asymmetric_rgb(), 6, "PNG"),
    "png-xmp8": xmp_oriented_png(),
    "webp-exif5": with_orientation(asymmetric_rgb(), 5, "WEBP"),
    "png": save(asymmetric_rgb()),
    "gray16-png": save(gray16_gradient()[0]),
    "rgba-png": save(half_transparent_rgba()),
    "palette-png": save(palette_with_transparency()),
    "mpo": save(asymmetric_rgb(), "MPO", save_all=True, append_images=[Image.new("RGB", (30, 20))]),
}
DECODE_CASES = {  # the header cannot tell: decoded to know
    "png-exif6-after-pixels": png_with_metadata_after_pixels(b"eXIf"),
    "png-xmp6-after-pixels": png_with_metadata_after_pixels(b"iTXt"),
    "gif": save(asymmetric_rgb(), "GIF"),
    "tiff": save(asymmetric_rgb(), "TIFF"),
    "bmp": save(asymmetric_rgb(), "BMP"),
}


@pytest.mark.parametrize("name", list(HEADER_CASES) + list(DECODE_CASES))
def test_the_header_gives_the_upright_size_decoding_gives_or_says_it_cannot(name, qwen2vl_processor):
    from vlmprep.pixels.images import open_image, upright_size

    data = HEADER_CASES.get(name) or DECODE_CASES[name]
    img = ImageData(data, name)
    decoded = decode_image(img, max_pixels=10**8).size
    size = upright_size(img, max_pixels=10**8)
    assert size == (decoded if name in HEADER_CASES else None)
    opened = open_image(img, qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert opened.loaded == (name in DECODE_CASES)  # decoded now only where the header cannot tell
    prepared = prepare_image(img, qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert opened.grid_thw == prepared.grid_thw
    np.testing.assert_array_equal(opened.pixels, prepared.pixels)
    if "after-pixels" in name:
        assert decoded == (60, 92)  # the orientation after the pixels does apply


@pytest.mark.parametrize(
    "name",
    ["glm-4.1v", "gemma3", "mistral3-pixtral", "llava-onevision", "gemma4", "llama3.2-vision", "idefics3-smolvlm"],
)
def test_the_header_grid_is_the_processors_own_resize_in_every_image_mode(name):
    from tests.support.tiny_processors import load_family_processor
    from vlmprep.families import resolve_family
    from vlmprep.pixels.images import open_image

    processor = load_family_processor(name)
    family = resolve_family(processor)
    ip = processor.image_processor
    rng = np.random.default_rng(0)
    for w, h in [(92, 60), (1280, 720), (28, 3000)]:
        img = ImageData(save(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))), "x")
        opened = open_image(img, processor, family, max_pixels=10**8)
        prepared = prepare_image(img, processor, family, max_pixels=10**8)
        assert not opened.loaded and opened.grid_thw == prepared.grid_thw, family.image_mode
        np.testing.assert_array_equal(opened.pixels, prepared.pixels)
        # The channels-last view resizes to the values of the processor's own process_image (contiguous C x H x W).
        own = resize(
            resize_mode(type(ip).__name__),
            ip,
            ip.process_image(decode_image(img, max_pixels=10**8), do_convert_rgb=True),
            merged_patch(processor),
        )
        np.testing.assert_array_equal(prepared.pixels, own.permute(1, 2, 0).numpy())


def test_header_faults_raise_on_open_and_pixel_faults_on_first_use(qwen2vl_processor):
    from vlmprep.pixels.images import open_image

    with pytest.raises(RecordError) as e:
        open_image(ImageData(save(asymmetric_rgb(2000, 8)), "thin"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    assert e.value.reason == "bad_aspect_ratio"
    assert e.value.message.startswith("image 2000x8: absolute aspect ratio must be smaller than 200")
    cut = save(asymmetric_rgb(300, 200))[:300]
    opened = open_image(ImageData(cut, "cut.png"), qwen2vl_processor, QWEN2VL, max_pixels=10**8)
    for _ in range(2):  # a fault is raised on every use, never cached as pixels
        with pytest.raises(RecordError) as e:
            _ = opened.pixels
        assert e.value.reason == "corrupt_image"


def test_zstd_pdelta_stores_a_screenshot_against_the_one_before():
    """Two screenshots of one size, the second a moved cursor: zstd-pdelta stores the second against the first's
    payload (a .delta.zst member's content) in under a tenth of its bytes alone, deterministically; both readers
    decode it bit-identical given that payload, and without it it does not decode."""
    import zstandard

    from trainer.data.decode import _decoded_size, decode_image_into
    from vlmprep.pixels.images import delta_payload
    from vlmprep.shards.decode import decode_stored_image

    rng = np.random.default_rng(1)
    first = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    second = first.copy()
    second[40:52, 60:68] = 255  # the cursor
    alone = encode_image(_stored(second), "zstd-pdelta")
    data = encode_image(_stored(second), "zstd-pdelta", prefix=_stored(first))
    assert data == encode_image(_stored(second.copy()), "zstd-pdelta", prefix=_stored(first.copy()))
    assert len(data) < len(alone) / 10, (len(data), len(alone))
    prefix, name = delta_payload(first), "img001.pdelta.zst"
    buf = np.empty(_decoded_size(name, data, 96, 128), np.uint8)
    for got in (
        decode_stored_image(name, data, (96, 128), prefix),
        decode_image_into(name, data, buf, second.shape, None, prefix),
    ):
        np.testing.assert_array_equal(got, second)
    np.testing.assert_array_equal(decode_stored_image("img000.pdelta.zst", alone, (96, 128)), second)
    with pytest.raises(zstandard.ZstdError):
        decode_stored_image(name, data, (96, 128))


def photo(w=320, h=200, seed=0) -> Image.Image:
    """A photo-like image: smooth colour gradients under fine noise (JPEG stores it in a fraction of its pixels)."""
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // w, y * 255 // h, (x + y) * 255 // (w + h)], axis=-1).astype(np.int16)
    a += np.random.default_rng(seed).integers(-4, 5, a.shape, dtype=np.int16)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8))


def _auto(data, processor=None, family=QWEN2VL, max_pixels=None):
    from vlmprep.pixels.images import image_storage, open_image
    from vlmprep.processors.load import apply_pixel_budget, load_processor

    if processor is None:
        processor = load_processor("builtin:qwen2-vl")
        apply_pixel_budget(processor, family, min_pixels=None, max_pixels=max_pixels)
    opened = open_image(ImageData(data, "src"), processor, family, max_pixels=10**8)
    return image_storage("auto", opened), opened


@pytest.mark.parametrize(
    "name, make, want",
    [
        ("JPEG photo", lambda: save(photo(), "JPEG", quality=90), "original"),
        ("progressive JPEG", lambda: save(photo(), "JPEG", quality=90, progressive=True), "original"),
        ("CMYK JPEG", lambda: save(photo().convert("CMYK"), "JPEG", quality=90), "original"),
        ("grayscale JPEG", lambda: save(photo().convert("L"), "JPEG", quality=90), "original"),
        ("lossy WebP", lambda: save(photo(), "WEBP", quality=80), "original"),
        ("lossless WebP", lambda: save(photo(), "WEBP", lossless=True), "zstd-pdelta"),
        ("PNG photo", lambda: save(photo()), "zstd-pdelta"),
        ("PNG screenshot", lambda: save(asymmetric_rgb(320, 200)), "zstd-pdelta"),
        ("EXIF-rotated JPEG", lambda: with_orientation(photo(), 6), "zstd-pdelta"),
        ("16-bit PNG", lambda: save(gray16_gradient()[0]), "zstd-pdelta"),
        ("JPEG at quality 100 of noise", lambda: save(noise_rgb(), "JPEG", quality=100), "zstd-pdelta"),
    ],
)
def test_auto_keeps_a_lossy_photo_as_its_bytes_and_stores_every_other_image_as_pixels(name, make, want):
    """--image-format auto (the default): a lossy source (JPEG of any kind, lossy WebP) whose stored pixels would be
    well over its bytes is stored as it is; a lossless source, an EXIF-rotated or 16-bit image (which the loader's
    plain decode would not give upright and 8-bit) and a JPEG as large as its pixels are stored as zstd-pdelta."""
    from vlmprep.pixels.images import make_ready

    data = make()
    storage, opened = _auto(data)
    assert storage == want, name
    make_ready(opened, "auto")
    # A source stored as it is is checked, never decoded to pixels nor resized; every other image is.
    assert opened.loaded == (want != "original"), name
    assert stored_ext("auto", opened) == ("orig." + opened.keep if want == "original" else "pdelta.zst")
    if want == "original":
        assert encode_image(opened, "auto") == data


def noise_rgb(w=320, h=200):
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.mark.slow  # 10-30 s on 2 cores: make test stays under ~8 min; make test-all runs it
def test_auto_keeps_the_pixels_of_a_large_photo_resized_far_down():
    """A 12 MP photo under a 1 MP pixel budget: decoding its source at every epoch would cost ~12x the stored pixels,
    so auto stores the resized pixels; the same photo under the processor's own budget (no resize) keeps its bytes."""
    big = save(photo(4000, 3000), "JPEG", quality=90)
    storage, opened = _auto(big, max_pixels=1_003_520)
    assert storage == "zstd-pdelta" and opened.shape == (840, 1148)
    assert _auto(big)[0] == "original"


def test_auto_stores_the_pixels_of_a_photo_with_over_3_source_pixels_a_stored_one():
    """The decode limit is 3 source pixels a stored one (SmolVLM's 12 MP photos, at 3.9, loaded under a GPU's need
    kept as their bytes): at 3.6 the pixels are stored, at 2.7 the JPEG is kept; both stored pixels are well over
    1.5x the JPEG's bytes, so the decode limit alone decides."""
    data = save(photo(1120, 840), "JPEG", quality=90)
    for max_pixels, want, shape in ((268_800, "zstd-pdelta", (448, 588)), (376_320, "original", (504, 700))):
        storage, opened = _auto(data, max_pixels=max_pixels)
        assert opened.shape == shape and opened.shape[0] * opened.shape[1] > 1.5 * len(data)
        assert storage == want, (max_pixels, 1120 * 840 / (shape[0] * shape[1]))


def test_a_cut_off_jpeg_kept_as_its_bytes_is_rejected_as_a_full_decode_rejects_it():
    """The check that replaces the decode of a source stored as it is (a JPEG entropy-decoded at 1/8 scale) fails
    where a full decode fails, on every call, and a whole one passes without making pixels."""
    from vlmprep.pixels.images import make_ready

    data = save(photo(), "JPEG", quality=90)
    for cut in (len(data) // 2, len(data) - 3):
        storage, opened = _auto(data[:cut])
        assert storage == "original"
        for _ in range(2):
            with pytest.raises(RecordError) as e:
                make_ready(opened, "auto")
            assert e.value.reason == "corrupt_image" and "truncated" in e.value.message
        with pytest.raises(RecordError):
            decode_image(ImageData(data[:cut], "x"), max_pixels=10**8)


@pytest.mark.parametrize(
    "name, fixed_point",
    [
        ("qwen2-vl", None),
        ("glm-4.1v", None),
        ("gemma3", None),
        ("mistral3-pixtral", None),
        ("llava-onevision", None),
        ("llama4", None),
        ("internvl", None),
        ("gemma4", "patch_budget"),
        ("llama3.2-vision", "tile_canvas"),
        ("idefics3-smolvlm", "encoder_tiles"),
    ],
)
def test_each_familys_resize_mode_is_the_one_its_image_processor_class_names(name, fixed_point):
    """The trainer finds an `original` member's resize by the saved image processor's class (vlmprep_schemas.resize);
    the build by the family registry: they agree for every family, where a family whose processor resizes at train
    time ("source") stores its fixed-point resize."""
    from tests.support.tiny_processors import load_family_processor
    from vlmprep.families import resolve_family

    processor = load_family_processor(name)
    kind = type(processor.image_processor).__name__
    mode = resize_mode(kind)
    assert (resolve_family(processor).image_mode, mode) == (("source", fixed_point) if fixed_point else (mode, mode))
    # The fixed-point resizes are the torchvision backend's (its Fast name too); a PIL backend resizes with PIL: source.
    base = kind.removesuffix("Fast").removesuffix("Pil")
    assert resize_mode(base + "Fast") == mode
    assert resize_mode(base + "Pil") == ("source" if fixed_point else mode)


@pytest.mark.parametrize(
    "name, smaller, enlarged, moves_again",
    [
        # moves again: 672 x 384 within 2520 patches of 16 px, then 720 x 384
        ("gemma4", (1200, 1700), (600, 900), (1790, 1077)),
        # moves again: 560 x 1120 on a 2 x 2 canvas, then the same size on 1 x 2
        ("llama3.2-vision", (1200, 1700), (400, 500), (561, 1121)),
        ("idefics3-smolvlm", (1800, 2600), (800, 1200), None),  # none found: its resizes land on its tile's multiples
    ],
)
def test_a_tiling_processors_stored_first_resize_gives_its_outputs_on_the_source(name, smaller, enlarged, moves_again):
    """Gemma 4, Mllama and Idefics3 / SmolVLM store their processor's first resize where it is a fixed point and
    smaller (vlmprep_schemas.resize FIXED_POINT_MODES): the processor, which resizes at train time, then gives from
    the stored image every output it gives from the source, bit for bit; where the resize would enlarge the image or
    move it again the source is stored, and storing the plain resize there would give other outputs."""
    import torch

    from tests.support.tiny_processors import load_family_processor
    from vlmprep_schemas.resize import first_resize

    processor = load_family_processor(name)
    ip = processor.image_processor
    mode = resize_mode(type(ip).__name__)
    nested = name != "gemma4"
    rng = np.random.default_rng(0)

    def outputs(t):
        got = ip(images=[[t]] if nested else [t], return_tensors="pt", input_data_format="channels_first")
        return {k: v for k, v in got.items()}

    def same(a, b):
        return a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
        )

    def planned(h, w):  # the processor's first resize on shapes alone
        out, plan = first_resize(mode, ip, torch.empty((3, h, w), dtype=torch.float32, device="meta"), 2)
        return tuple(out.shape[-2:]), plan

    once = planned(*enlarged)
    assert once[0][0] * once[0][1] > enlarged[0] * enlarged[1] and planned(*once[0]) == once, (
        "not an enlarging fixed point"
    )
    cases = {"fixed point": smaller, "enlarged": enlarged}
    if moves_again:
        once = planned(*moves_again)
        assert once[0][0] * once[0][1] < moves_again[0] * moves_again[1] and planned(*once[0]) != once
        cases["moves again"] = moves_again
    for case, (h, w) in cases.items():
        source = torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        stored = resize(mode, ip, source)
        if case == "fixed point":
            assert stored.shape[-2] * stored.shape[-1] < h * w, (case, stored.shape)
        else:
            assert stored is source, case
        assert same(outputs(stored), outputs(source)), case
        if case == "moves again":
            plain = first_resize(mode, ip, source)[0]
            assert not same(outputs(plain), outputs(source)), "the plain resize would have been exact here"


_CHECK_UNDER_A_CAP = """
import sys
from tests.support.hostile import address_space, jpeg_claiming
from vlmprep.pixels.images import check_decode, decode_image
from vlmprep.types import ImageData

img = ImageData(jpeg_claiming(8000, 6000), "x")
with address_space(64 << 20):
    check_decode(img, max_pixels=10**8)
    print("check ok")
    try:
        decode_image(img, max_pixels=10**8)
    except MemoryError:
        print("full decode: MemoryError")
"""


def test_a_jpeg_whose_header_claims_more_pixels_than_it_holds_costs_the_build_an_eighth_of_them():
    """A JPEG whose header claims 8000x6000 over a 64x48 scan (libjpeg fills the rest, as it does for the processor
    online: not a fault) is stored as its bytes without a pixel made, and the check the build runs on it allocates an
    eighth of each side, not the 144 MB of a full decode: in a fresh process capped at 64 MB more than it holds, the
    check passes and the full decode runs out of memory. One claiming more than --max-image-pixels is refused from
    its header, nothing decoded."""
    import subprocess
    import sys

    from tests.support.hostile import jpeg_claiming
    from vlmprep.pixels.images import make_ready

    # A 20 MP budget: 2.4 source pixels a stored one, so auto keeps it as its bytes (under Qwen's own 12.8 MP budget,
    # 3.7, it would store the resized pixels, as for any photo resized that far down).
    storage, opened = _auto(jpeg_claiming(8000, 6000), max_pixels=20_000_000)
    assert storage == "original" and opened.source_size == (8000, 6000)
    make_ready(opened, "auto")
    assert not opened.loaded
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _CHECK_UNDER_A_CAP], cwd=root, capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split("\n")[:2] == ["check ok", "full decode: MemoryError"], out.stdout + out.stderr
    with pytest.raises(RecordError) as e:
        _auto(jpeg_claiming(65_000, 65_000))
    assert e.value.reason == "image_too_large"


def test_the_fixed_point_decision_is_remembered_per_size_and_follows_the_processors_settings():
    """The loader meets the same sizes at every epoch: the decision (two shape runs) is kept per image processor,
    mode, settings and size; a processor whose settings change decides again."""
    import copy

    import torch

    from tests.support.tiny_processors import load_family_processor
    from vlmprep_schemas import resize as R

    ip = copy.deepcopy(load_family_processor("gemma4").image_processor)
    source = torch.zeros((3, 1200, 1700), dtype=torch.uint8)
    assert tuple(resize("patch_budget", ip, source).shape[-2:]) == (672, 912)
    assert len(R._DECIDED[ip]) == 1
    resize("patch_budget", ip, source)
    assert len(R._DECIDED[ip]) == 1  # remembered, not decided again
    ip.do_resize = False  # the processor no longer resizes: the source is stored
    assert resize("patch_budget", ip, source) is source
    ip.do_resize, ip.max_soft_tokens = True, 70
    assert tuple(resize("patch_budget", ip, source).shape[-2:]) == (336, 432)

"""The loader's JPEG path (trainer/data/jpeg.py: the frame header read without PIL, torchvision's libjpeg-turbo decode)
gives exactly PIL's size and pixels, or hands the image back to PIL: on the real photos, on JPEGs of every sampling
factor, scan mode and awkward size, on corrupt or truncated bytes and on hostile headers."""

import io
import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile

from tests.conftest import LLAMAFACTORY
from trainer.data import decode, originals
from trainer.data.jpeg import JpegHeader, jpeg_header, jpeg_rgb

REAL_TRACES = Path(
    os.environ.get("VLMPREP_REAL_TRACES", Path(__file__).resolve().parents[3] / "shared" / "data" / "real_traces")
)


def _pil(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return np.asarray(im)


def _fast(data: bytes):
    """The fast path's pixels, or None where it leaves the image to PIL; its header agrees with PIL's where it reads
    one."""
    head = jpeg_header(data)
    if head is None:
        return None
    with Image.open(io.BytesIO(data)) as im:
        assert (head.width, head.height) == im.size and im.mode == "RGB" and im.format == "JPEG"
    t = jpeg_rgb(data, head.width, head.height)
    return None if t is None else t.numpy()


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _photo() -> Image.Image:
    return Image.open(LLAMAFACTORY / "mllm_demo_data" / "2.jpg").convert("RGB")


def test_real_photos_decode_to_pils_pixels():
    paths = sorted((LLAMAFACTORY / "mllm_demo_data").glob("*.jpg"))
    paths += sorted(p for p in (REAL_TRACES / "images").rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    # One of real_traces' .jpg files is a PNG; the smallest photos keep the test short (sizes do not matter here).
    photos = sorted((p for p in paths if Image.open(p).format == "JPEG"), key=lambda p: p.stat().st_size)[:9]
    assert len(photos) >= 3
    for p in photos:
        data = p.read_bytes()
        got = _fast(data)
        assert got is not None, f"{p.name}: the fast path was not taken"
        np.testing.assert_array_equal(got, _pil(data), err_msg=p.name)


@pytest.mark.parametrize("subsampling", [0, 1, 2])
@pytest.mark.parametrize("progressive", [False, True])
def test_every_sampling_scan_and_size_decodes_to_pils_pixels(subsampling, progressive):
    src = _photo()
    for size, quality in (((300, 168), 75), ((301, 167), 95), ((17, 9), 30), ((1, 1), 100), ((1023, 33), 50)):
        data = _jpeg(
            src.resize(size), quality=quality, subsampling=subsampling, progressive=progressive, optimize=progressive
        )
        got = _fast(data)
        assert got is not None
        np.testing.assert_array_equal(got, _pil(data), err_msg=f"{size} q{quality}")


def test_other_modes_are_left_to_pil():
    src = _photo()
    for mode in ("L", "CMYK"):
        data = _jpeg(src.convert(mode))
        assert _fast(data) is None, mode
    png = io.BytesIO()
    src.save(png, format="PNG")
    assert _fast(png.getvalue()) is None


def test_corrupt_bytes_decode_as_pil_decodes_them_and_truncated_ones_are_left_to_pil(monkeypatch):
    # PIL's default (a vendor module imported by another test turns the process-wide flag on: llama_models' llama4)
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", False)
    data = _jpeg(_photo(), quality=85)
    rng = random.Random(0)
    compared = 0
    for _ in range(60):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(700, len(bad) - 2)] = rng.randrange(256)
        try:
            want = _pil(bytes(bad))
        except OSError:
            assert _fast(bytes(bad)) is None
            continue
        got = _fast(bytes(bad))
        if got is not None:
            np.testing.assert_array_equal(got, want)
            compared += 1
    assert compared > 30
    for cut in (len(data) // 2, len(data) - 2):
        with pytest.raises(OSError):
            _pil(data[:cut])
        assert _fast(data[:cut]) is None  # PIL's decode then raises its own error, as the loader did before


def test_the_resizer_takes_the_fast_decode_and_gives_the_same_stored_pixels(image_spec, monkeypatch):
    """OriginalResizer decodes a kept JPEG through jpeg_rgb when given its JpegHeader (a spy counts it), and the
    pixels equal PIL's path."""
    resize = originals.OriginalResizer(image_spec)
    data = [_jpeg(_photo().resize(s), quality=90) for s in ((300, 199), (457, 211))]
    calls = []
    real = originals.jpeg_rgb
    monkeypatch.setattr(originals, "jpeg_rgb", lambda *a: calls.append(1) or real(*a))
    fast = [resize(d, jpeg_header(d)) for d in data]
    assert len(calls) == 2
    for a, d in zip(fast, data):
        np.testing.assert_array_equal(a, resize(d))  # no header given: PIL's path
    monkeypatch.setattr(originals, "jpeg_rgb", lambda *a: None)  # torchvision refuses it: PIL decodes it
    np.testing.assert_array_equal(resize(data[0], jpeg_header(data[0])), fast[0])


def _frame(width: int, height: int, components: int = 3, precision: int = 8, marker: int = 0xC0) -> bytes:
    body = bytes([precision]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes([components])
    body += b"\x01\x22\x00" * components
    return b"\xff" + bytes([marker]) + (len(body) + 2).to_bytes(2, "big") + body


def test_hostile_headers_are_read_as_libjpeg_reads_them_or_left_to_pil():
    app = b"\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    soi = b"\xff\xd8"
    assert jpeg_header(soi + app + _frame(640, 480)) == JpegHeader(640, 480)
    assert jpeg_header(soi + app + b"\xff\xff\xff" + _frame(65535, 65535, marker=0xC2)) == JpegHeader(65535, 65535)
    for bad in (
        b"",
        b"\x89PNG\r\n\x1a\n",
        soi,
        soi + app,  # no frame at all
        soi + app[:7],  # a segment cut short
        soi + b"\x00\x00" + _frame(640, 480),  # garbage where a marker must be
        soi + b"\xff\xda\x00\x02" + _frame(640, 480),  # a scan before the frame
        soi + b"\xff\xd9" + _frame(640, 480),  # the end before the frame
        soi + _frame(640, 480)[:9],  # the frame header cut short
        soi + _frame(640, 480, components=1),  # grayscale, CMYK, 12-bit, empty: PIL's
        soi + _frame(640, 480, components=4),
        soi + _frame(640, 480, precision=12),
        soi + _frame(0, 480),
        soi + b"\xff\xe1\xff\xff" + b"\x00" * 100 + _frame(640, 480),  # a length past the end
    ):
        assert jpeg_header(bad) is None, bad[:24]
    # A length that points back or nowhere cannot loop: every step moves forward.
    assert jpeg_header(soi + b"\xff\xe1\x00\x00" * 1000) is None


def test_a_kept_jpeg_declaring_too_many_pixels_is_refused_before_any_decode():
    """A `.orig.jpg` member whose frame header declares a size past the reader's limit is refused in one line from its
    header (decode_sample sizes every member this way before it decodes any: a hostile header cannot make libjpeg
    allocate it); one within the limit is sized from its header alone, which the decode then gets."""
    opened = {}
    with pytest.raises(ValueError, match="img000.orig.jpg declares 60000x60000, more pixels than a reader decodes"):
        decode._decoded_size("img000.orig.jpg", b"\xff\xd8" + _frame(60000, 60000) + b"\x00" * 64, 1, 1, opened)
    data = _jpeg(_photo())
    assert decode._decoded_size("img000.orig.jpg", data, 196, 308, opened) == 196 * 308 * 3
    assert opened == {"img000.orig.jpg": JpegHeader(300, 199)}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_cut_off_image_is_an_error_whatever_set_pils_process_wide_flag(image_spec, monkeypatch, fmt):
    """llama_models' llama4 module turns PIL's LOAD_TRUNCATED_IMAGES on at import: the loader's decode still refuses a
    cut-off member (a stored PNG, a kept JPEG that torchvision refuses and PIL then decodes) instead of filling it."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    buf = io.BytesIO()
    _photo().save(buf, format=fmt)
    cut = buf.getvalue()[: len(buf.getvalue()) * 2 // 3]
    name = "img000.png" if fmt == "PNG" else "img000.orig.jpg"
    with pytest.raises(OSError, match="truncated"):
        decode.decode_image(name, cut, decode.OriginalResizer(image_spec))
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # left as it was found

"""The loader's JPEG decode (trainer/data/decode.py jpeg_rgb, torchvision's libjpeg-turbo) gives exactly PIL's pixels,
or hands the image back to PIL: on the real photos, on JPEGs of every sampling factor, scan mode and awkward size,
and on corrupt or truncated bytes."""

import io
import os
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import LLAMAFACTORY
from trainer.data import decode
from trainer.data.decode import jpeg_rgb

REAL_TRACES = Path(
    os.environ.get("VLMPREP_REAL_TRACES", Path(__file__).resolve().parents[3] / "shared" / "data" / "real_traces")
)


def _pil(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        im.load()
        return np.asarray(im)


def _fast(data: bytes):
    with Image.open(io.BytesIO(data)) as im:  # the header only, as the loader has it
        t = jpeg_rgb(data, im)
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


def test_corrupt_bytes_decode_as_pil_decodes_them_and_truncated_ones_are_left_to_pil():
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
    """OriginalResizer decodes a kept JPEG through jpeg_rgb (a spy counts it), and the pixels equal PIL's path."""
    resize = decode.OriginalResizer(image_spec)
    data = [_jpeg(_photo().resize(s), quality=90) for s in ((300, 199), (457, 211))]
    calls = []
    real = decode.jpeg_rgb
    monkeypatch.setattr(decode, "jpeg_rgb", lambda d, pil: calls.append(1) or real(d, pil))
    fast = [resize(d) for d in data]
    assert len(calls) == 2
    monkeypatch.setattr(decode, "jpeg_rgb", lambda d, pil: None)
    for a, d in zip(fast, data):
        np.testing.assert_array_equal(a, resize(d))

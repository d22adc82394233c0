"""The loader's JPEG path for a kept photo (`imgNNN.orig.jpg`): its frame header read without PIL, and its pixels by
torchvision's libjpeg-turbo decode, the values PIL's decode gives (the same library and settings:
tests/trainer/test_jpeg.py compares them over sampling factors, progressive scans, odd sizes and corrupt data) in ~60%
of its CPU and without PIL's copy out of its own buffer. Anything else, or anything unexpected here, goes to PIL as
before, whose errors the loader reports.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic): the frame header holding
# precision, height, width and components. DHT (C4), JPG (C8) and DAC (CC) share the range but are not frames.
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RST0-7: no length follows


@dataclass(frozen=True)
class JpegHeader:
    """A JPEG's first frame header: an 8-bit, 3-component image of `width` x `height` (what PIL opens as RGB)."""

    width: int
    height: int


def jpeg_header(data: bytes) -> JpegHeader | None:
    """The frame header of an 8-bit 3-component JPEG, its markers walked as libjpeg walks them up to the first
    frame; None for anything else (another format, grayscale or CMYK, 12-bit, garbage between markers, a scan or
    the end before a frame, bytes cut short): PIL reads those. Each step moves forward, so any bytes end it."""
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte before the marker
            i += 1
        elif marker in _STANDALONE:
            i += 2
        elif marker in _SOF:
            if i + 10 > n:
                return None
            precision, components = data[i + 4], data[i + 9]
            height, width = int.from_bytes(data[i + 5 : i + 7], "big"), int.from_bytes(data[i + 7 : i + 9], "big")
            ok = precision == 8 and components == 3 and width > 0 and height > 0
            return JpegHeader(width, height) if ok else None
        elif marker in (0xD8, 0xD9, 0xDA):  # SOI again, EOI or a scan before any frame
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def jpeg_rgb(data: bytes, width: int, height: int):
    """The pixels of a 3-component JPEG of `width` x `height` (its header's) as an H x W x 3 uint8 tensor, laid out
    channels last as PIL holds them (the resize runs fastest on that); None where torchvision refuses the bytes
    (truncated: PIL's decode then raises its own error, as it did) or decodes another size."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg  # imported with the image processor already

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torchvision 0.29 points to TorchCodec; pinned here
        try:
            t = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError:
            return None
    if tuple(t.shape) != (3, height, width):
        return None
    return t.permute(1, 2, 0).contiguous()

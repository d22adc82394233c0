"""Stored image and frame members -> uint8 pixels (H x W x 3), every size a member declares (the zstd frame's content
size, the .npy header, the image header) checked against the meta's and the reader's image limit before anything is
decompressed or allocated; a `.pdelta.zst` chain's payloads cached by member (PayloadCache) so any decode order is
linear. Never unpickles.
"""

from __future__ import annotations

import io
from collections import OrderedDict

import numpy as np
import zstandard
from PIL import Image

from vlmprep.shards.format import LIMITS
from vlmprep_schemas.delta import ZSTD_IMAGE, decompressor, unfilter_into
from vlmprep_schemas.limits import load_npy, npy_header


def _check_pixels(name: str, width: int, height: int, size: tuple[int, int] | None, channels: int = 3) -> None:
    """A stored image's declared size (header) against the meta's `size` (height, width) where it gives one (orig.*
    members hold the source, at its own size), and against the image limit."""
    if size is not None and (height, width) != tuple(size):
        raise ValueError(f"{name} declares {width}x{height}, but the meta gives {size[1]}x{size[0]}")
    if width * height * channels > LIMITS.image_bytes:
        raise ValueError(
            f"{name} declares {width}x{height}, more pixels than a reader decodes ({LIMITS.image_bytes} bytes)"
        )


def zstd_payload(name: str, data: bytes, size: tuple[int, int] | None = None, prefix: bytes | None = None) -> bytes:
    """A `.npy.zst` / `.delta.zst` / `.pdelta.zst` member -> what it decompresses to (the .npy header, then the
    pixels or their filtered rows), its declared size (the zstd frame's content size) checked against `size` (or the
    image limit) before anything is decompressed. prefix: a `.pdelta.zst` member's dictionary, the payload of the
    member its meta names (None: none)."""
    declared = zstandard.frame_content_size(data)
    floor = 3 * (size[0] * size[1] if size is not None else 1)
    ceiling = 4096 + (3 * size[0] * size[1] if size is not None else LIMITS.image_bytes)  # + the .npy header
    if not floor < declared <= ceiling:
        raise ValueError(
            f"{name} declares {declared} decompressed bytes, not a uint8 "
            f"{'x'.join(map(str, size or ('H', 'W')))}x3 .npy"
        )
    return decompressor(prefix).decompress(data)


def decode_stored_image(
    name: str, data: bytes, size: tuple[int, int] | None = None, prefix: bytes | None = None
) -> np.ndarray:
    """A stored image member -> uint8 H x W x 3 (`orig.*`: the source pixels, not yet resized). `size`: the
    (height, width) the meta gives it (`orig.*`: the source's, None where the meta has none); its own declared size
    (the zstd frame's content size and .npy header, the image header) is checked against it, and against the image
    limit, before anything is decompressed or allocated. prefix: as zstd_payload's. Never unpickles; ValueError /
    OSError / zstandard.ZstdError on any fault."""
    if name.endswith(ZSTD_IMAGE):
        return pixels_of_payload(name, zstd_payload(name, data, size, prefix), size)
    with Image.open(io.BytesIO(data)) as im:  # reads the header only
        _check_pixels(name, *im.size, size, 4)
        if ".orig." in name:  # the source (or a normalized PNG of it) with alpha/palette: the processor's own
            from transformers.image_transforms import convert_to_rgb  # RGB conversion, alpha onto white

            return convert_to_rgb(im, return_numpy=True)
        return np.array(im.convert("RGB"))


def pixels_of_payload(name: str, raw: bytes, size: tuple[int, int] | None) -> np.ndarray:
    """zstd_payload's bytes -> uint8 H x W x 3: the .npy header checked (against `size` too), the filtered rows of a
    `.delta.zst` / `.pdelta.zst` member undone."""
    dims = npy_header(raw, name)[2]
    if len(dims) != 3 or dims[2] != 3:
        raise ValueError(f"{name} holds shape {dims}, expected H x W x 3")
    _check_pixels(name, dims[1], dims[0], size)
    pixels = load_npy(raw, name, np.uint8, dims)
    if name.endswith(".npy.zst"):
        return pixels
    return unfilter_into(pixels.reshape(dims[0], 3, dims[1]), np.empty_like(pixels))


DECODE_ERRORS = (ValueError, OSError, zstandard.ZstdError, Image.DecompressionBombError)
# A few hundred screenshots' payloads: a .pdelta.zst chain decoded out of member order (inspect's views of a sample
# whose occurrences list its images last to first) is decompressed once while its payloads fit.
PAYLOAD_CACHE_BYTES = 256 << 20


class PayloadCache:
    """Decompressed `.pdelta.zst` payloads by member (what a later member of the chain is compressed against); the
    least recently used dropped past `limit` bytes, the newest always kept (the next member in order needs it)."""

    def __init__(self, limit: int = PAYLOAD_CACHE_BYTES):
        self.limit = limit
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, member: str | None) -> bytes | None:
        """The member's payload, or None where it is not cached."""
        if member not in self._items:
            return None
        self._items.move_to_end(member)
        return self._items[member]

    def put(self, member: str, payload: bytes) -> None:
        """Cache one payload, dropping the least recently used past the limit."""
        self._bytes += len(payload) - len(self._items.pop(member, b""))
        self._items[member] = payload
        while self._bytes > self.limit and len(self._items) > 1:
            self._bytes -= len(self._items.popitem(last=False)[1])

"""The `zstd-delta` image codec's prediction filter, shared by the writer (vlmprep) and every reader (vlmprep, the
trainer): uint8 H x W x 3 pixels <-> filtered rows, lossless. Screenshots compress about a third better after it.
`zstd-pdelta` (format v4) compresses the same payload with the sample's previous image's payload as a zstd dictionary.
"""

from __future__ import annotations

import numpy as np
import zstandard

PDELTA = ".pdelta.zst"
ZSTD_IMAGE = (".npy.zst", ".delta.zst", PDELTA)  # image members that are one zstd frame of a uint8 .npy payload
# Below level 5 zstd's match finders find little in the previous image (docs/performance.md: 1.50x the demo source
# bytes at level 3, 1.10x at 5), so a member with a prefix is compressed at level 5 at least; one without (a sample's
# first image) has nothing to find there and keeps the level asked for (the default 1: ~3x faster than 5, as small).
# A window over 2^27 bytes is more than zstd decoders accept by default. The level is no part of the format: a
# reader decompresses any.
PDELTA_MIN_LEVEL = 5
_MAX_WINDOW_LOG = 27


def filter_pixels(pixels: np.ndarray) -> np.ndarray:
    """H x W x 3 uint8 -> H x 3 x W uint8, arithmetic mod 256: each row as three planes (R - G, G, B - G: flat UI
    colours become near-zero), then each row minus the row above (the first row kept)."""
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3, "filter_pixels takes HxWx3 uint8"
    h, w, _ = pixels.shape
    planes = np.empty((h, 3, w), dtype=np.uint8)
    planes[:, 1] = pixels[..., 1]
    np.subtract(pixels[..., 0], pixels[..., 1], out=planes[:, 0])
    np.subtract(pixels[..., 2], pixels[..., 1], out=planes[:, 2])
    out = np.empty_like(planes)
    out[0] = planes[0]
    np.subtract(planes[1:], planes[:-1], out=out[1:])
    return out


def unfilter_into(filtered: np.ndarray, out: np.ndarray) -> np.ndarray:
    """filter_pixels undone: H x 3 x W uint8 (overwritten) -> `out`, H x W x 3 uint8, which must not overlap it.
    One vectorized add per row (a contiguous 3 x W run each; np.cumsum over axis 0 is several times slower), then
    the planes interleaved back."""
    h = filtered.shape[0]
    assert filtered.dtype == np.uint8 and filtered.shape == (h, 3, out.shape[1]) and out.shape == (h, out.shape[1], 3)
    for i in range(1, h):
        np.add(filtered[i], filtered[i - 1], out=filtered[i])
    np.copyto(out[..., 1], filtered[:, 1])
    np.add(filtered[:, 0], filtered[:, 1], out=out[..., 0])
    np.add(filtered[:, 2], filtered[:, 1], out=out[..., 2])
    return out


def _dictionary(prefix: bytes | None) -> zstandard.ZstdCompressionDict | None:
    return zstandard.ZstdCompressionDict(prefix, dict_type=zstandard.DICT_TYPE_RAWCONTENT) if prefix else None


def compress_pdelta(payload: bytes, prefix: bytes | None, level: int) -> bytes:
    """A `.pdelta.zst` member: `payload` (a `.delta.zst` member's content: the .npy header and the filtered rows) in
    one zstd frame, compressed with `prefix` (the previous image's payload, or None) as a raw-content dictionary and a
    window that reaches over both, at level max(level, PDELTA_MIN_LEVEL) with a prefix and `level` without one.
    Deterministic: same bytes, same output."""
    level = max(level, PDELTA_MIN_LEVEL) if prefix else level
    window = zstandard.ZstdCompressionParameters.from_level(level, source_size=len(payload)).window_log
    window = min(_MAX_WINDOW_LOG, max(window, (len(payload) + len(prefix or b"") - 1).bit_length()))
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(payload), window_log=window, write_content_size=True
    )
    return zstandard.ZstdCompressor(compression_params=params, dict_data=_dictionary(prefix)).compress(payload)


def decompressor(prefix: bytes | None) -> zstandard.ZstdDecompressor:
    """The decompressor of a `.pdelta.zst` member compressed against `prefix` (the payload of the member its meta
    names, already decoded and size-checked by the reader; None: none), or of any other zstd member."""
    return zstandard.ZstdDecompressor(dict_data=_dictionary(prefix))


def pdelta_prefixes(images: list[dict], members) -> dict[str, str]:
    """A sample's meta `images` -> {member: the member it was compressed against} for its `.pdelta.zst` members that
    name a `prefix`. ValueError, one line, unless each prefix is the sample's previous image (number minus one), a
    `.pdelta.zst` member it holds (`members`), of the same size, and every occurrence of a member names the same."""
    sizes = {im["member"]: (im["height"], im["width"]) for im in images}
    members = set(members)  # a tuple of names would make each lookup, so a 999-image chain, cost the sample's length
    out: dict[str, str | None] = {}
    for im in images:
        member, prefix = im["member"], im.get("prefix")
        if out.setdefault(member, prefix) != prefix:
            raise ValueError(f"meta gives {member} two prefixes, {out[member]} and {prefix}")
        if prefix is None:
            continue
        want = f"img{int(member[3:6]) - 1:03d}{PDELTA}" if member.endswith(PDELTA) and member[3:6].isdigit() else None
        if prefix != want:
            raise ValueError(
                f"meta gives {member} the prefix {prefix}: only a .pdelta.zst member has one, and it is "
                f"the previous image's ({want or 'none'})"
            )
        if prefix not in members or prefix not in sizes:
            raise ValueError(f"{member}'s prefix {prefix} is not an image of the sample")
        if sizes[prefix] != sizes[member]:
            raise ValueError(
                f"{member} is {sizes[member][1]}x{sizes[member][0]}, its prefix {prefix} "
                f"{sizes[prefix][1]}x{sizes[prefix][0]}: a prefix has the same size"
            )
    return {m: p for m, p in out.items() if p is not None}

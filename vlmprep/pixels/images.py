"""Images: source bytes -> PIL (guarded decode, upright, 8-bit) -> the processor's own resize (uint8) -> stored
bytes, and back. Stored pixels are exactly those the processor would patchify, so the loader never resizes.
"""

from __future__ import annotations

import contextlib
import io
import struct
import warnings

import numpy as np
import zstandard
from PIL import Image, ImageOps, UnidentifiedImageError

from vlmprep.config import default
from vlmprep.families import FamilySpec
from vlmprep.pixels.views import mark_views, views_of_pixels
from vlmprep.types import ImageData, PreparedImage, RecordError, Views
from vlmprep_schemas.delta import compress_pdelta, filter_pixels
from vlmprep_schemas.limits import npy_head
from vlmprep_schemas.resize import processed, resize, resize_mode, strict_load

# Our own declared-size check replaces PIL's global bomb limit, so the limit is configurable per build.
Image.MAX_IMAGE_PIXELS = None

STORED_EXT = {"zstd-pdelta": "pdelta.zst", "zstd-delta": "delta.zst", "zstd": "npy.zst", "png": "png", "webp": "webp"}
_ORIGINAL_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # kept as they are when no transform applies
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_HIGH_BIT = _SIXTEEN_BIT + ("I", "F")
_PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")  # PNG stores these losslessly, palette and alpha included
_ORIENTATION = 0x0112
_TRANSPOSING = (5, 6, 7, 8)  # orientations that swap width and height
_HEADER_FORMATS = ("JPEG", "MPO", "PNG", "WEBP")  # PIL reads all their metadata on open (PNG: see upright_size)


def decode_image(
    img: ImageData, *, max_pixels: int, min_side: int = 1, opened: Image.Image | None = None
) -> Image.Image:
    """Open and fully load one image, rejecting bombs, corrupt data and animations with reason codes; the result
    is upright (EXIF orientation applied, tag dropped) and 8 bits per channel, in its own mode (alpha, palette).
    opened: `img` as _header opened it (checked, nothing decoded yet), so its header is not parsed twice."""
    with _image_faults(img):
        im = opened if opened is not None else _open_checked(img, max_pixels=max_pixels, min_side=min_side)
        with strict_load():
            im.load()
        return _to_8bit(_upright(im))


@contextlib.contextmanager
def _image_faults(img: ImageData):
    """PIL's errors on a source image -> corrupt_image, naming the image."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    except RecordError:
        raise
    except UnidentifiedImageError:
        raise RecordError(
            "corrupt_image", f"cannot decode image ({img.origin[:60]}): not an image format PIL can identify"
        ) from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RecordError("corrupt_image", f"cannot decode image ({img.origin[:60]}): {str(e)[:120]}") from None


def _open_checked(img: ImageData, *, max_pixels: int, min_side: int) -> Image.Image:
    """The image opened (header read, nothing decoded), with the checks its header alone allows."""
    im = Image.open(io.BytesIO(img.data))
    w, h = im.size
    if min(w, h) < min_side:
        raise RecordError("image_too_small", f"image is {w}x{h}, below min_image_side={min_side}")
    if w * h > max_pixels:
        raise RecordError("image_too_large", f"image declares {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
    # MPO: a phone JPEG carrying extra pictures (depth map, preview); the first is the photo load_image gives.
    if getattr(im, "n_frames", 1) > 1 and im.format != "MPO":
        raise RecordError("animated_image", f"animated {im.format} with {im.n_frames} frames is not supported")
    return im


def upright_size(img: ImageData, *, max_pixels: int, min_side: int = 1) -> tuple[int, int] | None:
    """(width, height) of decode_image's result, read from the header alone (EXIF orientation included), with the
    header checks of decode_image; None where only decoding tells: formats whose metadata PIL completes on load,
    and a PNG with chunks after its pixel data (text or eXIf there can carry an orientation)."""
    return _header(img, max_pixels=max_pixels, min_side=min_side)[1]


def _header(
    img: ImageData, *, max_pixels: int, min_side: int
) -> tuple[Image.Image, tuple[int, int] | None, str | None]:
    """The image opened and header-checked (nothing decoded), upright_size's answer, and the extension a lossy source
    is stored under as it is (_lossy_ext)."""
    with _image_faults(img):
        im = _open_checked(img, max_pixels=max_pixels, min_side=min_side)
        if im.format not in _HEADER_FORMATS or (im.format == "PNG" and not _png_metadata_first(img.data)):
            return im, None, None
        # Image.getexif itself: PngImageFile's decodes first, to find chunks after the pixels (checked above).
        w, h = im.size
        orientation = Image.Image.getexif(im).get(_ORIENTATION)
        keep = _lossy_ext(im, img.data) if orientation in (None, 1) else None
        return im, (h, w) if orientation in _TRANSPOSING else (w, h), keep


def _lossy_ext(im: Image.Image, data: bytes) -> str | None:
    """The extension a lossy source (a JPEG, baseline or progressive, any colour space; a lossy WebP) is stored under
    as it is, where the trainer's plain PIL decode of its bytes gives decode_image's pixels (8 bits, upright: the
    caller checked the orientation); None for any other source."""
    if im.mode in _HIGH_BIT:
        return None
    if im.format == "JPEG":
        return "jpg"
    return "webp" if im.format == "WEBP" and _webp_lossy(data) else None


def _webp_lossy(data: bytes) -> bool:
    """Whether a WebP's image chunk is VP8 (lossy), not VP8L (lossless): RIFF chunks read from the header on (an
    extended file's VP8X, ICCP, ALPH ... come first), at most 64 of them."""
    pos = 12
    for _ in range(64):
        if pos + 8 > len(data):
            return False
        kind, length = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if kind in (b"VP8 ", b"VP8L"):
            return kind == b"VP8 "
        pos += 8 + length + (length & 1)
    return False


def _png_metadata_first(data: bytes) -> bool:
    """Whether only image data and IEND follow a PNG's first IDAT chunk: then PIL's load adds no metadata to what
    its open read (it reads the chunks after the pixels, eXIf and text included, only on load)."""
    pos, pixels = 8, False
    while pos + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, pos)
        if kind == b"IEND":
            return True
        if pixels and kind != b"IDAT":
            return False
        pixels = pixels or kind == b"IDAT"
        pos += 12 + length
    return True  # cut short: decoding it fails, whatever its size


def _upright(im: Image.Image) -> Image.Image:
    # What transformers' load_image does first: the photo as a viewer shows it, the orientation tag then gone.
    if _orientation(im) in (None, 1):
        return im
    return ImageOps.exif_transpose(im)


def _orientation(im: Image.Image) -> int | None:
    return im.getexif().get(_ORIENTATION)


def _to_8bit(im: Image.Image) -> Image.Image:
    """16-bit and float grayscale -> "L", scaled (PIL's own convert("RGB") clips them: 16-bit turns white)."""
    if im.mode not in _HIGH_BIT:
        return im
    a = np.asarray(im)
    if im.mode == "F":
        if a.size and (np.nanmin(a) < 0 or np.nanmax(a) > 1 or np.isnan(a).any()):
            raise RecordError("unsupported_image_mode", "float image with values outside 0..1 has no 8-bit scale")
        return Image.fromarray(np.round(a.astype(np.float64) * 255).astype(np.uint8), "L")
    a = a.astype(np.int64)
    if im.mode == "I" and a.size and (a.min() < 0 or a.max() > 65535):
        raise RecordError(
            "unsupported_image_mode",
            "32-bit integer image with values outside 0..65535 has no 8-bit scale; save it as 8- or 16-bit",
        )
    return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), "L")  # round(v / 257): 65535 -> 255


def open_image(
    img: ImageData, processor, family: FamilySpec, *, max_pixels: int, min_side: int = 1, shapes: dict | None = None
) -> PreparedImage:
    """The image as the processor will store it, from its header alone: the grid comes from the processor's own
    resize run on a meta tensor of the upright size (shape, no data), and the pixels are decoded and resized on first
    use (PreparedImage.pixels), once, so an image that no sample keeps is never decoded (nor one stored as its source
    bytes: PreparedImage.check_source decodes only what a fault check needs). Header faults (not an image, too small
    or large, animated, aspect ratio) raise here; faults in the pixel data when the pixels are made or checked. Where
    the header cannot tell the size (upright_size), the pixels are made now. shapes: the stored shape by upright
    size, kept by a caller whose processor and pixel budget stay as they are (a Renderer: screenshots share a size)."""
    opened, size, keep = _header(img, max_pixels=max_pixels, min_side=min_side)
    if size is None:
        shape = None
    elif shapes is not None and size in shapes:
        shape = shapes[size]
    else:
        shape = _stored_shape(processor, family, *size)
        if shapes is not None:
            shapes[size] = shape
    if shape is None:
        return prepare_image(img, processor, family, max_pixels=max_pixels, min_side=min_side, opened=opened).keep_as(
            keep
        )

    def first_open() -> Image.Image | None:
        nonlocal opened  # the header's open image serves the first decode only: a retry after a fault opens afresh
        im, opened = opened, None
        return im

    def load() -> np.ndarray:
        im = first_open()
        pixels, decoded = _resized_pixels(img, processor, family, max_pixels=max_pixels, min_side=min_side, opened=im)
        assert pixels.shape[:2] == shape and decoded == size, (
            f"image {size}: header predicted {shape}, decoding gave {decoded} -> {pixels.shape[:2]}"
        )
        return pixels

    image = PreparedImage(
        grid_thw=_grid(processor.image_processor, family, shape),
        source=img,
        load=load,
        source_size=size,
        shape=shape,
    ).keep_as(keep, lambda: check_decode(img, max_pixels=max_pixels, min_side=min_side, opened=first_open()))
    if keep is not None:  # a large photo's views (pixels/views.py), made from its own decode, not held till written
        decode = lambda: _resized_pixels(img, processor, family, max_pixels=max_pixels, min_side=min_side)[0]  # noqa: E731
        mark_views(image, processor, decode, min_decode=AUTO_MAX_DECODE)
    return image


def source_views(image_processor, data: bytes, *, max_pixels: int) -> Views | None:
    """The views a build stores for a kept photo's source bytes `data` under `image_processor` (what verify checks a
    views member against); None where it stores none."""
    pil = decode_image(ImageData(data, "source"), max_pixels=max_pixels)
    with contextlib.closing(pil):
        return views_of_pixels(image_processor, processed(image_processor, pil).permute(1, 2, 0).contiguous().numpy())


def check_decode(img: ImageData, *, max_pixels: int, min_side: int = 1, opened: Image.Image | None = None) -> None:
    """Raise the RecordError decode_image would on a lossy source kept as it is (_lossy_ext: upright, 8 bits),
    making none of the pixels its store needs: a JPEG is entropy-decoded whole at 1/8 scale (libjpeg's DCT scaling:
    every coefficient is read, so a cut-off or broken stream fails as in a full decode, at a third to a half of its
    CPU), a WebP decoded."""
    with _image_faults(img):
        im = opened if opened is not None else _open_checked(img, max_pixels=max_pixels, min_side=min_side)
        if im.format == "JPEG":
            im.draft(None, (1, 1))
        with strict_load():
            im.load()


def prepare_image(
    img: ImageData,
    processor,
    family: FamilySpec,
    *,
    max_pixels: int,
    min_side: int = 1,
    opened: Image.Image | None = None,
) -> PreparedImage:
    """Decode and resize now, with the processor's own code path, per family (vlmprep_schemas.resize); uint8 throughout.
    opened: `img` as _header opened it, so its header is not parsed twice."""
    pixels, size = _resized_pixels(img, processor, family, max_pixels=max_pixels, min_side=min_side, opened=opened)
    return PreparedImage(
        pixels=pixels, grid_thw=_grid(processor.image_processor, family, pixels.shape[:2]), source=img, source_size=size
    )


def _resized_pixels(
    img: ImageData, processor, family: FamilySpec, *, max_pixels: int, min_side: int, opened: Image.Image | None = None
) -> tuple[np.ndarray, tuple[int, int]]:
    """The stored pixels and the upright (width, height) they were resized from."""
    import torch  # lazy: keeps CLI start-up fast for commands that never touch images

    pil = decode_image(img, max_pixels=max_pixels, min_side=min_side, opened=opened)
    with torch.no_grad():
        resized = _resize(processor, family, processed(processor.image_processor, pil), *pil.size)
    assert resized.dtype == torch.uint8, "processor resize must keep uint8 so stored pixels are exact"
    return np.ascontiguousarray(resized.permute(1, 2, 0).numpy()), pil.size  # a view where the resize kept HWC


def _stored_shape(processor, family: FamilySpec, w: int, h: int) -> tuple[int, int] | None:
    """(height, width) of the processor's resize of an upright w x h image: its own code run on a meta tensor,
    which has a shape and no data; None where that code needs real pixels."""
    import torch

    t = torch.empty((3, h, w), dtype=torch.float32, device="meta")  # uint8 would run the clamp (python, ~40 ms)
    try:
        with torch.no_grad():
            resized = _resize(processor, family, t, w, h)
    except RecordError:
        raise
    except Exception:  # noqa: BLE001 - a resize that reads pixel values: the image is decoded now instead
        return None
    return int(resized.shape[-2]), int(resized.shape[-1])


def _resize(processor, family: FamilySpec, t, w: int, h: int):
    """The processor's resize of one image (vlmprep_schemas.resize, the rule every load-time reader runs too)."""
    ip = processor.image_processor
    try:
        return resize(resize_mode(type(ip).__name__), ip, t, merged_patch(processor))
    except ValueError as e:  # smart_resize refuses aspect ratios over 200
        raise RecordError("bad_aspect_ratio", f"image {w}x{h}: {e}") from None


def merged_patch(processor) -> int:
    """Pixtral / Mistral 3's patch that both sides of a resized image are multiples of: the processor's patch size
    times its spatial merge (0 where the processor names none)."""
    return int(getattr(processor, "patch_size", 0) or 0) * int(getattr(processor, "spatial_merge_size", 1) or 1)


def _grid(ip, family: FamilySpec, shape: tuple[int, int]) -> tuple[int, int, int]:
    if family.grid_images:
        return 1, shape[0] // ip.patch_size, shape[1] // ip.patch_size
    return 1, shape[0], shape[1]  # no grid in these processors: the stored size, as image_sizes


# --image-format auto (docs/shard-format.md, "Storage per image"): a lossy source is kept as its bytes where its stored
# pixels would take over AUTO_MIN_RATIO times them, estimated at AUTO_BYTES_PER_PIXEL a stored pixel (zstd-pdelta of
# decoded photos measured 0.4-1.6, of JPEG screenshots 0.1-0.3) and where the loader's decode stays within
# AUTO_MAX_DECODE source pixels a stored one (a 12 MP photo resized to a 1 MP budget keeps its pixels: decoding it
# at every epoch costs ~4x the 45k tokens/s a core must give; SmolVLM's 12 MP photos, at 3.9, loaded at half the
# rate of their stored pixels kept as JPEGs, under a GPU's need: docs/performance.md).
AUTO_BYTES_PER_PIXEL = 1.0
AUTO_MIN_RATIO = 1.5
AUTO_MAX_DECODE = 3


def image_storage(image_format: str, image: PreparedImage) -> str:
    """The format one image is stored in: --image-format itself, or for auto, `original` (its source bytes, decoded
    and resized by the loader) for a lossy source that the rule above keeps, `zstd-pdelta` for every other image
    (lossless sources: screenshots, PNG, lossless WebP; an EXIF-rotated or 16-bit photo; one resized far down).
    Decided from the header alone: no pixel is made for it."""
    if image_format != "auto":
        return image_format
    if image.keep is None:
        return "zstd-pdelta"
    h, w = image.shape
    source = image.source_size[0] * image.source_size[1]
    if source > AUTO_MAX_DECODE * h * w:
        return "zstd-pdelta"
    return "original" if h * w * AUTO_BYTES_PER_PIXEL > AUTO_MIN_RATIO * len(image.source.data) else "zstd-pdelta"


def make_ready(image: PreparedImage, image_format: str) -> None:
    """Make now what storing `image` needs, so that a fault in it rejects its record: its pixels, or for a lossy
    source stored as its bytes only the check a decode of it would fail (check_source), no pixel made; under auto, a
    large photo's views beside its source (a whole decode: checks it too)."""
    if image.keep is not None and image_storage(image_format, image) == "original":
        if image_format == "auto" and image.may_have_views:
            image.make_views()
        else:
            image.check_source()
    else:
        _ = image.pixels


def stored_views(image_format: str, image: PreparedImage) -> Views | None:
    """The views stored beside `image`, stored as its source (its `vwsNNN.delta.zst` member): under auto, where
    made (make_ready made them)."""
    return image.make_views() if image_format == "auto" and image.may_have_views else None


def encode_views(views: Views, *, zstd_level: int = default("zstd_level")) -> bytes:
    """A views member: the packed array as a zstd-delta member (lossless and deterministic)."""
    return zstandard.ZstdCompressor(level=zstd_level).compress(delta_payload(views.packed))


def stored_ext(image_format: str, image: PreparedImage) -> str:
    """The member extension one image gets under --image-format (`orig.<source format>` for original)."""
    storage = image_storage(image_format, image)
    if storage == "original":
        return "orig." + (image.keep or _kept_source_ext(image.source.data) or "png")
    return STORED_EXT[storage]


def _kept_source_ext(data: bytes) -> str | None:
    """The extension the source bytes are stored under as they are, or None when the trainer's plain PIL decode of
    them would differ from decode_image (EXIF rotation, high bit depth) or the format is not JPEG / PNG / WebP."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in _ORIGINAL_EXT or im.mode in _HIGH_BIT or _orientation(im) not in (None, 1):
                return None
            return _ORIGINAL_EXT[im.format]


def _normalized_png(data: bytes) -> bytes:
    """decode_image's upright 8-bit image as a lossless PNG, alpha and palette kept, so the processor's own RGB
    conversion (alpha onto white) still applies when the trainer decodes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        im = _to_8bit(_upright(Image.open(io.BytesIO(data))))
    if im.mode not in _PNG_MODES:
        has_alpha = "A" in im.getbands() or im.info.get("transparency") is not None  # convert_to_rgb's own test
        im = im.convert("RGBA" if has_alpha else "RGB")
    im.info.pop("exif", None)
    buf = io.BytesIO()
    im.save(buf, format="PNG", compress_level=6)  # PIL writes info["transparency"] as the tRNS chunk
    return buf.getvalue()


def delta_payload(pixels: np.ndarray) -> bytes:
    """What a zstd-delta or zstd-pdelta member decompresses to: the .npy header of the pixels, then their filtered
    rows (vlmprep_schemas.delta)."""
    return b"".join((npy_head(pixels.shape, pixels.dtype), filter_pixels(pixels).data))  # one copy of the rows


def encode_image(
    image: PreparedImage,
    image_format: str,
    *,
    zstd_level: int = default("zstd_level"),
    prefix: PreparedImage | None = None,
) -> bytes:
    """Lossless and deterministic: same pixels and options give the same bytes. prefix: zstd-pdelta's previous image
    of the sample (same size), whose payload the image is compressed against; None for the first image. auto: the
    format image_storage picks for the image."""
    image_format = image_storage(image_format, image)
    if image_format == "zstd-delta":
        return zstandard.ZstdCompressor(level=zstd_level).compress(delta_payload(image.pixels))
    if image_format == "zstd-pdelta":
        return compress_pdelta(
            delta_payload(image.pixels), None if prefix is None else delta_payload(prefix.pixels), zstd_level
        )
    if image_format == "zstd":
        # np.save's bytes, with one copy of the pixels instead of its three (tobytes, write, getvalue)
        pixels = np.ascontiguousarray(image.pixels)
        return zstandard.ZstdCompressor(level=zstd_level).compress(
            b"".join((npy_head(pixels.shape, pixels.dtype), pixels.data))
        )
    if image_format == "png":
        buf = io.BytesIO()
        Image.fromarray(image.pixels, "RGB").save(buf, format="PNG", compress_level=6)
        return buf.getvalue()
    if image_format == "webp":
        buf = io.BytesIO()
        Image.fromarray(image.pixels, "RGB").save(buf, format="WEBP", lossless=True, quality=80, method=4, exact=True)
        return buf.getvalue()
    if image_format == "original":
        kept = image.keep or _kept_source_ext(image.source.data)
        return image.source.data if kept else _normalized_png(image.source.data)
    raise ValueError(f"unknown image_format {image_format!r}")

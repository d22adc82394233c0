"""Images: source bytes -> PIL (guarded decode, upright, 8-bit) -> the processor's own resize (uint8) -> stored
bytes, and back. Stored pixels are exactly those the processor would patchify, so the loader never resizes.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import warnings

import numpy as np
import zstandard
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vlmprep.families import FamilySpec
from vlmprep.types import ImageData, PreparedImage, RecordError

# Our own declared-size check replaces PIL's global bomb limit, so the limit is configurable per build.
Image.MAX_IMAGE_PIXELS = None

STORED_EXT = {"zstd": "npy.zst", "png": "png", "webp": "webp"}
_ORIGINAL_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # kept as they are when no transform applies
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_HIGH_BIT = _SIXTEEN_BIT + ("I", "F")
_PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")  # PNG stores these losslessly, palette and alpha included
_ORIENTATION = 0x0112


@contextlib.contextmanager
def _strict_load():
    """PIL's LOAD_TRUNCATED_IMAGES is process-wide and other libraries turn it on (llama_models.llama4.preprocess
    does, on import): a cut-off file must stay corrupt_image here whatever was imported before."""
    was = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = was


def decode_image(img: ImageData, *, max_pixels: int, min_side: int = 1) -> Image.Image:
    """Open and fully load one image, rejecting bombs, corrupt data and animations with reason codes; the result
    is upright (EXIF orientation applied, tag dropped) and 8 bits per channel, in its own mode (alpha, palette)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(io.BytesIO(img.data))
            w, h = im.size
            if min(w, h) < min_side:
                raise RecordError("image_too_small", f"image is {w}x{h}, below min_image_side={min_side}")
            if w * h > max_pixels:
                raise RecordError("image_too_large",
                                  f"image declares {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
            # MPO: a phone JPEG carrying extra pictures (depth map, preview); the first is the photo load_image gives.
            if getattr(im, "n_frames", 1) > 1 and im.format != "MPO":
                raise RecordError("animated_image", f"animated {im.format} with {im.n_frames} frames is not supported")
            with _strict_load():
                im.load()
            return _to_8bit(_upright(im))
    except RecordError:
        raise
    except UnidentifiedImageError:
        raise RecordError("corrupt_image", f"cannot decode image ({img.origin[:60]}): not an image format "
                                           "PIL can identify") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RecordError("corrupt_image", f"cannot decode image ({img.origin[:60]}): {str(e)[:120]}") from None


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
        raise RecordError("unsupported_image_mode", "32-bit integer image with values outside 0..65535 has no "
                                                    "8-bit scale; save it as 8- or 16-bit")
    return Image.fromarray(((a * 255 + 32767) // 65535).astype(np.uint8), "L")  # round(v / 257): 65535 -> 255


def prepare_image(img: ImageData, processor, family: FamilySpec, *, max_pixels: int,
                  min_side: int = 1) -> PreparedImage:
    """Resize with the processor's own code path, per family (see _FAMILY_RESIZE); uint8 throughout."""
    import torch  # lazy: keeps CLI start-up fast for commands that never touch images

    mode = family.image_mode
    ip = processor.image_processor
    pil = decode_image(img, max_pixels=max_pixels, min_side=min_side)
    w, h = pil.size
    with torch.no_grad():
        t = ip.process_image(pil, do_convert_rgb=getattr(ip, "do_convert_rgb", None) is not False)  # uint8 C x H x W
        try:
            resized = _FAMILY_RESIZE[mode](processor, ip, t)
        except ValueError as e:  # smart_resize refuses aspect ratios over 200
            raise RecordError("bad_aspect_ratio", f"image {w}x{h}: {e}") from None
    assert resized.dtype == torch.uint8, "processor resize must keep uint8 so stored pixels are exact"
    pixels = np.ascontiguousarray(resized.permute(1, 2, 0).numpy())
    if mode.startswith("smart_resize"):
        grid = (1, pixels.shape[0] // ip.patch_size, pixels.shape[1] // ip.patch_size)
    else:
        grid = (1, pixels.shape[0], pixels.shape[1])  # no grid in these processors: the stored size, as image_sizes
    return PreparedImage(pixels=pixels, grid_thw=grid, source=img, digest=hashlib.sha256(img.data).hexdigest(),
                         source_size=(w, h))


def _smart_resize(processor, ip, t):
    # Qwen2-VL / 2.5-VL / 3-VL / 3.5: smart_resize to multiples of patch * merge, within min/max pixels.
    return ip.resize(t[None], size=ip.size, resample=ip.resample, factor=ip.patch_size * ip.merge_size)[0]


def _smart_resize_temporal(processor, ip, t):
    # GLM-4.1V: the same, with the temporal factor its smart_resize also takes.
    return ip.resize(t[None], size=ip.size, resample=ip.resample, factor=ip.patch_size * ip.merge_size,
                     temporal_factor=ip.temporal_patch_size)[0]


def _longest_edge_patch(processor, ip, t):
    # Pixtral / Mistral 3: longest edge to size, both sides to multiples of the (merged) patch the processor passes.
    from transformers.image_utils import SizeDict

    p = processor.patch_size * processor.spatial_merge_size
    return ip.resize(t[None], size=ip.size, patch_size=SizeDict(height=p, width=p), resample=ip.resample)[0]


def _fixed_resize(processor, ip, t):
    # Gemma 3 without pan-and-scan: one fixed-size resize.
    return ip.resize(t[None], size=ip.size, resample=ip.resample)[0]


def _source(processor, ip, t):
    # Tiling processors (Mllama, Llama 4, Idefics3/SmolVLM, LLaVA-OneVision, InternVL) crop and resize into
    # several tiles plus a thumbnail; no single resized image reproduces that, so the decoded RGB source is stored
    # and the loader runs the saved processor on it with its defaults (pixel_values then equal the online path).
    return t


_FAMILY_RESIZE = {"smart_resize": _smart_resize, "smart_resize_temporal": _smart_resize_temporal,
                  "longest_edge_patch": _longest_edge_patch, "fixed_resize": _fixed_resize, "source": _source}


def stored_ext(image_format: str, image: PreparedImage) -> str:
    if image_format == "original":
        return "orig." + (_kept_source_ext(image.source.data) or "png")
    return STORED_EXT[image_format]


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


def encode_image(image: PreparedImage, image_format: str, *, zstd_level: int = 3) -> bytes:
    """Lossless and deterministic: same pixels and options give the same bytes."""
    if image_format == "zstd":
        buf = io.BytesIO()
        np.save(buf, image.pixels, allow_pickle=False)
        return zstandard.ZstdCompressor(level=zstd_level).compress(buf.getvalue())
    if image_format == "png":
        buf = io.BytesIO()
        Image.fromarray(image.pixels, "RGB").save(buf, format="PNG", compress_level=6)
        return buf.getvalue()
    if image_format == "webp":
        buf = io.BytesIO()
        Image.fromarray(image.pixels, "RGB").save(buf, format="WEBP", lossless=True, quality=80, method=4, exact=True)
        return buf.getvalue()
    if image_format == "original":
        return image.source.data if _kept_source_ext(image.source.data) else _normalized_png(image.source.data)
    raise ValueError(f"unknown image_format {image_format!r}")

"""Images: source bytes -> PIL (guarded decode) -> the processor's own resize (uint8) -> stored bytes, and back.
Stored pixels are exactly those the processor would patchify, so the loader never resizes.
"""
from __future__ import annotations

import hashlib
import io
import warnings

import numpy as np
import zstandard
from PIL import Image, UnidentifiedImageError

from vlmprep.types import ImageData, PreparedImage, RecordError

# Our own declared-size check replaces PIL's global bomb limit, so the limit is configurable per build.
Image.MAX_IMAGE_PIXELS = None

STORED_EXT = {"zstd": "npy.zst", "png": "png", "webp": "webp"}
_ORIGINAL_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}


def decode_image(img: ImageData, *, max_pixels: int, min_side: int = 1) -> Image.Image:
    """Open and fully load one image, rejecting bombs, corrupt data and animations with reason codes."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(io.BytesIO(img.data))
            w, h = im.size
            if min(w, h) < min_side:
                raise RecordError("image_too_small", f"image is {w}x{h}, below min_image_side={min_side}")
            if w * h > max_pixels:
                raise RecordError("image_too_large", f"image declares {w}x{h} = {w * h} pixels > max_image_pixels={max_pixels}")
            if getattr(im, "n_frames", 1) > 1:
                raise RecordError("animated_image", f"animated {im.format} with {im.n_frames} frames is not supported")
            im.load()
    except RecordError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise RecordError("corrupt_image", f"cannot decode image ({img.origin[:60]}): {str(e)[:120]}") from None
    return im


def prepare_image(img: ImageData, processor, *, max_pixels: int, min_side: int = 1) -> PreparedImage:
    """Resize with the processor's own code path (Qwen2-VL smart_resize, torchvision bicubic, uint8)."""
    import torch  # lazy: keeps CLI start-up fast for commands that never touch images

    ip = processor.image_processor
    pil = decode_image(img, max_pixels=max_pixels, min_side=min_side)
    w, h = pil.size
    with torch.no_grad():
        t = ip.process_image(pil, do_convert_rgb=ip.do_convert_rgb)  # uint8 C x H x W, as the processor sees it
        factor = ip.patch_size * ip.merge_size
        try:
            resized = ip.resize(t[None], size=ip.size, resample=ip.resample, factor=factor)[0]
        except ValueError as e:  # smart_resize refuses aspect ratios over 200
            raise RecordError("bad_aspect_ratio", f"image {w}x{h}: {e}") from None
    assert resized.dtype == torch.uint8, "processor resize must keep uint8 so stored pixels are exact"
    pixels = np.ascontiguousarray(resized.permute(1, 2, 0).numpy())
    gh, gw = pixels.shape[0] // ip.patch_size, pixels.shape[1] // ip.patch_size
    return PreparedImage(pixels=pixels, grid_thw=(1, gh, gw), source=img, digest=hashlib.sha256(img.data).hexdigest())


def stored_ext(image_format: str, image: PreparedImage) -> str:
    if image_format == "original":
        fmt = Image.open(io.BytesIO(image.source.data)).format or "BIN"
        return "orig." + _ORIGINAL_EXT.get(fmt, fmt.lower())
    return STORED_EXT[image_format]


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
        return image.source.data
    raise ValueError(f"unknown image_format {image_format!r}")


def decode_stored_image(ext: str, data: bytes) -> np.ndarray:
    """Stored member -> uint8 H x W x 3 (for 'orig.*' members: the source pixels, not yet resized). Never unpickles."""
    if ext.endswith("npy.zst"):
        raw = zstandard.ZstdDecompressor().decompress(data)
        arr = np.load(io.BytesIO(raw), allow_pickle=False)
        if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
            raise ValueError(f"stored image has dtype {arr.dtype} shape {arr.shape}, expected uint8 HxWx3")
        return arr
    with Image.open(io.BytesIO(data)) as im:
        return np.array(im.convert("RGB"))

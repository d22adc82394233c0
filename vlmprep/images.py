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

from vlmprep.families import FamilySpec
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


def prepare_image(img: ImageData, processor, family: FamilySpec, *, max_pixels: int, min_side: int = 1) -> PreparedImage:
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
    return PreparedImage(pixels=pixels, grid_thw=grid, source=img, digest=hashlib.sha256(img.data).hexdigest())


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

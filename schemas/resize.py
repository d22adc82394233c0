"""A source image -> the pixels vlmprep stores for it: the image processor's own RGB conversion and resize, per family
(keyed by image processor class). vlmprep's build (vlmprep/pixels/images.py) and every reader that resizes an `original`
member at load time (the trainer's decode, vlmprep's Collator) run this one code, so all of them make the same uint8
pixels, the ones the tokens were counted for.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import numpy as np

# How each image processor resizes one image (the class name without Fast / Pil); any other stores the source.
MODES = {
    "Qwen2VLImageProcessor": "smart_resize",  # Qwen2-VL, 2.5-VL, 3-VL, 3.5
    "Glm4vImageProcessor": "smart_resize_temporal",
    "PixtralImageProcessor": "longest_edge_patch",  # Mistral 3
    "Gemma3ImageProcessor": "fixed_resize",  # without pan-and-scan
}
# Processors that resize the whole image first and make everything else (patches, tiles, the global image) from that
# resize: their torchvision backends (the class name without Fast), whose resize leaves an image already at its target
# size untouched. vlmprep stores that resize only where it is a fixed point (the same size, and for Mllama the same
# tile canvas, when run again on it) and has fewer pixels than the source: then the processor, which still resizes at
# train time, changes nothing, and every reader gets the pixels the processor makes from the source; elsewhere (an
# upscale, or rounding that moves a side once more: a fifth of Gemma 4's sizes) the source. The other tiling
# processors (Llama 4, LLaVA-OneVision, InternVL) resize their global image or thumbnail from the source itself,
# which no single stored image reproduces: they store the source.
FIXED_POINT_MODES = {
    "Gemma4ImageProcessor": "patch_budget",  # aspect kept, within max_soft_tokens x pooling_kernel_size^2 patches
    "MllamaImageProcessor": "tile_canvas",  # fit to its best tile canvas
    "Idefics3ImageProcessor": "encoder_tiles",  # longest edge, then multiples of the encoder's tile (image splitting)
    "SmolVLMImageProcessor": "encoder_tiles",
}


def resize_mode(image_processor_type: str) -> str:
    """The resize of an image processor class (its name, as a saved config's image_processor_type): a MODES or
    FIXED_POINT_MODES value, or "source" (no resize: the RGB source is stored)."""
    base = image_processor_type.removesuffix("Fast")
    return FIXED_POINT_MODES.get(base) or MODES.get(base.removesuffix("Pil"), "source")


def original_mode(mode: str, stored: tuple[int, int] | None, source: tuple[int, int]) -> str:
    """The resize that makes an `original` member's stored pixels from its decoded source (height, width): `mode`
    (resize_mode's), except where a FIXED_POINT_MODES member's stored size (its meta's height x width) is its
    source's own: then it was stored as the source (built before those modes, or a size they keep as its source),
    which the processor resizes at train time, so none. stored None (no meta): `mode`."""
    fixed = mode in FIXED_POINT_MODES.values()
    return "source" if fixed and stored is not None and tuple(stored) == tuple(source) else mode


@contextlib.contextmanager
def strict_load():
    """PIL's LOAD_TRUNCATED_IMAGES is process-wide and other libraries turn it on (llama_models.llama4.preprocess
    does, on import): within this, a cut-off image stays an error whatever was imported before (the build's decode,
    the trainer's)."""
    from PIL import ImageFile

    was = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = was


def rgb_as_is(ip) -> bool:
    """Whether processed() takes an RGB image without transparency as its pixels are (the torchvision backend,
    converting to RGB): then any exact decode of those pixels may stand in for PIL's (the trainer's JPEG path)."""
    from transformers.image_processing_backends import TorchvisionBackend

    convert = getattr(ip, "do_convert_rgb", None) is not False
    return convert and type(ip).process_image is TorchvisionBackend.process_image


def processed(ip, pil):
    """The image processor's process_image of a PIL image (uint8 C x H x W), as a channels-last view: process_image's
    own last step, .contiguous(), transposes every pixel, and the resize after it then runs several times slower than
    on the view, for the same values (tests/vlmprep/test_images.py checks both ways agree)."""
    import torch
    from transformers.image_transforms import convert_to_rgb

    if not rgb_as_is(ip):
        return ip.process_image(pil, do_convert_rgb=getattr(ip, "do_convert_rgb", None) is not False)
    if pil.mode == "RGB" and pil.info.get("transparency") is None:
        with warnings.catch_warnings():  # read-only: the resize only reads it
            warnings.simplefilter("ignore")
            return torch.from_numpy(np.asarray(pil)).permute(2, 0, 1)  # what convert_to_rgb gives, less two copies
    return torch.from_numpy(convert_to_rgb(pil, return_numpy=True)).permute(2, 0, 1)  # process_image's PIL branch


def resize(mode: str, ip, t, patch: int = 0):
    """`t` (C x H x W, uint8 or a meta tensor) resized as the image processor `ip` resizes one image (`mode`,
    resize_mode's); `patch`: longest_edge_patch's merged patch, the processor's patch_size x spatial_merge_size.
    smart_resize's ValueError (an aspect ratio over 200) propagates."""
    if mode == "smart_resize":
        return ip.resize(t[None], size=ip.size, resample=ip.resample, factor=ip.patch_size * ip.merge_size)[0]
    if mode == "smart_resize_temporal":  # GLM-4.1V: the temporal factor its smart_resize also takes
        return ip.resize(
            t[None],
            size=ip.size,
            resample=ip.resample,
            factor=ip.patch_size * ip.merge_size,
            temporal_factor=ip.temporal_patch_size,
        )[0]
    if mode == "longest_edge_patch":  # longest edge to size, both sides to multiples of the merged patch
        from transformers.image_utils import SizeDict

        assert patch > 0, "longest_edge_patch needs the processor's merged patch"
        return ip.resize(t[None], size=ip.size, patch_size=SizeDict(height=patch, width=patch), resample=ip.resample)[0]
    if mode == "fixed_resize":
        return ip.resize(t[None], size=ip.size, resample=ip.resample)[0]
    if mode in _FIRST:
        return _at_fixed_point(mode, ip, t)
    assert mode == "source", f"unknown resize mode {mode!r}"
    return t


def _patch_budget(ip, t, resample):
    """Gemma 4's resize, with the arguments its _preprocess passes (None where it does not resize)."""
    if ip.do_resize is False:
        return None, None
    k = ip.pooling_kernel_size
    budget = ip.max_soft_tokens * k * k
    out = ip.aspect_ratio_preserving_resize(
        image=t, patch_size=ip.patch_size, max_patches=budget, pooling_kernel_size=k, resample=resample
    )
    return out, None


def _tile_canvas(ip, t, resample):
    """Mllama's resize (it always resizes) and the canvas it chose, (tiles high, tiles wide)."""
    out, canvas = ip.resize(image=t[None], size=ip.size, max_image_tiles=ip.max_image_tiles, resample=resample)
    return out[0], tuple(int(c) for c in canvas)


def _encoder_tiles(ip, t, resample):
    """Idefics3 / SmolVLM's two resizes before splitting into tiles (longest edge, then multiples of the tile), as its
    _preprocess runs them (None where it does not resize or split)."""
    if ip.do_resize is False or ip.do_image_splitting is False:
        return None, None
    out = ip.resize(t[None], size=ip.size, resample=resample)
    return ip.resize_for_vision_encoder(out, ip.max_image_size["longest_edge"], resample=resample)[0], None


_FIRST = {"patch_budget": _patch_budget, "tile_canvas": _tile_canvas, "encoder_tiles": _encoder_tiles}


def first_resize(mode: str, ip, t, resample=None):
    """A FIXED_POINT_MODES processor's first resize of `t` (C x H x W), called as its _preprocess calls it (its own
    resample unless one is given): (the resized image, or None where the processor does not resize; Mllama's canvas
    (tiles high, tiles wide), else None). The build's stored resize and the trainer's workers (trainer/data/tiles.py)
    both run this one call."""
    return _FIRST[mode](ip, t, ip.resample if resample is None else resample)


# The settings each first resize reads: with the mode and the source size, what decides whether it is stored.
_READS = {
    "patch_budget": ("do_resize", "patch_size", "max_soft_tokens", "pooling_kernel_size"),
    "tile_canvas": ("size", "max_image_tiles"),
    "encoder_tiles": ("do_resize", "do_image_splitting", "size", "max_image_size"),
}
# Per image processor, the decision by (mode, its settings, source size): the loader meets the same few sizes at every
# epoch, and the two shape runs cost ~0.05-0.1 ms a photo (a small photo loads in ~1.5 ms).
_DECIDED: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_MOST_DECIDED = 4096


def _at_fixed_point(mode: str, ip, t):
    """FIXED_POINT_MODES: `t` resized by the processor's first resize where that makes it smaller and is a fixed point
    of itself, else `t` (an upscaled image would store more pixels than its source). Decided on shapes alone (meta
    tensors: no pixel is made), then resized once."""
    h, w = (int(x) for x in t.shape[-2:])
    key = (mode, repr([getattr(ip, k, None) for k in _READS[mode]]), h, w)
    decided = _DECIDED.setdefault(ip, {})
    if key not in decided:
        if len(decided) >= _MOST_DECIDED:
            decided.clear()
        decided[key] = _stores_resize(mode, ip, h, w)
    if not decided[key]:
        return t  # no smaller: a source kept as its bytes pays no more at load, a lossless one stores fewer pixels
    return first_resize(mode, ip, t, 2 if t.device.type == "meta" else None)[0]  # meta: bilinear, no LANCZOS warning


def _stores_resize(mode: str, ip, h: int, w: int) -> bool:
    """Whether the first resize of an h x w source makes it smaller and gives the same size (and plan) when run again
    on its own output: run on meta tensors (shapes, no data)."""
    import torch

    def planned(h: int, w: int):
        out, plan = first_resize(mode, ip, torch.empty((3, h, w), dtype=torch.float32, device="meta"), 2)
        return None if out is None else (tuple(out.shape[-2:]), plan)

    once = planned(h, w)
    return once is not None and once[0][0] * once[0][1] < h * w and planned(*once[0]) == once


def stored_pixels(ip, mode: str, pil, patch: int = 0) -> np.ndarray:
    """A decoded PIL image (upright, 8-bit) -> the uint8 H x W x 3 pixels vlmprep stores for it: processed, then
    resized (resize's `mode` and `patch`)."""
    return resized_pixels(ip, mode, processed(ip, pil), patch)


def resized_pixels(ip, mode: str, t, patch: int = 0) -> np.ndarray:
    """processed()'s uint8 C x H x W -> the uint8 H x W x 3 pixels vlmprep stores: resized (resize's `mode` and
    `patch`)."""
    import torch

    with torch.no_grad():
        t = resize(mode, ip, t, patch)
    assert t.dtype == torch.uint8, "processor resize must keep uint8 so stored pixels are exact"
    return np.ascontiguousarray(t.permute(1, 2, 0).numpy())  # a view where the resize kept HWC

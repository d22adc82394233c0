"""Stored images -> a model's pixel inputs, with the dataset's own saved image processor: the one rule the trainer
(its host path) and vlmprep's collator share, so both give a model exactly what its processor makes from the records
(the stored pixels are the source images, or the processor's own resize: then it runs with do_resize=False).
Keyed by processor class; Qwen's families make theirs from grids instead (the trainer patchifies on the device).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PixelRule:
    """How one family's image processor is called for a batch, and what else its forward takes."""

    # The processor takes each sample's images as a list, as apply_chat_template passes them (Mllama, Idefics3, and
    # LLaVA-OneVision, which tiles a sample's one image but pads each of several to a square).
    nested: bool = False
    drop: tuple[str, ...] = ()  # processor outputs the forward does not take
    token_type_ids: bool = False  # Gemma: the image tokens (mm type 1) attend to each other both ways
    cross_attention: bool = False  # Mllama: the cross-attention mask, from the image tokens' positions


RULES: dict[str, PixelRule] = {
    "MllamaProcessor": PixelRule(nested=True, cross_attention=True, drop=("num_tiles",)),
    "Llama4Processor": PixelRule(drop=("aspect_ratios",)),
    "PixtralProcessor": PixelRule(),
    "Gemma3Processor": PixelRule(token_type_ids=True, drop=("num_crops",)),
    "Gemma4Processor": PixelRule(drop=("num_soft_tokens_per_image",)),
    "Glm4vProcessor": PixelRule(),
    "InternVLProcessor": PixelRule(drop=("num_patches",)),
    "LlavaOnevisionProcessor": PixelRule(nested=True),
    "Idefics3Processor": PixelRule(nested=True),
    "SmolVLMProcessor": PixelRule(nested=True),
}


def pixel_inputs(
    image_processor,
    rule: PixelRule,
    per_sample: list[list[np.ndarray]],
    *,
    resize: bool,
    ids: np.ndarray | None = None,
    mm: np.ndarray | None = None,
    image_token_id: int = -1,
    max_tiles: int = 0,
) -> dict:
    """Each sample's images in token order (uint8 H x W x 3, or a large photo's views: Packed) -> the batch's pixel
    inputs as torch tensors: what the processor gives for these images (resize: whether it resizes them), with the
    family's extras from the token ids `ids` and mm types `mm` (B x L): Gemma's token_type_ids, Mllama's
    cross-attention mask. Float inputs in fp32 (Llama 4's processor gives bf16): a model casts them to its own dtype."""
    from vlmprep_schemas.views import Packed

    kwargs = {"return_tensors": "pt"} if resize else {"return_tensors": "pt", "do_resize": False}
    tv = _torchvision(image_processor)
    packed = any(isinstance(im, Packed) for images in per_sample for im in images)
    assert not packed or (tv is not None and not rule.nested), "views are stored for Llama 4's and InternVL's only"
    if tv is not None:
        kwargs["input_data_format"] = "channels_first"
        _keep_layout(tv)
        inputs = [
            [im if isinstance(im, Packed) else _channels_first(im, resize) for im in images] for images in per_sample
        ]
    else:
        inputs = [[_pil(im) for im in images] for images in per_sample]
    if packed:
        out = _from_views(image_processor, tv, [im for images in inputs for im in images], kwargs)
    elif rule.cross_attention:
        out = _mllama(image_processor, inputs, ids, kwargs, image_token_id, max_tiles)
    elif not any(inputs):
        out = {}
    elif rule.nested:
        out = dict(image_processor(inputs, **kwargs))
    else:
        out = dict(image_processor([im for images in inputs for im in images], **kwargs))
    for k in rule.drop:
        out.pop(k, None)
    if rule.token_type_ids and mm is not None:
        import torch

        out["token_type_ids"] = torch.as_tensor(np.asarray(mm) == 1).long()
    # contiguous: the views' outputs can keep the pixels' channels-last strides (same values, as before)
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in out.items()}


def _from_views(image_processor, ip, inputs: list, kwargs: dict) -> dict:
    """The batch's outputs made image by image, a large photo's from its views (Packed; vlmprep_schemas.views.answered:
    the processor on its canvas, its global view answered with the stored one), each output concatenated in image
    order: what the processor gives for the whole batch (Llama 4's and InternVL's flatten their tiles per image)."""
    import torch

    from vlmprep_schemas.views import Packed, answered, unpack

    parts: list[dict] = []
    for t in inputs:
        if not isinstance(t, Packed):
            parts.append(dict(image_processor([t], **kwargs)))
            continue
        a, b = unpack(np.asarray(t.pixels), t.canvas, t.glob)
        av, bv = (_channels_first(x, resize=True) for x in (a, b))
        with answered(ip, av, bv):
            parts.append(dict(image_processor([av], **kwargs)))
    out = {}
    for k in parts[0]:
        vals = [p[k] for p in parts]
        out[k] = torch.cat(vals) if isinstance(vals[0], torch.Tensor) else [x for val in vals for x in val]
    return out


def _pil(im):
    from PIL import Image

    return Image.fromarray(np.asarray(im), "RGB")


# From this many pixels a resized image reaches the processor as a view of the stored pixels (_keep_layout): below it,
# and where the processor does not resize, its own C x H x W copy is as fast or faster (its float math on planes).
VIEW_MIN_PIXELS = 1 << 20


def _channels_first(im, resize: bool = False):
    """A stored uint8 H x W x 3 image -> C x H x W: a view of it where the processor resizes it and it is large
    (VIEW_MIN_PIXELS), else the contiguous copy the processor's process_image would make."""
    import torch

    with warnings.catch_warnings():  # a read-only slab: no processor writes its input
        warnings.simplefilter("ignore")
        t = torch.from_numpy(np.asarray(im)).permute(2, 0, 1)
    return t if resize and t.shape[1] * t.shape[2] >= VIEW_MIN_PIXELS else t.contiguous()


def _torchvision(image_processor):
    """The image processor itself where its backend is torchvision's, else None. That backend takes an RGB image as
    a channels-first view of the stored pixels (_channels_first), which it resizes as they lie (_keep_layout; a PIL
    image costs its RGB conversion and two more copies, ~40% of a 12 MP photo's processing); any other gets PIL's."""
    from transformers.image_processing_backends import TorchvisionBackend

    ip = getattr(image_processor, "func", image_processor)  # a functools.partial of it, or a wrapper naming it so
    tv = ip is not None and getattr(type(ip), "process_image", None) is TorchvisionBackend.process_image
    return ip if tv else None


def _keep_layout(ip) -> None:
    """Make the torchvision-backend processor `ip` take _channels_first's views as they are. Its process_image copies
    every image into C x H x W planes, and torch's antialiased uint8 resize runs 3-7x slower on planes than on the
    pixels' own channels-last layout (one kernel, the same values: tests/trainer/test_vision.py): most of a 12 MP
    photo's processing for Llama 4, InternVL and LLaVA-OneVision. Set once on the instance (the trainer's and the
    collator's own, loaded from the dataset); any other input goes through the backend's own process_image."""
    if "process_image" in vars(ip):
        return
    import types

    from transformers.image_processing_backends import TorchvisionBackend

    def process_image(self, image, *args, device=None, **kwargs):
        import torch

        view = isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3
        if view and image.shape[0] == 3 and image.stride(0) == 1 and image.stride(2) == 3:  # _channels_first's
            return image if device is None else image.to(device)  # no processor writes its input (read-only slabs)
        return TorchvisionBackend.process_image(self, image, *args, device=device, **kwargs)

    ip.process_image = types.MethodType(process_image, ip)


def _mllama(
    image_processor, inputs: list[list], ids: np.ndarray, kwargs: dict, image_token_id: int, max_tiles: int
) -> dict:
    """Mllama: images padded per sample to the batch's most (pixels 0, aspect ratio id 0, mask [1, 0, ...]), as its
    processor pads them, samples without images included; and the dense cross-attention mask."""
    import torch

    rows = [k for k, images in enumerate(inputs) if images]
    if not rows:
        return {}
    got = image_processor([inputs[k] for k in rows], **kwargs)
    B, n = len(inputs), max(len(images) for images in inputs)
    pv, ar, am = got["pixel_values"], got["aspect_ratio_ids"], got["aspect_ratio_mask"]
    if len(rows) < B:  # samples without images: their rows padded as the processor pads a sample's missing images
        pixel_values = torch.zeros((B, n, *pv.shape[2:]), dtype=pv.dtype)
        ratio_ids = torch.zeros((B, n), dtype=ar.dtype)
        ratio_mask = torch.zeros((B, n, am.shape[2]), dtype=am.dtype)
        ratio_mask[:, :, 0] = 1
        for j, k in enumerate(rows):
            m = len(inputs[k])
            pixel_values[k, :m], ratio_ids[k, :m], ratio_mask[k, :m] = pv[j, :m], ar[j, :m], am[j, :m]
        pv, ar, am = pixel_values, ratio_ids, ratio_mask
    tiles = [got["num_tiles"][rows.index(k)] if k in rows else [] for k in range(B)]
    max_tiles = max_tiles or image_processor.max_image_tiles
    return {
        "pixel_values": pv,
        "aspect_ratio_ids": ar,
        "aspect_ratio_mask": am,
        "cross_attention_mask": mllama_cross_attention(ids, image_token_id, tiles, max_tiles),
    }


def mllama_cross_attention(ids: np.ndarray, image_token_id: int, tiles: list[list[int]], max_tiles: int):
    """Mllama's dense cross-attention mask (B x L x images x max_tiles, int64) from the token ids (B x L) and each
    sample's images' tile counts, as its processor makes it."""
    import torch
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    masks = [get_cross_attention_token_mask(np.asarray(row).tolist(), image_token_id) for row in ids]
    dense = convert_sparse_cross_attention_mask_to_dense(
        masks, num_tiles=tiles, max_num_tiles=max_tiles, length=ids.shape[1]
    )
    return torch.from_numpy(dense)

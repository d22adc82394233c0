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
    """Each sample's images in token order (uint8 H x W x 3) -> the batch's pixel inputs as torch tensors: what the
    processor gives for these images (resize: whether it resizes them), with the family's extras from the token ids
    `ids` and mm types `mm` (B x L): Gemma's token_type_ids, Mllama's cross-attention mask. Float inputs in fp32
    (Llama 4's processor gives bf16): a model casts them to its own dtype."""
    kwargs = {"return_tensors": "pt"} if resize else {"return_tensors": "pt", "do_resize": False}
    as_input = _input_maker(image_processor)
    if as_input is not _pil:
        kwargs["input_data_format"] = "channels_first"
    inputs = [[as_input(im) for im in images] for images in per_sample]
    if rule.cross_attention:
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
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}


def _pil(im):
    from PIL import Image

    return Image.fromarray(np.asarray(im), "RGB")


def _channels_first(im):
    import torch

    with warnings.catch_warnings():  # a read-only slab: the processor copies it before any write
        warnings.simplefilter("ignore")
        return torch.from_numpy(np.asarray(im)).permute(2, 0, 1)


def _input_maker(image_processor):
    """How an RGB image reaches the processor: the torchvision backend takes it as a channels-first view of the
    stored pixels, which its process_image copies contiguous as it does a PIL image's (same values; a PIL image costs
    its RGB conversion and two more copies, ~40% of a 12 MP photo's processing); any other backend gets PIL's."""
    from transformers.image_processing_backends import TorchvisionBackend

    ip = getattr(image_processor, "func", image_processor)  # a functools.partial of it, or a wrapper naming it so
    tv = ip is not None and getattr(type(ip), "process_image", None) is TorchvisionBackend.process_image
    return _channels_first if tv else _pil


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

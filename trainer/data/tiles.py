"""The workers' resized uint8 images -> Gemma 4's padded patches and Llama 3.2 Vision's tiles on the training device,
bit for bit their image processor's (and the inputs the workers make beside them: position ids, aspect ratios, the
cross-attention mask); Llama 4's bfloat16 rescale + normalize of the uint8 pixel_values its processor makes; the
workers' uint8 padding of SmolVLM's tiles and LLaVA-OneVision's patches, and the device's padding after its math."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from vlmprep_schemas.resize import first_resize

# Gemma 4's and Mllama's torchvision-backend image processors (the PIL backends resize with PIL: they stay on the host).
PADDED = ("Gemma4ImageProcessor", "Gemma4ImageProcessorFast")
TILED = ("MllamaImageProcessor", "MllamaImageProcessorFast")
# Processors that do nothing after their rescale + normalize but stack the results: with both off they give uint8
# pixel_values, which the device rescales and normalizes (Llama 4 in bfloat16, its own override; InternVL's
# GotOcr2 as torchvision's backend does, fused).
UINT8 = tuple(f"{k}{b}" for k in ("Llama4ImageProcessor", "GotOcr2ImageProcessor") for b in ("", "Fast"))
# Idefics3's and SmolVLM's pad their normalized tiles with zeros and a pixel mask: with rescale, normalize and the pad
# off they give uint8 tiles, which the workers pad the same way (Uint8Tiles) and the device normalizes under the mask.
PADDED_TILES = tuple(f"{k}{b}" for k in ("Idefics3ImageProcessor", "SmolVLMImageProcessor") for b in ("", "Fast"))
# LLaVA-OneVision's pads each image's patches with zero patches up to the batch's most after its normalize: with
# rescale, normalize and that pad off it gives each image's uint8 patches, which the workers pad (Uint8Patches) and
# the device normalizes, the padding patches 0.0 again (the forward never reads them).
PADDED_PATCHES = ("LlavaOnevisionImageProcessor", "LlavaOnevisionImageProcessorFast")
_SETTINGS = ("patch_size", "pooling_kernel_size", "max_soft_tokens")


def host_uint8(cfg: dict) -> bool:
    """Whether the workers' pixel_values are uint8 for a saved image processor's settings (the caller checked they
    name the whole math): a UINT8, PADDED_TILES or PADDED_PATCHES class that rescales and normalizes (and, for the
    padded two, pads)."""
    kind = cfg.get("image_processor_type")
    padding = kind not in PADDED_TILES + PADDED_PATCHES or cfg.get("do_pad") is True
    ours = kind in UINT8 + PADDED_TILES + PADDED_PATCHES
    return ours and cfg["do_rescale"] is True and cfg["do_normalize"] is True and padding


def without_math(ip, kind: str):
    """The image processor `ip` (its class `kind`) called with its rescale and normalize off: a PADDED_TILES one
    through Uint8Tiles, which pads its uint8 tiles, a PADDED_PATCHES one through Uint8Patches; the others give uint8
    pixel_values as they are."""
    if kind in PADDED_TILES:
        return Uint8Tiles(ip)
    if kind in PADDED_PATCHES:
        return Uint8Patches(ip)
    return functools.partial(ip, do_rescale=False, do_normalize=False)


@dataclass(frozen=True)
class PatchBudget:
    """Gemma 4's patch side and its patches per image (max_soft_tokens x pooling_kernel_size^2): every image's
    pixel_values rows, real patches first, then zeros (position ids -1)."""

    patch_size: int
    max_patches: int

    @classmethod
    def of(cls, cfg: dict) -> "PatchBudget | None":
        """The budget of a saved image processor's settings where the device makes its pixel_values (Gemma 4's
        torchvision backend, resizing, with its rescale and normalization named), else None."""
        if cfg.get("image_processor_type") not in PADDED or cfg.get("do_resize") is False:
            return None
        values = [cfg.get(k) for k in _SETTINGS]
        if not all(type(v) is int and 0 < v <= 4096 for v in values):  # untrusted: checked before use
            return None
        patch, kernel, tokens = values
        return cls(patch_size=patch, max_patches=tokens * kernel * kernel)


def resize(ip, image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """One stored uint8 H x W x 3 image -> Gemma4ImageProcessor `ip`'s own resize of it (its
    aspect_ratio_preserving_resize, called with the arguments its _preprocess passes), uint8 H' x W' x 3. It resizes
    a channels-last view, not process_image's contiguous copy: the same values (tests/trainer/test_tiles.py), faster."""
    with torch.no_grad():
        out, _ = first_resize("patch_budget", ip, torch.as_tensor(image).permute(2, 0, 1))
    assert out.dtype == torch.uint8, "the processor's resize must keep uint8 so the device's pixels are exact"
    return out.permute(1, 2, 0).contiguous()  # a no-op where the resize kept the layout


def positions(sizes: list[tuple[int, int]], index: list[int], budget: PatchBudget) -> torch.Tensor:
    """Unique resized images' (height, width) + per-occurrence index -> image_position_ids, int64 N x max_patches x 2:
    each patch's (column, row) in row-major patch order, -1 on the padding rows (the processor's meshgrid "xy" and
    pad_along_first_dim)."""
    p = budget.patch_size
    out = np.full((len(index), budget.max_patches, 2), -1, dtype=np.int64)
    for k, u in enumerate(index):
        gh, gw = sizes[u][0] // p, sizes[u][1] // p
        out[k, : gh * gw, 0] = np.tile(np.arange(gw), gh)
        out[k, : gh * gw, 1] = np.repeat(np.arange(gh), gw)
    return torch.from_numpy(out)


def patches(
    scale: Callable[..., torch.Tensor],
    images: list[torch.Tensor],
    index: list[int],
    budget: PatchBudget,
    device: torch.device,
) -> torch.Tensor:
    """Unique resized uint8 H x W x 3 images + per-occurrence index -> pixel_values, float32 N x max_patches x
    (p * p * 3): each image rescaled + normalized by `scale` (Patchifier's, the processor's backend arithmetic; channels
    last here: elementwise, the same values), its patches in row-major order laid out (row, column, channel) as
    convert_image_to_patches does, then zero rows (the processor pads after its rescale and normalize)."""
    p = budget.patch_size
    out = torch.zeros((len(index), budget.max_patches, p * p * 3), dtype=torch.float32, device=device)
    first: dict[int, int] = {}
    for k, u in enumerate(index):
        h, w, _ = images[u].shape
        gh, gw = h // p, w // p
        assert gh * p == h and gw * p == w and gh * gw <= budget.max_patches, (
            f"image {h}x{w} is not the processor's resize to {p} px patches within {budget.max_patches}"
        )
        if u in first:  # a repeated image: copy its rows instead of recomputing them
            out[k].copy_(out[first[u]])
            continue
        first[u] = k
        x = scale(images[u].to(device, non_blocking=True), (-1,))
        out[k, : gh * gw].view(gh, gw, p, p, 3).copy_(x.reshape(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4))
    return out


@dataclass(frozen=True)
class TileCanvas:
    """Mllama's square tile side and its tiles per image: every image's pixel_values are max_tiles tiles, its own
    (its canvas split row by row) first, then zeros."""

    tile_size: int
    max_tiles: int

    @classmethod
    def of(cls, cfg: dict) -> "TileCanvas | None":
        """The canvas of a saved image processor's settings where the device makes its pixel_values (Mllama's
        torchvision backend, a square tile), else None."""
        size = cfg.get("size")
        if cfg.get("image_processor_type") not in TILED or not isinstance(size, dict):
            return None
        side, tiles = size.get("height"), cfg.get("max_image_tiles")
        if size.get("width") != side or not all(type(v) is int and 0 < v <= 4096 for v in (side, tiles)):
            return None
        return cls(tile_size=side, max_tiles=tiles)


def fit(ip, image: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """One stored uint8 H x W x 3 image -> MllamaImageProcessor `ip`'s own resize of it (its resize, as its
    _preprocess calls it), padded with pixel 0 at the bottom and right to its canvas as its pad does: uint8
    (tiles high x tile) x (tiles wide x tile) x 3; and (tiles high, tiles wide), its aspect ratio."""
    with torch.no_grad():
        out, (th, tw) = first_resize("tile_canvas", ip, torch.as_tensor(image).permute(2, 0, 1))
    assert out.dtype == torch.uint8, "the processor's resize must keep uint8 so the device's pixels are exact"
    side = ip.size.height
    canvas = torch.zeros((th * side, tw * side, 3), dtype=torch.uint8)
    canvas[: out.shape[-2], : out.shape[-1]] = out.permute(1, 2, 0)
    return canvas, (th, tw)


def mllama_inputs(
    ratios: list[tuple[int, int]], index: list[int], rows: list[int], ids: np.ndarray, token: int, max_tiles: int
) -> dict[str, torch.Tensor]:
    """Unique images' aspect ratios (fit's) + per-occurrence index and row, the token ids (B x L) -> Mllama's
    aspect_ratio_ids, aspect_ratio_mask (rows without images: id 0, mask [1, 0, ...]) and cross-attention mask."""
    from transformers.models.mllama.image_processing_mllama import (
        build_aspect_ratio_mask,
        convert_aspect_ratios_to_ids,
    )

    from vlmprep_schemas.pixels import mllama_cross_attention

    per_row: list[list[tuple[int, int]]] = [[] for _ in range(len(ids))]
    for u, b in zip(index, rows):
        per_row[b].append(ratios[u])
    return {
        "aspect_ratio_ids": convert_aspect_ratios_to_ids(per_row, max_image_tiles=max_tiles),
        "aspect_ratio_mask": build_aspect_ratio_mask(per_row, max_image_tiles=max_tiles),
        "cross_attention_mask": mllama_cross_attention(ids, token, [[h * w for h, w in r] for r in per_row], max_tiles),
    }


def tiled(
    scale: Callable[..., torch.Tensor],
    images: list[torch.Tensor],
    index: list[int],
    rows: list[int],
    batch_rows: int,
    canvas: TileCanvas,
    device: torch.device,
) -> torch.Tensor:
    """Unique uint8 canvases (fit's) + per-occurrence index and row -> pixel_values, float32 batch_rows x (the most
    images of a row) x max_tiles x 3 x tile x tile: each canvas rescaled + normalized by `scale` (its pixel-0 padding
    too, as the processor normalizes it; channels last here, the same values), split into tiles row by row as
    split_to_tiles does; the tiles and images no image fills stay 0 (the processor pads them after its math)."""
    side = canvas.tile_size
    most = max(Counter(rows).values())
    out = torch.zeros((batch_rows, most, canvas.max_tiles, 3, side, side), dtype=torch.float32, device=device)
    slots = [0] * batch_rows
    first: dict[int, tuple[int, int]] = {}
    for u, b in zip(index, rows):
        j, slots[b] = slots[b], slots[b] + 1
        h, w, _ = images[u].shape
        th, tw = h // side, w // side
        assert th * side == h and tw * side == w and th * tw <= canvas.max_tiles, (
            f"image {h}x{w} is not a canvas of {side} px tiles, at most {canvas.max_tiles}: was it fitted?"
        )
        if u in first:  # a repeated image: copy its tiles instead of recomputing them
            out[b, j].copy_(out[first[u]])
            continue
        first[u] = (b, j)
        x = scale(images[u].to(device, non_blocking=True), (-1,))
        out[b, j, : th * tw].view(th, tw, 3, side, side).copy_(x.reshape(th, side, tw, side, 3).permute(0, 2, 4, 1, 3))
    return out


def llama4_scale(pixels: torch.Tensor, rescale_factor: float, mean, std) -> torch.Tensor:
    """Llama 4's uint8 pixel_values (N x 3 x H x W) -> its processor's rescale + normalize, in bfloat16 as its
    rescale_and_normalize override computes them (then float32, as vlmprep_schemas.pixels gives the host's)."""
    x = pixels.to(torch.bfloat16) * rescale_factor
    mean = torch.as_tensor(mean, dtype=torch.bfloat16, device=x.device).view(1, -1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.bfloat16, device=x.device).view(1, -1, 1, 1)
    return x.sub_(mean).div_(std).float()


class Uint8Tiles:
    """An Idefics3 / SmolVLM image processor with its rescale, normalize and pad off: each sample's uint8 tiles (its
    resizes and split, unchanged), padded here as its pad() pads the normalized ones: zeros below and right of each
    tile up to the batch's largest, zero tiles up to its most a sample, and the pixel mask (1 on each tile), bool as
    the model makes it where none is given (the processor's int64 would be 8 bytes a pixel, more than the tile)."""

    def __init__(self, processor):
        # named as functools.partial names what it calls: vlmprep_schemas.pixels unwraps either to pick the inputs
        self.func = processor

    def __call__(self, images: list[list], **kwargs) -> dict[str, torch.Tensor]:
        """Each sample's images -> {"pixel_values": uint8 B x N x 3 x H x W, "pixel_attention_mask": bool B x N x
        H x W}."""
        kwargs.update(do_rescale=False, do_normalize=False, do_pad=False, return_tensors=None)
        per_sample = self.func(images, **kwargs)["pixel_values"]
        n = max(len(t) for t in per_sample)
        h = max(x.shape[-2] for t in per_sample for x in t)
        w = max(x.shape[-1] for t in per_sample for x in t)
        pixels = torch.empty((len(per_sample), n, 3, h, w), dtype=torch.uint8)  # zeroed where not a tile, below
        mask = torch.zeros((len(per_sample), n, h, w), dtype=torch.bool)
        for i, tiles in enumerate(per_sample):
            for j, x in enumerate(tiles):
                th, tw = x.shape[-2:]
                pixels[i, j, :, :th, :tw] = x
                pixels[i, j, :, th:], pixels[i, j, :, :th, tw:] = 0, 0
                mask[i, j, :th, :tw] = True
            pixels[i, len(tiles) :] = 0
        return {"pixel_values": pixels, "pixel_attention_mask": mask}


# The workers' input for the device alone (a leading "_": model_inputs never hands it to the forward): each image's own
# patch count, Uint8Patches'.
PATCHES = "_patches"


class Uint8Patches:
    """A LLaVA-OneVision image processor with its rescale, normalize and pad off: each image's uint8 patches (its
    resizes, pads and split, unchanged), padded here as its _pad_for_batching pads the normalized ones (zero patches
    up to the most an image of the micro-batch has), with each image's own count (PATCHES: the device makes the
    padding 0.0 after its math, as the processor leaves it)."""

    def __init__(self, processor):
        self.func = processor  # named as Uint8Tiles names it

    def __call__(self, images: list[list], **kwargs) -> dict[str, torch.Tensor]:
        """Each sample's images -> {"pixel_values": uint8 N x P x 3 x H x W, "image_sizes", "batch_num_images",
        PATCHES: int64 N}."""
        kwargs.update(do_rescale=False, do_normalize=False, do_pad=False, return_tensors=None)
        out = self.func(images, **kwargs)
        per_image = out["pixel_values"]
        pixels = torch.zeros(
            (len(per_image), max(len(x) for x in per_image), *per_image[0].shape[1:]), dtype=torch.uint8
        )
        for i, x in enumerate(per_image):
            pixels[i, : len(x)] = x
        return {
            "pixel_values": pixels,
            "image_sizes": torch.tensor(out["image_sizes"]),
            "batch_num_images": torch.tensor(out["batch_num_images"]),
            PATCHES: torch.tensor([len(x) for x in per_image]),
        }


def counted(scaled: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rescaled + normalized patches (N x P x 3 x H x W) -> 0.0 on each image's patches past its own count (N), as
    the processor's pad after its normalize leaves them."""
    keep = torch.arange(scaled.shape[1], device=scaled.device) < counts.to(scaled.device)[:, None]
    return torch.where(keep[:, :, None, None, None], scaled, 0.0)


def masked(scaled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rescaled + normalized tiles (B x N x 3 x H x W) -> 0.0 outside the pixel mask (B x N x H x W), as the
    processor's pad after its normalize leaves them."""
    return torch.where(mask.unsqueeze(2), scaled, 0.0)

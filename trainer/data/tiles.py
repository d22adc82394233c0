"""Pixels of the families whose image processor pads each image to a fixed size after its resize, made on the training
device from the uint8 images the DataLoader workers resized: Gemma 4's patches (rescale + normalize, 16 x 16 patches,
zero rows up to the patch budget) and their position ids (made in the workers), as Gemma4ImageProcessor makes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# Gemma 4's torchvision-backend image processor (the PIL backend resizes with PIL: it stays on the host).
PADDED = ("Gemma4ImageProcessor", "Gemma4ImageProcessorFast")
_SETTINGS = ("patch_size", "pooling_kernel_size", "max_soft_tokens")


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
    t = torch.as_tensor(image).permute(2, 0, 1)
    kernel = ip.pooling_kernel_size
    with torch.no_grad():
        out = ip.aspect_ratio_preserving_resize(
            image=t,
            patch_size=ip.patch_size,
            max_patches=ip.max_soft_tokens * kernel * kernel,
            pooling_kernel_size=kernel,
            resample=ip.resample,
        )
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

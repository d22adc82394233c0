"""Pixels on the training device: uint8 H x W x 3 images -> rescale + normalize + patchify -> pixel_values,
with the exact arithmetic and Qwen2-VL patch layout of the dataset's saved image processor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")


@dataclass(frozen=True)
class ImageSpec:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    config: dict = field(compare=False, repr=False)  # the processor's own dict, for load-time resizing

    @classmethod
    def from_config(cls, cfg: dict) -> "ImageSpec":
        kind = cfg.get("image_processor_type")
        if kind not in SUPPORTED:
            raise ValueError(f"image processor {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
        return cls(patch_size=int(cfg["patch_size"]), temporal_patch_size=int(cfg["temporal_patch_size"]),
                   merge_size=int(cfg["merge_size"]), image_mean=tuple(cfg["image_mean"]),
                   image_std=tuple(cfg["image_std"]), rescale_factor=float(cfg["rescale_factor"]),
                   do_rescale=bool(cfg["do_rescale"]), do_normalize=bool(cfg["do_normalize"]), config=dict(cfg))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        return 1, height // self.patch_size, width // self.patch_size


class Patchifier:
    """Same ops, same order, same dtypes as transformers' rescale_and_normalize + patchify, so pixel_values
    match the processor's bit for bit on the same device; elementwise ops commute with the reshapes."""

    def __init__(self, spec: ImageSpec, device: torch.device | str):
        self.spec = spec
        self.device = torch.device(device)
        if spec.do_rescale and spec.do_normalize:  # transformers fuses the two into one mean/std
            self.mean = torch.tensor(spec.image_mean, device=self.device) * (1.0 / spec.rescale_factor)
            self.std = torch.tensor(spec.image_std, device=self.device) * (1.0 / spec.rescale_factor)
        else:
            self.mean = torch.as_tensor(spec.image_mean, dtype=torch.float32, device=self.device)
            self.std = torch.as_tensor(spec.image_std, dtype=torch.float32, device=self.device)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.do_normalize:
            return x.to(torch.float32).sub(self.mean.view(-1, 1, 1)).div_(self.std.view(-1, 1, 1))
        if s.do_rescale:
            return x * s.rescale_factor
        return x.to(torch.float32)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """images: uint8 N x H x W x 3 of one shape -> float32 N x (H/p * W/p) x (3 * t * p * p)."""
        s = self.spec
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        n, h, w, c = images.shape
        gh, gw = h // p, w // p
        assert gh * p == h and gw * p == w and gh % m == 0 and gw % m == 0, \
            f"image {h}x{w} is not a multiple of patch {p} x merge {m}: was it resized by the processor?"
        x = images.permute(0, 3, 1, 2).reshape(n, c, gh // m, m, p, gw // m, m, p)
        x = self._scale(x.permute(0, 2, 5, 3, 6, 1, 4, 7))  # channel axis sits before the two patch axes
        return x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1).reshape(n, gh * gw, c * t * p * p)

    def __call__(self, images: list[torch.Tensor], index: list[int]) -> torch.Tensor:
        """Unique uint8 images + per-occurrence index -> pixel_values of all occurrences in token order."""
        by_shape: dict[tuple, list[int]] = {}
        for u, im in enumerate(images):
            by_shape.setdefault(tuple(im.shape), []).append(u)
        patches: list[torch.Tensor | None] = [None] * len(images)
        for members in by_shape.values():
            stacked = torch.stack([images[u].to(self.device, non_blocking=True) for u in members])
            for u, out in zip(members, self.patchify(stacked)):
                patches[u] = out
        return torch.cat([patches[u] for u in index], dim=0)

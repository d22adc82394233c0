"""Pixels on the training device: uint8 H x W x 3 images (and video frames) -> rescale + normalize + patchify ->
pixel_values (pixel_values_videos), with the exact arithmetic and Qwen2-VL patch layout of the dataset's saved image
(video) processor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
VIDEO_SUPPORTED = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")


@dataclass(frozen=True)
class ImageSpec:
    """The processor's pixel math that the trainer repeats: patch, temporal patch and merge size, rescale and
    normalization."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    config: dict = field(compare=False, repr=False)  # the processor's own dict, for load-time resizing
    video: "ImageSpec | None" = field(default=None, compare=False, repr=False)  # the saved video processor's

    @classmethod
    def from_config(cls, cfg: dict, video: dict | None = None) -> "ImageSpec":
        """`video`: the saved video processor's dict, whose mean/std/rescale make pixel_values_videos."""
        kind = cfg.get("image_processor_type") or cfg.get("video_processor_type")
        if kind not in SUPPORTED + VIDEO_SUPPORTED:
            raise ValueError(f"processor {kind!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED + VIDEO_SUPPORTED)})")
        return cls(video=cls.from_config(video) if video else None,
                   patch_size=int(cfg["patch_size"]), temporal_patch_size=int(cfg["temporal_patch_size"]),
                   merge_size=int(cfg["merge_size"]), image_mean=tuple(cfg["image_mean"]),
                   image_std=tuple(cfg["image_std"]), rescale_factor=float(cfg["rescale_factor"]),
                   do_rescale=bool(cfg["do_rescale"]), do_normalize=bool(cfg["do_normalize"]), config=dict(cfg))

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of one resized image of `height` x `width` pixels."""
        return 1, height // self.patch_size, width // self.patch_size


class Patchifier:
    """Same ops, same order, same dtypes as transformers' rescale_and_normalize + patchify, so pixel_values
    match the processor's bit for bit on the same device; elementwise ops commute with the reshapes."""

    def __init__(self, spec: ImageSpec, device: torch.device | str):
        self.spec = spec
        self.device = torch.device(device)
        self._video = Patchifier(spec.video, device) if spec.video else None
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

    def _patch_view(self, x: torch.Tensor) -> torch.Tensor:
        """scaled float C x H x W -> a view in patch order, (gh/m, gw/m, m, m, C, t, p, p), t broadcast."""
        s = self.spec
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        c, h, w = x.shape
        gh, gw = h // p, w // p
        assert gh * p == h and gw * p == w and gh % m == 0 and gw % m == 0, \
            f"image {h}x{w} is not a multiple of patch {p} x merge {m}: was it resized by the processor?"
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)

    def num_patches(self, image: torch.Tensor) -> int:
        """How many patches one resized image (H x W x C) makes."""
        h, w = image.shape[0], image.shape[1]
        return (h // self.spec.patch_size) * (w // self.spec.patch_size)

    def __call__(self, images: list[torch.Tensor], index: list[int]) -> torch.Tensor:
        """Unique uint8 H x W x 3 images + per-occurrence index -> float32 pixel_values of all occurrences in token
        order, (sum of patches) x (3 * t * p * p). Each image is scaled on a contiguous C x H x W copy and
        gathered straight into its rows of the output: pixel_values are large (a 1288x728 screenshot is 22 MB),
        so every extra pass over them (a stack, a reshape copy, a cat) costs more than the arithmetic."""
        s = self.spec
        dim = 3 * s.temporal_patch_size * s.patch_size * s.patch_size
        sizes = [self.num_patches(images[u]) for u in index]
        out = torch.empty((sum(sizes), dim), dtype=torch.float32, device=self.device)
        first: dict[int, tuple[int, int]] = {}
        row = 0
        for u, n in zip(index, sizes):
            rows = out[row:row + n]
            if u in first:  # a repeated image: copy its rows instead of recomputing them
                a, b = first[u]
                rows.copy_(out[a:b])
            else:
                x = self._scale(images[u].to(self.device, non_blocking=True).permute(2, 0, 1).contiguous())
                target = self._patch_view(x)
                rows.view(target.shape).copy_(target)
                first[u] = (row, row + n)
            row += n
        return out

    def videos(self, videos: list[list[torch.Tensor]]) -> torch.Tensor | None:
        """Per video its uint8 H x W x 3 frames -> float32 pixel_values_videos of all videos in token order, with the
        video processor's math: each frame scaled as an image, an odd frame count padded with the last frame, patches
        laid out (t, h/m, w/m, m, m, C, temporal_patch_size, p, p) as its patchify does. None without videos."""
        if not videos:
            return None
        assert self._video is not None, "the dataset holds videos but its processor dir saved no video processor"
        v = self._video
        s = v.spec
        p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
        out = []
        for frames in videos:
            x = torch.stack([f.to(self.device, non_blocking=True) for f in frames]).permute(0, 3, 1, 2)
            x = v._scale_frames(x.contiguous())
            if pad := -len(frames) % tp:
                x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            t, c, h, w = x.shape
            gh, gw = h // p, w // p
            assert gh * p == h and gw * p == w and gh % m == 0 and gw % m == 0, \
                f"frames {h}x{w} are not a multiple of patch {p} x merge {m}: were they resized by the processor?"
            x = x.reshape(t // tp, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            out.append(x.reshape(-1, c * tp * p * p))
        return torch.cat(out)

    def _scale_frames(self, x: torch.Tensor) -> torch.Tensor:
        """T x C x H x W uint8 -> scaled float32, elementwise exactly as _scale."""
        s = self.spec
        if s.do_normalize:
            return x.to(torch.float32).sub(self.mean.view(1, -1, 1, 1)).div_(self.std.view(1, -1, 1, 1))
        if s.do_rescale:
            return x * s.rescale_factor
        return x.to(torch.float32)

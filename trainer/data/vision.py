"""Pixels: the stored uint8 H x W x 3 images (and video frames) -> the model's pixel inputs. Qwen's families and
GLM-4.1V on the training device (Patchifier: rescale + normalize + patchify, the exact arithmetic and Qwen2-VL patch
layout of the saved image and video processors, which GLM-4.1V's image processor repeats); Gemma 3's on the device too
(Patchifier: the same rescale + normalize of its stored, already resized images, stacked N x 3 x H x W; without
pan-and-scan); Gemma 4's and Llama 3.2 Vision's on the device from the images the workers resized
(trainer/data/tiles.py); every other family on the host (HostPixels: the dataset's own saved image processor on the
stored pixels, in the DataLoader workers).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from trainer.data import tiles
from vlmprep_schemas.pixels import RULES, pixel_inputs

VIDEO_SUPPORTED = ("Qwen2VLVideoProcessor", "Qwen3VLVideoProcessor")
# Images stored on a patch grid (grid_thw = (1, h / patch, w / patch), prod / merge^2 placeholder tokens), whose
# pixel_values Patchifier makes: Qwen2-VL's image processor (Qwen2.5-VL, 3-VL and 3.5 save it too) and GLM-4.1V's, the
# same rescale_and_normalize and patchify. The other families' grid rows are the stored size (1, h, w), as vlmprep
# writes them.
GRID = tuple(
    f"{kind}{backend}" for kind in ("Qwen2VLImageProcessor", "Glm4vImageProcessor") for backend in ("", "Fast", "Pil")
)
# Images whose pixel_values are the stored (already resized) image itself, rescaled and normalized, N x 3 x H x W,
# which Patchifier makes on the device: Gemma 3's image processor without pan-and-scan (its crops stay on the host).
NORMALIZED = tuple(f"Gemma3ImageProcessor{backend}" for backend in ("", "Fast", "Pil"))
_NO_MATH = dict(image_mean=(), image_std=(), rescale_factor=1.0, do_rescale=False, do_normalize=False)
_MATH = tuple(_NO_MATH)  # the saved processor's settings that make its rescale and normalization


def _math(cfg: dict) -> dict:
    """The saved processor's rescale and normalization (_MATH), as ImageSpec holds them."""
    return dict(
        image_mean=tuple(cfg["image_mean"]),
        image_std=tuple(cfg["image_std"]),
        rescale_factor=float(cfg["rescale_factor"]),
        do_rescale=bool(cfg["do_rescale"]),
        do_normalize=bool(cfg["do_normalize"]),
    )


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
    grid_images: bool = True  # False: a family whose images are not on a patch grid (grid rows are the size)
    normalized: bool = False  # pixel_values are the rescaled + normalized images, N x 3 x H x W, made on the device
    # Gemma 4: pixel_values are the workers' resized images rescaled + normalized, patchified and zero-padded to this
    # budget on the device (trainer/data/tiles.py); None: another family
    budget: tiles.PatchBudget | None = None
    # Mllama: pixel_values are the workers' resized images on their canvas of tiles, rescaled + normalized and split
    # into tiles on the device (trainer/data/tiles.py); None: another family
    canvas: tiles.TileCanvas | None = None
    # Llama 4, InternVL, SmolVLM, LLaVA-OneVision: the host's pixel_values are uint8 (its processor with rescale and
    # normalize off), which the device rescales and normalizes (Patchifier.inputs)
    host_uint8: bool = False
    # Mistral 3's merged patch (the processor's patch_size x spatial_merge_size), which its resize of an `original`
    # member needs (vlmprep_schemas.resize); 0 where the processor names none.
    resize_patch: int = field(default=0, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg: dict, video: dict | None = None, settings: dict | None = None) -> "ImageSpec":
        """`video`: the saved video processor's dict, whose mean/std/rescale make pixel_values_videos; `settings`:
        the processor's own (processor_config.json's top level). A processor of a family that is not on a
        patch grid is read for its name only (its own class makes the pixels), and Gemma 3's for its math too."""
        kind = cfg.get("image_processor_type") or cfg.get("video_processor_type")
        if not isinstance(kind, str) or not kind.endswith(
            ("ImageProcessor", "ImageProcessorFast", "ImageProcessorPil", "VideoProcessor")
        ):
            raise ValueError(f"processor type {kind!r} is not an image processor")
        top = settings or {}
        patch, merge = top.get("patch_size"), top.get("spatial_merge_size", 1)  # untrusted: checked before use
        resize_patch = patch * merge if all(type(v) is int and 0 < v <= 1024 for v in (patch, merge)) else 0
        if kind not in GRID + VIDEO_SUPPORTED:
            # Gemma 3 normalizes on the device where its saved settings name the whole math and no pan-and-scan, Gemma 4
            # patchifies there where they name the math and its patch budget, Mllama tiles there (the math and a tile)
            math = all(k in cfg for k in _MATH)
            normalized = math and kind in NORMALIZED and not cfg.get("do_pan_and_scan")
            budget = tiles.PatchBudget.of(cfg) if math else None
            canvas = tiles.TileCanvas.of(cfg) if math else None
            host_uint8 = math and tiles.host_uint8(cfg)
            return cls(
                patch_size=1,
                temporal_patch_size=1,
                merge_size=1,
                **(_math(cfg) if normalized or budget or canvas or host_uint8 else _NO_MATH),
                config=dict(cfg),
                grid_images=False,
                normalized=normalized,
                budget=budget,
                canvas=canvas,
                host_uint8=host_uint8,
                resize_patch=resize_patch,
            )
        return cls(
            video=cls.from_config(video) if video else None,
            patch_size=int(cfg["patch_size"]),
            temporal_patch_size=int(cfg["temporal_patch_size"]),
            merge_size=int(cfg["merge_size"]),
            **_math(cfg),
            config=dict(cfg),
            resize_patch=resize_patch,
        )

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of one resized image of `height` x `width` pixels (the size itself where the
        family has no grid)."""
        return 1, height // self.patch_size, width // self.patch_size

    @property
    def kind(self) -> str:
        """The image processor's class name, as saved."""
        return str(self.config.get("image_processor_type") or self.config.get("video_processor_type"))


class Patchifier:
    """Same ops, same order, same dtypes as transformers' rescale_and_normalize + patchify, so pixel_values
    match the processor's bit for bit on the same device; elementwise ops commute with the reshapes. A saved `*Pil`
    processor (the PIL backend) gets that backend's own order: numpy's rescale, then its normalize. A `normalized`
    spec (Gemma 3) gets the same rescale + normalize and no patches: the images stacked N x 3 x H x W."""

    def __init__(self, spec: ImageSpec, device: torch.device | str):
        self.spec = spec
        self.device = torch.device(device)
        self._video = Patchifier(spec.video, device) if spec.video else None
        # The PIL backend rescales in float64 (to float32) and normalizes after, unfused: 1 ulp off the fused way.
        self.pil = spec.kind.endswith("Pil")
        if spec.do_rescale and spec.do_normalize and not self.pil:  # torchvision's: one fused mean/std
            self.mean = torch.tensor(spec.image_mean, device=self.device) * (1.0 / spec.rescale_factor)
            self.std = torch.tensor(spec.image_std, device=self.device) * (1.0 / spec.rescale_factor)
        else:
            self.mean = torch.as_tensor(spec.image_mean, dtype=torch.float32, device=self.device)
            self.std = torch.as_tensor(spec.image_std, dtype=torch.float32, device=self.device)

    def _scale(self, x: torch.Tensor, channels: tuple[int, ...] = (-1, 1, 1)) -> torch.Tensor:
        """uint8 C x H x W (`channels`: the view mean and std broadcast as, (1, -1, 1, 1) for T x C x H x W frames) ->
        scaled float32, as the processor's backend computes it."""
        s = self.spec
        if self.pil:
            x = x.to(torch.float64).mul_(s.rescale_factor).to(torch.float32) if s.do_rescale else x.to(torch.float32)
            return x.sub_(self.mean.view(channels)).div_(self.std.view(channels)) if s.do_normalize else x
        if s.do_normalize:
            return x.to(torch.float32).sub(self.mean.view(channels)).div_(self.std.view(channels))
        if s.do_rescale:
            return x * s.rescale_factor
        return x.to(torch.float32)

    def _patch_view(self, x: torch.Tensor) -> torch.Tensor:
        """scaled float C x H x W -> a view in patch order, (gh/m, gw/m, m, m, C, t, p, p), t broadcast."""
        s = self.spec
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        c, h, w = x.shape
        gh, gw = h // p, w // p
        assert gh * p == h and gw * p == w and gh % m == 0 and gw % m == 0, (
            f"image {h}x{w} is not a multiple of patch {p} x merge {m}: was it resized by the processor?"
        )
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        return x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)

    def num_patches(self, image: torch.Tensor) -> int:
        """How many patches one resized image (H x W x C) makes."""
        h, w = image.shape[0], image.shape[1]
        return (h // self.spec.patch_size) * (w // self.spec.patch_size)

    def inputs(self, batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A micro-batch's (pixel_values, pixel_values_videos) made here, on the device; (None, None) where the host
        made its pixel_values (in `batch.vision`, with the family's extras: what the forward takes, model_inputs)."""
        host = batch.vision.get("pixel_values")
        if host is not None:  # the host's: as they are, or its uint8 rescaled + normalized here (host_uint8)
            mask, counts = batch.vision.get("pixel_attention_mask"), batch.vision.get(tiles.PATCHES)
            return (self.host_math(host, mask, counts) if host.dtype == torch.uint8 else None), None
        if self.spec.canvas is not None:  # Mllama's tiles: each image in its sample's row
            rows, n = list(batch.image_rows), len(batch.input_ids)
            return tiles.tiled(
                self._scale, batch.images, batch.image_index, rows, n, self.spec.canvas, self.device
            ), None
        return self(batch.images, batch.image_index), self.videos(batch.videos)

    def host_math(
        self, pixels: torch.Tensor, mask: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The host's uint8 pixel_values (N x 3 x H x W, its processor's with rescale and normalize off; Idefics3's
        B x N x 3 x H x W, padded under the pixel `mask`; LLaVA-OneVision's N x P x 3 x H x W, each image's own patch
        `counts` first) -> float32, rescaled + normalized as that processor does: Llama 4's in bfloat16, others' as
        torchvision's backend, the padding 0.0."""
        s = self.spec
        if s.kind.startswith("Llama4"):
            return tiles.llama4_scale(pixels, s.rescale_factor, s.image_mean, s.image_std)
        if mask is not None or counts is not None:
            x = self._scale(pixels.flatten(0, 1), (1, -1, 1, 1)).view(pixels.shape)
            return tiles.masked(x, mask) if mask is not None else tiles.counted(x, counts)
        return self._scale(pixels, (1, -1, 1, 1))

    def normalize(self, images: list[torch.Tensor], index: list[int]) -> torch.Tensor:
        """Unique uint8 H x W x 3 images (all of one size: the processor's resize) + per-occurrence index -> float32
        pixel_values of all occurrences in token order, N x 3 x H x W: the image processor's rescale + normalize of
        each, no patches (Gemma 3's)."""
        assert len({tuple(im.shape) for im in images}) == 1, "images of different sizes: were they resized?"
        x = torch.stack([im.to(self.device, non_blocking=True) for im in images]).permute(0, 3, 1, 2)
        x = self._scale(x.contiguous(), (1, -1, 1, 1))
        return x if list(index) == list(range(len(images))) else x[torch.as_tensor(index, device=self.device)]

    def __call__(self, images: list[torch.Tensor], index: list[int]) -> torch.Tensor:
        """Unique uint8 H x W x 3 images + per-occurrence index -> float32 pixel_values of all occurrences in token
        order, (sum of patches) x (3 * t * p * p) (a `normalized` spec: N x 3 x H x W, `normalize`). Each image is
        scaled on a contiguous C x H x W copy and gathered straight into its rows of the output: pixel_values are
        large (a 1288x728 screenshot is 22 MB), so every extra pass over them (a stack, a reshape copy, a cat) costs
        more than the arithmetic."""
        s = self.spec
        if s.normalized:
            return self.normalize(images, index)
        if s.budget is not None:
            return tiles.patches(self._scale, images, index, s.budget, self.device)
        dim = 3 * s.temporal_patch_size * s.patch_size * s.patch_size
        sizes = [self.num_patches(images[u]) for u in index]
        out = torch.empty((sum(sizes), dim), dtype=torch.float32, device=self.device)
        first: dict[int, tuple[int, int]] = {}
        row = 0
        for u, n in zip(index, sizes):
            rows = out[row : row + n]
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
            x = v._scale(x.contiguous(), (1, -1, 1, 1))
            if pad := -len(frames) % tp:
                x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            t, c, h, w = x.shape
            gh, gw = h // p, w // p
            assert gh * p == h and gw * p == w and gh % m == 0 and gw % m == 0, (
                f"frames {h}x{w} are not a multiple of patch {p} x merge {m}: were they resized by the processor?"
            )
            x = x.reshape(t // tp, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            out.append(x.reshape(-1, c * tp * p * p))
        return torch.cat(out)


PLACEHOLDER_SIDE = 64  # the black image a host family's micro-batch without images gets (its processor resizes it)


def host_pixels(
    family, processor_dir: str, spec: ImageSpec, token_id: int
) -> tuple[HostPixels, tuple[int, ...], tuple[int, int]]:
    """A host family's pixel maker, and its placeholder image: `token_id` (the model's image token) as many times as
    the processor's own expansion of one PLACEHOLDER_SIDE black image has it, and the size that
    black image is stored at (the processor's resize of it where the family stores resized pixels), so that the
    placeholder goes through the same call as every stored image (collate.placeholders)."""
    from PIL import Image

    from trainer.data.processors import load_processor

    processor = load_processor(processor_dir)
    host = HostPixels(
        family,
        spec.config,
        image_token_id=int(getattr(processor, "image_token_id", -1) or -1),
        max_tiles=int(getattr(processor.image_processor, "max_image_tiles", 0) or 0),
        images=not (spec.normalized or spec.budget or spec.canvas),
        budget=spec.budget,
        canvas=spec.canvas,
        math=not spec.host_uint8,
    )
    black = Image.new("RGB", (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE))
    # The processor's own expansion of its image token, never the dataset's chat template (untrusted Jinja: a
    # looping one would stall the start-up; docs/untrusted-datasets.md). Same ids and pixels for every family.
    out = processor(text=processor.image_token, images=[black], return_tensors="pt")
    ids = np.asarray(out["input_ids"]).reshape(-1)
    n = int((ids == token_id).sum())
    assert n, f"the processor in {processor_dir} renders an image with no token {token_id} (the model's image token)"
    size = (PLACEHOLDER_SIDE, PLACEHOLDER_SIDE)
    if family.resized:  # stored as the processor resized it: the size its output says
        if "image_sizes" in out:
            size = tuple(int(x) for x in out["image_sizes"][0])
        elif "image_grid_thw" in out:
            _, gh, gw = (int(x) for x in out["image_grid_thw"][0])
            size = (gh * spec.patch_size, gw * spec.patch_size)
        else:
            size = tuple(int(x) for x in out["pixel_values"].shape[-2:])
    return host, (token_id,) * n, size


class HostPixels:
    """The dataset's own image processor, on the host (in the DataLoader workers): each micro-batch's stored images ->
    the model's pixel inputs (pixel_values and whatever else the family's forward takes: aspect ratios, image
    sizes, tile masks, Gemma's token types, Mllama's cross-attention mask), exactly as the processor makes them from
    the records (vlmprep_schemas.pixels, the rule vlmprep's collator shares); for Gemma 3 normalized on the device,
    its token types alone; for Gemma 4 and Mllama, whose pixel_values the device makes, the resized images and the
    inputs made from them (device_images); for Llama 4, InternVL, SmolVLM and LLaVA-OneVision uint8 pixel_values
    (rescale and normalize off: the device's, Patchifier.host_math; SmolVLM's padded here, tiles.Uint8Tiles,
    LLaVA-OneVision's by tiles.Uint8Patches). Picklable: each process loads the processor (its saved config only, no
    code) once, on first use."""

    def __init__(
        self,
        family,
        config: dict,
        *,
        image_token_id: int = -1,
        max_tiles: int = 0,
        images: bool = True,
        budget: tiles.PatchBudget | None = None,
        canvas: tiles.TileCanvas | None = None,
        math: bool = True,
    ):
        """`config`: the saved image processor's settings; `image_token_id`: the token the cross-attention mask is
        made from (Mllama); `max_tiles`: its tiles per image; `images=False`: the device makes pixel_values
        (Patchifier), this only the family's extras from the tokens (Gemma 3's token_type_ids); `budget`: Gemma 4's
        patch budget, `canvas` Mllama's tiles: whose images this resizes for the device (device_images); `math=False`:
        the processor's rescale and normalize off (Llama 4, InternVL, SmolVLM, LLaVA-OneVision: the device's)."""
        self.family = family
        self.images = images
        self.budget, self.canvas, self.math = budget, canvas, math
        self.rule = RULES[family.processor_classes[0]]
        self.config = dict(config)
        self.image_token_id = image_token_id
        self.max_tiles = max_tiles
        self._ip = None

    def __getstate__(self):
        return {**self.__dict__, "_ip": None}

    @property
    def processor(self):
        """The image processor, loaded from the saved settings alone (a temp dir holding only them)."""
        if self._ip is None:
            from transformers import AutoImageProcessor

            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "preprocessor_config.json").write_text(json.dumps(self.config))
                self._ip = AutoImageProcessor.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        return self._ip

    def device_images(
        self, images: list, index: list[int], rows: list[int], ids: np.ndarray
    ) -> tuple[list, dict[str, torch.Tensor]]:
        """The micro-batch's unique stored images (uint8 H x W x 3) + per-occurrence index and row, its token ids
        (B x L) -> the images the device makes pixel_values of, and the inputs made here: for Gemma 4 each image
        resized once by the processor's own resize, and their image_position_ids; for Mllama each resized and
        padded to its canvas of tiles, and the aspect ratios and cross-attention mask; else the images, and nothing."""
        if self.budget is not None:
            resized = [tiles.resize(self.processor, im) for im in images]
            sizes = [im.shape[:2] for im in resized]
            return resized, {"image_position_ids": tiles.positions(sizes, index, self.budget)}
        if self.canvas is not None:
            fitted = [tiles.fit(self.processor, im) for im in images]
            tokens, most = self.image_token_id, self.max_tiles or self.canvas.max_tiles
            extra = tiles.mllama_inputs([r for _, r in fitted], index, rows, ids, tokens, most)
            return [c for c, _ in fitted], extra
        return images, {}

    def __call__(self, per_sample: list[list], ids: np.ndarray, mm: np.ndarray) -> dict[str, torch.Tensor]:
        """Each sample's images in token order (uint8 H x W x 3, as stored, or a large photo's views:
        vlmprep_schemas.views.Packed), the token ids and mm types (B x L) -> the model's pixel inputs for the
        micro-batch."""
        if not self.images:  # no image for the processor: it is never loaded, and only the extras are made
            per_sample = [[] for _ in per_sample]
        ip = self.processor if self.images else None
        if ip is not None and not self.math:  # uint8 pixel_values: the device rescales and normalizes them
            ip = tiles.without_math(ip, self.config.get("image_processor_type"))
        return pixel_inputs(
            ip,
            self.rule,
            per_sample,
            resize=not self.family.resized,
            ids=ids,
            mm=mm,
            image_token_id=self.image_token_id,
            max_tiles=self.max_tiles,
        )

"""Kept photos: an `img*.orig.*` member's source bytes -> the pixels the build counted the tokens for, decoded and
resized at load time (in the DataLoader workers) with the dataset's saved image processor and the code the build ran
(vlmprep_schemas.resize); or, where the build stored them (format v5), a large photo's views, loaded in its place
(views_layout; vlmprep_schemas.views)."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.data.jpeg import JpegHeader, jpeg_rgb
from trainer.data.vision import ImageSpec
from vlmprep_schemas.resize import original_mode, resize_mode, resized_pixels, rgb_as_is, stored_pixels
from vlmprep_schemas.views import has_views, packed_height, unnamed_views, views_member


class OriginalResizer:
    """`img*.orig.*` members hold source bytes: decoded and resized at load time by the saved image processor, with the
    very code vlmprep ran when it counted the tokens (vlmprep_schemas.resize: its RGB conversion, then its family's
    resize), so they become exactly the pixels a stored member of the image would hold."""

    def __init__(self, spec: ImageSpec):
        self.spec, self.mode = spec, resize_mode(spec.kind)
        self._ip, self._as_is = None, False  # the saved processor, once loaded; rgb_as_is of it

    def __call__(
        self, data: bytes, opened: Image.Image | JpegHeader | None = None, size: tuple[int, int] | None = None
    ) -> np.ndarray:
        """One stored source image (encoded bytes; `opened`: its header as _decoded_size read it, a PIL image or a
        JpegHeader) -> uint8 H x W x 3, resized as the saved processor resizes it; `size`: the meta's height x width
        of it, which tells a tiling processor's stored source from its stored resize (original_mode)."""
        if self._ip is None:
            from transformers import AutoImageProcessor

            with tempfile.TemporaryDirectory() as tmp:
                Path(tmp, "preprocessor_config.json").write_text(json.dumps(self.spec.config))
                self._ip = AutoImageProcessor.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
            self._as_is = rgb_as_is(self._ip)
        patch = self.spec.resize_patch
        if isinstance(opened, JpegHeader):  # PIL would open it as RGB: libjpeg-turbo's exact pixels, no PIL
            rgb = jpeg_rgb(data, opened.width, opened.height) if self._as_is else None
            if rgb is not None:
                mode = original_mode(self.mode, size, (opened.height, opened.width))
                return resized_pixels(self._ip, mode, rgb.permute(2, 0, 1), patch)
            opened = None
        with opened or Image.open(io.BytesIO(data)) as pil:
            return stored_pixels(self._ip, original_mode(self.mode, size, (pil.height, pil.width)), pil, patch)


def views_layout(
    meta: dict, members: dict[str, bytes], layout: list[tuple[str, int, int]], spec: ImageSpec
) -> tuple[list[tuple[tuple[int, int], tuple[int, int]] | None], list[tuple[str, int, int]]]:
    """Per unique image its views' (canvas, global) sizes where its meta entry names views (format v5), None
    elsewhere ([] where none does), and the layout that decodes: such an image's entry the views member and the packed
    array's size. A views member belongs to the kept photo of its number, for a processor that has views, and to
    nothing else."""
    entries = {im["member"]: im.get("views") for im in meta["images"]}
    out: list = [None] * len(layout)
    loaded = list(layout)
    for u, (member, h, w) in enumerate(layout):
        views = entries.get(member)
        if views is None:
            continue
        want = views_member(member)
        if ".orig." not in member or views["member"] != want or want not in members:
            raise ValueError(f"meta gives {member!r} views {views['member']!r}: not the member {want} of a kept photo")
        if not has_views(spec.kind):
            raise ValueError(f"{views['member']}: views, but the dataset's image processor {spec.kind} makes none")
        canvas, glob = (tuple(int(x) for x in views[k]) for k in ("canvas", "global"))
        if canvas[0] * canvas[1] >= h * w or glob[0] * glob[1] > canvas[0] * canvas[1]:
            raise ValueError(f"{views['member']}: a {canvas} canvas and {glob} global view for a {h}x{w} photo")
        loaded[u] = (views["member"], packed_height(canvas, glob), canvas[1])
        out[u] = (canvas, glob)
    stray = unnamed_views(meta["images"], members)
    if stray:
        raise ValueError(f"views members {stray[:3]} belong to no kept photo in the meta")
    return (out if any(v is not None for v in out) else []), loaded

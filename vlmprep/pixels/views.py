"""A large photo's views for Llama 4 and InternVL (vlmprep_schemas.views): which kept photos get them (the header
alone), and the views of decoded pixels, made on a copy of the build's image processor."""

from __future__ import annotations

import copy
import weakref
from typing import Callable

import numpy as np

from vlmprep.types import PreparedImage, Views
from vlmprep_schemas.pixels import _keep_layout, _torchvision
from vlmprep_schemas.views import has_views, pack, views_of

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # image processor -> its copy that views_of hooks


def mark_views(image: PreparedImage, processor, decode: Callable[[], np.ndarray], *, min_decode: int) -> None:
    """Mark kept photo `image` as one whose views are made (PreparedImage.make_views, by `decode`: its source's
    pixels) where the processor is a VIEW_PROCESSORS one on torchvision's backend and the source has over
    `min_decode` pixels for each pixel of its largest canvas (`max_patches` tiles; decoding it at every epoch would
    cost the loader more than the views' decompress). From the header alone: nothing is decoded here."""
    ip = processor.image_processor
    if not has_views(type(ip).__name__) or _torchvision(ip) is None or not image.source_size[0]:
        return
    canvas = int(getattr(ip, "max_patches", 0) or 0) * int(ip.size.height) * int(ip.size.width)
    w, h = image.source_size
    if w * h > min_decode * canvas > 0:
        image.views_from(lambda: views_of_pixels(ip, decode()))


def views_of_pixels(image_processor, src: np.ndarray) -> Views | None:
    """The views of decoded source `src` (uint8 H x W x 3) under `image_processor`, run on a copy of it (views_of
    sets its own resize on the instance) that takes the pixels as the trainer's host path hands them over; None where
    they would not give the processor's output exactly."""
    import torch

    ip = _COPIES.get(image_processor)
    if ip is None:
        ip = _COPIES[image_processor] = copy.deepcopy(image_processor)
        _keep_layout(ip)
    with torch.no_grad():
        got = views_of(ip, torch.from_numpy(src).permute(2, 0, 1), _one_image)
    if got is None:
        return None
    a, b = got
    return Views(packed=pack(a, b), canvas=a.shape[:2], glob=b.shape[:2])


def _one_image(ip, image):
    """The image processor on one image as the trainer's host path calls it for these families (its rescale and
    normalize on the device: uint8 pixel_values)."""
    return ip([image], do_rescale=False, do_normalize=False, input_data_format="channels_first", return_tensors="pt")

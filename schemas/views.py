"""A large photo's two views, for the tiling processors that resize their global view from the source itself
(Llama 4's global tile, InternVL's thumbnail): the processor's first resize of the source, the canvas A it tiles, and
its global view B. A loader that holds both makes the processor's exact pixel_values without decoding the source:
the processor runs on A (its resize of A to the canvas is a no-op) and its one resize of A to B's size is answered
with B. The build stores them packed in one uint8 array (pack) only where that holds bit for bit (views_of checks it
on each image); the trainer's host path (vlmprep_schemas.pixels) unpacks them.
"""

from __future__ import annotations

import contextlib
import re
import types
from dataclasses import dataclass

import numpy as np

from vlmprep_schemas import load

# The image processors (class names less Fast) whose views a build may store.
VIEW_PROCESSORS = ("Llama4ImageProcessor", "GotOcr2ImageProcessor")
# A views member's name (shard_format.schema.json views_member, format v5): the writer, every reader and the trainer.
VIEWS_MEMBER = re.compile(load("shard_format.schema.json")["$defs"]["views_member"]["pattern"])


@dataclass(frozen=True)
class Packed:
    """A stored image that is a large photo's views (pack's array, uint8 H x W x 3, and the two sizes it packs): what
    the trainer hands vlmprep_schemas.pixels.pixel_inputs in that image's place."""

    pixels: object  # numpy array or tensor
    canvas: tuple[int, int]
    glob: tuple[int, int]


def views_member(image_member: str) -> str:
    """The views member of kept photo `image_member` (imgNNN.orig.* -> vwsNNN.delta.zst)."""
    return f"vws{image_member[3:6]}.delta.zst"


def unnamed_views(images: list[dict], names) -> list[str]:
    """The views members among `names` that no entry of a sample's meta `images` names (sorted)."""
    named = {im["views"]["member"] for im in images if im.get("views")}
    return sorted(n for n in names if VIEWS_MEMBER.match(n) and n not in named)


def has_views(kind: str) -> bool:
    """Whether image processor class `kind` (a saved config's image_processor_type) is one of VIEW_PROCESSORS."""
    return kind.removesuffix("Fast") in VIEW_PROCESSORS


def packed_height(canvas: tuple[int, int], glob: tuple[int, int]) -> int:
    """Rows of pack's array: A's, then B's bytes in rows of A's width (the last one zero-padded)."""
    (ha, wa), (hb, wb) = canvas, glob
    return ha + -(-(hb * wb) // wa)


def pack(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Views A and B (uint8 H x W x 3) as one uint8 array of A's width, A's rows first: one stored image, which every
    layer of the loader (slabs, the worker transport, collate) carries as it carries any other."""
    ha, wa = a.shape[:2]
    out = np.zeros((packed_height((ha, wa), b.shape[:2]), wa, 3), dtype=np.uint8)
    out[:ha] = a
    out.reshape(-1)[ha * wa * 3 : ha * wa * 3 + b.size] = b.reshape(-1)
    return out


def unpack(packed: np.ndarray, canvas: tuple[int, int], glob: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """pack's array -> A and B, views of it (no copy). ValueError where its shape is not the one pack makes."""
    (ha, wa), (hb, wb) = canvas, glob
    if packed.shape != (packed_height(canvas, glob), wa, 3) or packed.dtype != np.uint8:
        raise ValueError(f"views {packed.dtype} {packed.shape} are not a {ha}x{wa} canvas and a {hb}x{wb} global view")
    flat = packed.reshape(-1)
    return packed[:ha], flat[ha * wa * 3 : ha * wa * 3 + hb * wb * 3].reshape(hb, wb, 3)


def _hook(ip) -> None:
    """Install, once, the resize that records (`ip._views_log`) or answers (`ip._views_answer`) on the instance."""
    if "_views_hooked" in vars(ip):
        return
    cls_resize = type(ip).resize

    def resize(self, image, size, *args, **kwargs):
        answer = vars(self).get("_views_answer")
        if answer is not None:
            a_size, b = answer
            want = (int(size.height), int(size.width))
            if tuple(image.shape[-2:]) == a_size and want == tuple(b.shape[-2:]) and want != a_size:
                return b.expand(image.shape[0], *b.shape) if image.dim() == 4 else b
        out = cls_resize(self, image, size, *args, **kwargs)
        log = vars(self).get("_views_log")
        if log is not None:
            log.append((tuple(image.shape[-2:]), out))
        return out

    ip.resize = types.MethodType(resize, ip)
    ip._views_hooked = True


@contextlib.contextmanager
def _set(ip, name: str, value):
    setattr(ip, name, value)
    try:
        yield
    finally:
        setattr(ip, name, None)


def answered(ip, a, b):
    """Within this, `ip` (a torchvision-backend VIEW_PROCESSORS instance) answers its resize of an image of A's size
    to B's size with B (C x H x W uint8 tensors, A's a view of the stored pixels)."""
    _hook(ip)
    return _set(ip, "_views_answer", (tuple(a.shape[-2:]), b))


def views_of(ip, src, call) -> tuple[np.ndarray, np.ndarray] | None:
    """The views of source `src` (C x H x W uint8 tensor) under image processor `ip`: (A, B) as uint8 H x W x 3 where
    `call(ip, image)` (the processor on one image, its rescale and normalize off) gives bit for bit the same outputs
    from A with B answered as from the source, and A has fewer pixels than the source; else None."""
    import torch

    _hook(ip)
    log: list = []
    with _set(ip, "_views_log", log):
        want = call(ip, src)
    own = [out for size, out in log if size == tuple(src.shape[-2:])]
    if len(own) < 2:  # no global view (one tile), or a processor that resized otherwise
        return None
    a, b = (o[0] if o.dim() == 4 else o for o in (own[0], own[-1]))
    if a.shape[-2] * a.shape[-1] >= src.shape[-2] * src.shape[-1] or a.shape == b.shape:
        return None
    a_hwc, b_hwc = (np.ascontiguousarray(t.permute(1, 2, 0).numpy()) for t in (a, b))
    av, bv = (torch.from_numpy(x).permute(2, 0, 1) for x in (a_hwc, b_hwc))  # as the loader hands them over
    with answered(ip, av, bv):
        got = call(ip, av)
    same = set(got) == set(want) and all(_equal(got[k], want[k]) for k in want)
    return (a_hwc, b_hwc) if same else None


def _equal(x, y) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_equal(p, q) for p, q in zip(x, y))
    return x == y

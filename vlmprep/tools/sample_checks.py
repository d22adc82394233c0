"""verify's checks of a sample's parts that stand alone, each fault one line: the sources a build stored as their
bytes (`orig.*` members, `--image-format auto`) hash to the sha256 their meta gives, so a corrupt or replaced photo is
named, never decoded as if it were the one the build read; each image's token span is whole, untrained and in order.
"""

from __future__ import annotations

import hashlib

import numpy as np

from vlmprep.shards.manifest import ShardFormatError
from vlmprep.shards.reader import StoredSample
from vlmprep.types import RecordError


def source_problems(s: StoredSample, meta: dict) -> dict[str, str]:
    """Each source stored as it is (an `orig.*` member) whose meta gives its sha256: its bytes hash to it, else
    {member: the one-line fault} (a corrupt or replaced source, never decoded)."""
    want: dict[str, set[str]] = {}
    for im in meta["images"]:
        if "sha256" in im:
            want.setdefault(im["member"], set()).add(im["sha256"])
    out = {}
    for name, digests in sorted(want.items()):
        if ".orig." not in name or len(digests) > 1:
            out[name] = (
                f"{name}: the meta gives it sha256 {' and '.join(sorted(digests))} (only one, of an orig.* member)"
            )
            continue
        try:
            got = hashlib.sha256(s.read(name)).hexdigest()
        except ShardFormatError as e:
            out[name] = str(e).split(": ", 2)[-1]
            continue
        if got != next(iter(digests)):
            out[name] = (
                f"{name}: its bytes' sha256 {got[:16]}... is not the meta's {next(iter(digests))[:16]}...: "
                "a corrupt or replaced source image"
            )
    return out


def views_problems(s: StoredSample, meta: dict, image_processor, *, max_pixels: int) -> list[str]:
    """Each kept photo's views (its meta's `views`, format v5): the member decodes to the packed array of its
    canvas and global view, equal to the views the dataset's image processor makes from its source (a build stores
    them only where the processor's output from them is exact, so they are the processor's own), else one line."""
    from vlmprep.pixels import source_views
    from vlmprep.shards.decode import DECODE_ERRORS, decode_stored_image
    from vlmprep_schemas.views import packed_height

    out, seen = [], set()
    for im in meta["images"]:
        views = im.get("views")
        if views is None or im["member"] in seen:
            continue
        seen.add(im["member"])
        name, (ha, wa), glob = views["member"], views["canvas"], views["global"]
        try:
            packed = decode_stored_image(name, s.read(name), (packed_height((ha, wa), glob), wa))
            want = source_views(image_processor, s.read(im["member"]), max_pixels=max_pixels)
        except (*DECODE_ERRORS, ShardFormatError, RecordError) as e:
            out.append(f"{name}: {str(e).split(': ', 2)[-1]}")
            continue
        if (
            want is None
            or want.canvas != (ha, wa)
            or want.glob != tuple(glob)
            or not np.array_equal(packed, want.packed)
        ):
            out.append(
                f"{name}: not the views {im['member']}'s image processor makes from it (a canvas of {ha}x{wa} and a "
                f"global view of {glob[0]}x{glob[1]}): the trainer would train on other pixels than the processor's"
            )
    return out


def span_problems(meta: dict, mm: np.ndarray, mask: np.ndarray) -> list[str]:
    """Each image's span (its whole unit in the tokens, where the meta records it): in order, inside the sample, never
    trained, holding every token marked image; num_image_tokens their sum (older datasets: the marked tokens)."""
    spans = [im.get("span") for im in meta["images"]]
    if not spans or any(sp is None for sp in spans):
        want = int((mm == 1).sum())
        return (
            []
            if meta["num_image_tokens"] == want or spans
            else [f"meta num_image_tokens={meta['num_image_tokens']}, the arrays mark {want}"]
        )
    out, inside, end = [], np.zeros(len(mm), dtype=bool), 0
    for k, (a, b) in enumerate(spans):
        if not end <= a < b <= len(mm):
            return [f"image {k}: span [{a}, {b}) is not after the previous one inside the {len(mm)} tokens"]
        inside[a:b], end = True, b
    if mask[inside].any():
        out.append("loss_mask trains tokens of an image's span")
    if ((mm == 1) & ~inside).any():
        out.append("tokens marked image outside every image's span")
    if meta["num_image_tokens"] != int(inside.sum()):
        out.append(f"meta num_image_tokens={meta['num_image_tokens']}, the images' spans hold {int(inside.sum())}")
    return out

"""verify's check of the sources a build stored as their bytes (`orig.*` members, `--image-format auto`): each one's
bytes hash to the sha256 its meta gives, so a corrupt or replaced photo is named, never decoded as if it were the one
the build read.
"""

from __future__ import annotations

import hashlib

from vlmprep.shards.manifest import ShardFormatError
from vlmprep.shards.reader import StoredSample


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

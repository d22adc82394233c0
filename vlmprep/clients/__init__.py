"""Zero-glue readers of vlmprep datasets for other libraries: `wds` (webdataset), `hf` (HF datasets), `energon`
(Megatron-Energon; `energon_meta` writes its dataset.yaml at build time). Each imports its library itself, so
`import vlmprep` never needs them.
"""

from vlmprep.shards.format import is_views_member


def sample_version(members) -> int:
    """A sample's format version from its member names (v2 added image_index.npy, v3 video_grid_thw.npy, v4
    .pdelta.zst images, v5 views members): a tar stream has no manifest."""
    if "video_grid_thw.npy" in members:
        if any(is_views_member(str(n)) for n in members):
            return 5
        return 4 if any(str(n).endswith(".pdelta.zst") for n in members) else 3
    return 2 if "image_index.npy" in members else 1

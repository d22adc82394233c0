"""Zero-glue readers of vlmprep datasets for other libraries: `wds` (webdataset), `hf` (HF datasets), `energon`
(Megatron-Energon; `energon_meta` writes its dataset.yaml at build time). Each imports its library itself, so
`import vlmprep` never needs them.
"""


def sample_version(members) -> int:
    """A sample's format version from its member names (v2 added image_index.npy, v3 video_grid_thw.npy): a tar
    stream has no manifest."""
    return 3 if "video_grid_thw.npy" in members else 2 if "image_index.npy" in members else 1

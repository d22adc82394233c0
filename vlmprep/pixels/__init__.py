"""Pixels: an image's or a video's bytes -> decoded, oriented and resized as the model's processor does, and
the stored form (README.md has the flow). The rest of vlmprep imports these names only.
"""

from vlmprep.pixels.images import (
    encode_image,
    encode_views,
    image_storage,
    make_ready,
    merged_patch,
    open_image,
    prepare_image,
    source_views,
    stored_ext,
    stored_views,
)
from vlmprep.pixels.videos import (
    DEFAULT_VIDEO_FPS,
    FRAME_EXT,
    encode_frame,
    prepare_video,
    second_per_grid_t,
    video_metadata,
)

__all__ = [
    "DEFAULT_VIDEO_FPS",
    "FRAME_EXT",
    "encode_frame",
    "encode_image",
    "encode_views",
    "image_storage",
    "make_ready",
    "merged_patch",
    "open_image",
    "prepare_image",
    "prepare_video",
    "source_views",
    "second_per_grid_t",
    "stored_ext",
    "stored_views",
    "video_metadata",
]

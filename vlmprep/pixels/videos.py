"""Videos: a video part (container bytes, or frame images) -> guarded PyAV decode -> the frames the model's own video
processor samples -> its own resize (uint8) -> PreparedVideo, and the stored frame members. Like images, the stored
frames are exactly what the processor would patchify, so the loader never samples or resizes.
"""

from __future__ import annotations

import copy
import io

import numpy as np

from vlmprep.config import default
from vlmprep.families import FamilySpec
from vlmprep.pixels.images import decode_image, encode_image
from vlmprep.types import PreparedImage, PreparedVideo, RecordError, VideoData

# Frames per second sampled when neither the part, --video-fps nor the video processor's own config names a rate:
# qwen-vl-utils' FPS, the rate the Qwen-VL models were trained at.
DEFAULT_VIDEO_FPS = 2.0
# "original": no source image, so PNG; zstd-pdelta (and auto): each frame zstd-delta on its own
FRAME_EXT = {
    "auto": "delta.zst",
    "zstd-pdelta": "delta.zst",
    "zstd-delta": "delta.zst",
    "zstd": "npy.zst",
    "png": "png",
    "webp": "webp",
    "original": "png",
}


def sampling_fps(video: VideoData, vp) -> float:
    """The part's fps, else the video processor's (where --video-fps put the build-wide one), else the default."""
    return float(video.fps or getattr(vp, "fps", None) or DEFAULT_VIDEO_FPS)


def video_size(video: VideoData, vp, family: FamilySpec, num_frames: int):
    """The processor `size` for this video: its min/max pixels, the part's own, and the part's total_pixels cap
    (Qwen2/2.5-VL bound each frame, so the cap is shared out over the frames as qwen-vl-utils does; Qwen3-VL bounds
    the whole video, so the cap bounds it directly)."""
    from transformers.image_utils import SizeDict

    shortest = video.min_pixels or vp.size.shortest_edge
    longest = video.max_pixels or vp.size.longest_edge
    if video.total_pixels:
        if family.video == "qwen3":
            longest = min(longest, video.total_pixels)
        else:
            longest = max(min(longest, video.total_pixels * vp.temporal_patch_size // num_frames), int(shortest * 1.05))
    if shortest > longest:
        raise RecordError(
            "invalid_video_option",
            f"video min_pixels {shortest} > max_pixels {longest}: lower min_pixels or raise max_pixels / total_pixels",
        )
    return SizeDict(shortest_edge=shortest, longest_edge=longest)


# FFmpeg's AVFMT_NOTIMESTAMPS: a raw elementary stream (.h264, .hevc, .m4v, ...) that stores no frame times, so its
# frame rate is a guess (the h264 demuxer says 25 whatever the stream was shot at).
_NO_TIMESTAMPS = 0x0080


def _decode_container(video: VideoData, *, max_pixels: int, min_side: int, fps: float, vp) -> tuple[np.ndarray, dict]:
    """Open with PyAV, count frames as transformers' pyav loader does (declared, else demuxed packets), sample with
    the processor's own sample_frames, and decode only up to the last sampled frame."""
    import av
    from transformers.video_utils import VideoMetadata

    where = video.origin[:60] or "data-uri"
    try:
        container = av.open(io.BytesIO(video.data), mode="r")
    except av.error.FFmpegError as e:
        raise RecordError(
            "corrupt_video",
            f"cannot open video ({where}): {_av_reason(e)}; re-encode it (e.g. "
            "ffmpeg -i IN -c:v libx264 OUT.mp4) or drop the part",
        ) from None
    with container:
        stream = _video_stream(container, where, max_pixels=max_pixels, min_side=min_side)
        w, h = stream.width, stream.height
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise RecordError("corrupt_video", f"video ({where}) declares no frame rate; re-encode it with one")
        declared = int(stream.frames or 0)
        if declared <= 0:  # containers that declare no count (WebM, MKV): count the frames' packets, no decoding
            declared = _count_packets(video.data, where)
        if declared <= 0:
            raise RecordError("video_no_frames", f"video ({where}) has no frames; drop the part")
        if declared < vp.temporal_patch_size:
            raise RecordError("video_too_short", _too_short(declared, vp))
        meta = VideoMetadata(
            total_num_frames=declared,
            fps=float(rate),
            width=w,
            height=h,
            duration=declared / float(rate),
            video_backend="pyav",
        )
        indices = [int(i) for i in _sampler(vp, fps, video.max_frames).sample_frames(meta)]
        wanted, frames, n = set(indices), {}, 0
        try:
            for frame in container.decode(stream):
                if n in wanted:
                    frames[n] = frame.to_ndarray(format="rgb24")
                n += 1
                if n > indices[-1]:
                    break
        except av.error.FFmpegError as e:
            raise RecordError(
                "corrupt_video",
                f"cannot decode video ({where}) at frame {n}: {_av_reason(e)}; re-encode it or drop the part",
            ) from None
    if n == 0:
        raise RecordError("video_no_frames", f"video ({where}) has no decodable frames; drop the part")
    if n <= indices[-1]:
        raise RecordError(
            "corrupt_video",
            f"video ({where}) is truncated: it declares {declared} frames but only "
            f"{n} decode; re-encode or re-download it",
        )
    return np.stack([frames[i] for i in indices]), {"fps": float(rate), "total": declared, "indices": indices}


def _video_stream(container, where: str, *, max_pixels: int, min_side: int):
    """The container's first video stream, once it is known to carry frame times, to have a decoder and frames of an
    allowed size; else the RecordError that says which and the fix."""
    if int(container.format.flags) & _NO_TIMESTAMPS:
        raise RecordError(
            "raw_video_stream",
            f"video ({where}) is a {container.format.long_name} stream with no "
            "container, so it stores no frame times and its frame rate is "
            "unknown; wrap it in one at its real rate, e.g. ffmpeg -framerate "
            "FPS -i IN -c copy OUT.mp4",
        )
    if not container.streams.video:
        raise RecordError("video_no_frames", f"video ({where}) holds no video stream; drop the part")
    stream = container.streams.video[0]
    codec = stream.codec_context
    if codec is None or codec.codec is None or not codec.codec.is_decoder:
        raise RecordError(
            "unsupported_video_codec",
            f"video ({where}): no decoder for its codec "
            f"{getattr(stream, 'codec_tag', '?')!r}; re-encode it to "
            "H.264, VP9 or AV1",
        )
    w, h = stream.width, stream.height
    if min(w, h) < min_side:
        raise RecordError("video_too_small", f"video frames are {w}x{h}, below min_image_side={min_side}")
    if w * h > max_pixels:
        raise RecordError(
            "video_too_large",
            f"video frames are {w}x{h} = {w * h} pixels > "
            f"max_image_pixels={max_pixels}; downscale it or raise "
            "--max-image-pixels",
        )
    return stream


def _count_packets(data: bytes, where: str) -> int:
    """The video stream's packets with data, in a container of their own: the caller's is left at its start (a seek
    back is not possible in every container)."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as c:
            return sum(1 for p in c.demux(c.streams.video[0]) if p.size)
    except av.error.FFmpegError as e:
        raise RecordError(
            "corrupt_video", f"cannot read video ({where}): {_av_reason(e)}; re-encode it or drop the part"
        ) from None


def _av_reason(e: Exception) -> str:
    return (getattr(e, "strerror", None) or str(e))[:120]


def _too_short(n: int, vp) -> str:
    return (
        f"video has {n} frame{'s' if n != 1 else ''}, fewer than the model's temporal patch of "
        f"{vp.temporal_patch_size}; give at least {vp.temporal_patch_size} frames or send it as an image"
    )


def _sampler(vp, fps: float, max_frames: int | None):
    """The video processor itself, with this video's fps and max_frames as its own settings: its sample_frames
    reads them from self (Qwen3-VL's ignores a max_frames argument), exactly as a processor configured so would."""
    s = copy.copy(vp)
    s.fps = fps
    s.num_frames = None
    if max_frames:
        s.max_frames = max_frames
    return s


def _frames_list(video: VideoData, *, max_pixels: int, min_side: int, vp) -> np.ndarray:
    """A video given as frame images: decoded as images are, made RGB as the processor does, used as given (the
    processor refuses to resample a frame list; qwen-vl-utils does not resample one either)."""
    import torch

    if len(video.frames) < vp.temporal_patch_size:
        raise RecordError("video_too_short", _too_short(len(video.frames), vp))
    out = []
    with torch.no_grad():
        for k, im in enumerate(video.frames):
            try:
                pil = decode_image(im, max_pixels=max_pixels, min_side=min_side)
            except RecordError as e:
                if e.reason != "image_too_small":
                    raise
                raise RecordError("video_too_small", f"video frame {k}: {e.message}") from None
            # Made RGB as the processor makes an image RGB (alpha laid on white, palette, gray, CMYK converted), one
            # frame at a time, so a list may mix modes.
            out.append(vp.process_image(pil, do_convert_rgb=True))
    shapes = {tuple(t.shape) for t in out}
    if len(shapes) > 1:
        raise RecordError(
            "video_frame_size_mismatch",
            f"the video's frames differ in size ({len(shapes)} sizes: "
            f"{sorted(shapes)[:2]} ...); resize them to one size",
        )
    return torch.stack(out).permute(0, 2, 3, 1).numpy()


def prepare_video(
    video: VideoData,
    processor,
    family: FamilySpec,
    *,
    max_pixels: int,
    min_side: int = 1,
    max_tokens: int | None = None,
) -> PreparedVideo:
    """Sample and resize with the processor's own code (sample_frames, resize with its video budget); uint8."""
    import torch

    vp = processor.video_processor
    fps = sampling_fps(video, vp)
    if video.data is not None:
        frames, timing = _decode_container(video, max_pixels=max_pixels, min_side=min_side, fps=fps, vp=vp)
    else:
        frames = _frames_list(video, max_pixels=max_pixels, min_side=min_side, vp=vp)
        timing = {"fps": fps, "total": len(frames), "indices": list(range(len(frames)))}
    t = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    size = video_size(video, vp, family, len(frames))
    with torch.no_grad():
        try:
            resized = vp.resize(
                t[None],
                size=size,
                resample=vp.resample,
                factor=vp.patch_size * vp.merge_size,
                temporal_factor=vp.temporal_patch_size,
                cap_pixels_per_frame=bool(getattr(vp, "cap_pixels_per_frame", None)),
            )[0]
        except ValueError as e:  # smart_resize refuses aspect ratios over 200
            raise RecordError("bad_aspect_ratio", f"video {frames.shape[2]}x{frames.shape[1]}: {e}") from None
    assert resized.dtype == torch.uint8, "processor resize must keep uint8 so stored frames are exact"
    stored = np.ascontiguousarray(resized.permute(0, 2, 3, 1).numpy())
    tp = vp.temporal_patch_size
    grid = (-(-len(stored) // tp), stored.shape[1] // vp.patch_size, stored.shape[2] // vp.patch_size)
    tokens = grid[0] * grid[1] * grid[2] // vp.merge_size**2
    if max_tokens is not None and tokens > max_tokens:
        raise RecordError(
            "video_too_long",
            f"video of {len(stored)} sampled frames takes {tokens} tokens > --seq-len "
            f"{max_tokens} even alone; lower its fps / max_frames / max_pixels "
            "(or --video-fps / --video-max-frames), or raise --seq-len",
        )
    return PreparedVideo(
        frames=stored,
        grid_thw=grid,
        fps=timing["fps"],
        total_num_frames=timing["total"],
        frame_indices=timing["indices"],
        source=video,
    )


def video_metadata(video: PreparedVideo):
    """The processor's VideoMetadata of a prepared video: what its replace_video_token and fps math read."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=video.total_num_frames,
        fps=video.fps,
        height=int(video.frames.shape[1]),
        width=int(video.frames.shape[2]),
        frames_indices=list(video.frame_indices),
    )


def second_per_grid_t(video: PreparedVideo, vp) -> float:
    """Seconds per temporal patch, as Qwen2_5_VLProcessor computes it (temporal patch / sampled fps)."""
    return vp.temporal_patch_size / video_metadata(video).sampled_fps


def encode_frame(frame: np.ndarray, image_format: str, *, zstd_level: int = default("zstd_level")) -> bytes:
    """One stored frame, lossless as an image of the same format ("original" has no source image: PNG; zstd-pdelta's
    frames, and auto's, are zstd-delta, each on its own)."""
    fmt = {"original": "png", "zstd-pdelta": "zstd-delta", "auto": "zstd-delta"}.get(image_format, image_format)
    return encode_image(
        PreparedImage(pixels=frame, grid_thw=(1, 1, 1), source=None, digest=""), fmt, zstd_level=zstd_level
    )

"""Small test videos made with PyAV: moving colour patterns, so every frame differs and a wrong frame shows."""

from __future__ import annotations

import io

import numpy as np


def frames(n: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """n distinct RGB frames (uint8 n x H x W x 3): a gradient that shifts each frame, plus a moving square."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 255, size=3)
    y, x = np.mgrid[0:height, 0:width]
    out = np.empty((n, height, width, 3), dtype=np.uint8)
    for i in range(n):
        out[i, ..., 0] = (x * 255 // max(width - 1, 1) + 9 * i + base[0]) % 256
        out[i, ..., 1] = (y * 255 // max(height - 1, 1) + 5 * i + base[1]) % 256
        out[i, ..., 2] = (base[2] + 17 * i) % 256
        s = max(2, min(width, height) // 4)
        ox, oy = (3 * i) % max(width - s, 1), (2 * i) % max(height - s, 1)
        out[i, oy : oy + s, ox : ox + s] = 255 - out[i, oy : oy + s, ox : ox + s]
    return out


def encode(video: np.ndarray, fps: int | float, *, codec: str = "mpeg4", fmt: str = "mp4") -> bytes:
    """The frames as a video file. codec "ffv1" in "matroska" is lossless (RGB kept exactly, as bgr0)."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        s = c.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        s.width, s.height = video.shape[2], video.shape[1]
        s.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        if codec == "mpeg4":
            s.options = {"qscale": "2"}
        for f in video:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def decode_all(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame as PyAV decodes it (rgb24), and the stream's average rate: the reference input for the processor."""
    import av

    with av.open(io.BytesIO(data)) as c:
        st = c.streams.video[0]
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(st)]), float(st.average_rate)

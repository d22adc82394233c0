"""A .zst input's bytes -> its decompressed bytes, frame by frame (records.py reads its lines): a truncated last
frame or a corrupt one is reported with the byte and frame where it happened, after everything decoded before it,
and the frame starts are recorded where a task plan may seek into the file.
"""

from __future__ import annotations

import io

import zstandard

_CHUNK = 1 << 20


class ZstdStream(io.RawIOBase):
    """Streaming multi-frame zstd decoder that, unlike stream_reader, reports a truncated last frame, and on a
    fault first hands out everything decoded before it, then ends as if at EOF with `fault` set."""

    def __init__(self, raw, max_window_size: int, frames: list | None = None, at: tuple[int, int] = (0, 0)):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max_window_size)
        self._dobj = self._dctx.decompressobj()
        self._buf = b""
        self._off = 0
        self._in_frame = False
        # Frame starts as (compressed offset, decompressed offset): where a task plan may seek into this file.
        self._cin, self._dout = at
        self._frame_start = self._cin
        self._frames = frames
        if frames is not None:
            frames.append(at)
        self.fault: tuple[zstandard.ZstdError, int, int] | None = None  # (error, fault byte, its frame's start)

    def readable(self):
        """Always: io.BufferedReader reads through readinto."""
        return True

    def readinto(self, b):
        """Fill `b` with decompressed bytes; 0 at the end, or at a fault (then `fault` says where)."""
        while self._off >= len(self._buf):
            self._buf, self._off = b"", 0
            if self.fault is not None:
                return 0
            # Reads end on absolute MiB boundaries, so a task that seeks to a frame feeds the decoder the same
            # pieces as a read from the file start, and a fault lands at the same byte with the same message.
            chunk = self._raw.read(_CHUNK - self._cin % _CHUNK)
            if not chunk:
                if self._in_frame:
                    self.fault = (
                        zstandard.ZstdError("the file ends inside a zstd frame (cut off)"),
                        self._cin,
                        self._frame_start,
                    )
                return 0
            while chunk:
                if not self._in_frame:
                    self._in_frame, self._frame_start = True, self._cin
                try:
                    out = self._dobj.decompress(chunk)
                except zstandard.ZstdError as e:
                    self.fault = (e, self._cin, self._frame_start)  # this piece's output is lost with it
                    break
                self._cin += len(chunk)
                self._buf += out
                self._dout += len(out)
                if self._dobj.eof:  # frame done; any rest starts the next frame
                    chunk = self._dobj.unused_data
                    self._cin -= len(chunk)
                    self._dobj = self._dctx.decompressobj()
                    self._in_frame = False
                    if self._frames is not None and chunk:
                        self._frames.append((self._cin, self._dout))
                else:
                    chunk = b""
        return self._hand_out(b)

    def _hand_out(self, b):
        n = min(len(b), len(self._buf) - self._off)
        b[:n] = self._buf[self._off : self._off + n]
        self._off += n
        return n

    def close(self):
        """Close the compressed file too."""
        self._raw.close()
        super().close()

"""A record's image or video reference -> its bytes: a table's image cell, a base64 data URI, a local path that
resolves inside --image-root (a regular file, its size bounded before and while it is read), or an http(s) URL with
--allow-remote (images only, bounded). Every fault is a RecordError naming the reference.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass

import vlmprep.ingest.web as web
from vlmprep.types import ImageData, RecordError

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)


@dataclass(frozen=True)
class MediaFetcher:
    """Where one record's media may come from: its input file's dir (None: an input read from a store), the root
    local paths must resolve inside, whether http(s) images may be fetched, and the most bytes of each kind."""

    base_dir: str | None  # None: an input read from a store
    root: str | None
    allow_remote: bool
    max_bytes: dict[str, int]  # "image" / "video" -> the most bytes a file of that kind may have (it is read whole)

    def fetch(self, ref, where: str, kind: str = "image") -> ImageData:
        """An image's (or, kind="video", a video file's) bytes. Videos are local or data URIs only: never fetched
        remotely, whatever --allow-remote says (a video is too large to fetch per record)."""
        if isinstance(ref, (bytes, bytearray)):  # a table's image cell (tables.py): the bytes themselves
            if len(ref) > self.max_bytes[kind]:
                raise RecordError(
                    f"{kind}_file_too_large",
                    f"{where}: {kind} of {len(ref)} bytes > --max-{kind}-bytes {self.max_bytes[kind]}",
                )
            return ImageData(data=bytes(ref), origin="table cell")
        if not isinstance(ref, str) or not ref.strip():
            raise RecordError(f"invalid_{kind}_ref", f"{where}: {kind} reference must be a non-empty string")
        ref = ref.strip()
        m = _DATA_URI.match(ref)
        if m:
            if not m.group("b64"):
                raise RecordError("invalid_data_uri", f"{where}: only base64 data URIs are supported")
            return ImageData(data=decode_base64(ref[m.end() :], f"{where}: data URI"), origin="data-uri")
        low = ref.lower()
        if low.startswith(("http://", "https://")):
            if kind == "video":
                raise RecordError(
                    "remote_video_refused",
                    f"{where}: remote video {web.show(ref)[:80]} refused: videos are "
                    "read from local paths or data URIs; download it first",
                )
            if not self.allow_remote:
                raise RecordError(
                    "remote_image_refused", f"{where}: remote image {web.show(ref)[:80]} refused (pass --allow-remote)"
                )
            return ImageData(data=_fetch_remote(ref, where, self.max_bytes["image"]), origin=ref)
        if low.startswith("file://"):
            ref = urllib.parse.unquote(ref[len("file://") :])  # a URL: with%20space.png; the root check still follows
        elif re.match(r"^[a-z][a-z0-9+.-]*://", low):
            raise RecordError(f"unsupported_{kind}_url", f"{where}: unsupported URL scheme in {web.show(ref)[:80]}")
        if "\x00" in ref:
            raise RecordError(f"invalid_{kind}_ref", f"{where}: {kind} path holds a NUL character")
        if self.root is None or (self.base_dir is None and not os.path.isabs(ref)):
            raise RecordError(
                "path_outside_root",
                f"{where}: {kind} path {ref[:120]} in an input read from a store: "
                "a store's input names local files only by absolute paths under "
                "--image-root (or carries them inline)",
            )
        path = ref if os.path.isabs(ref) else os.path.join(self.base_dir, ref)
        what = f"{where}: {kind} {ref[:120]}"
        pinned = _pin(path)
        if pinned is not None:  # the kernel resolved it once: the file checked is the file read
            fd, real = pinned
            try:
                self._check_inside(real, ref, where, kind)
                return ImageData(data=_read_local(f"/proc/self/fd/{fd}", kind, self.max_bytes[kind], what), origin=ref)
            finally:
                os.close(fd)
        real = os.path.realpath(path)  # resolves symlinks, so a link cannot escape the root
        self._check_inside(real, ref, where, kind)
        return ImageData(data=_read_local(real, kind, self.max_bytes[kind], what), origin=ref)

    def _check_inside(self, real: str, ref: str, where: str, kind: str) -> None:
        if os.path.commonpath([real, self.root]) != self.root:
            raise RecordError(
                "path_outside_root", f"{where}: {kind} path {ref[:120]} resolves outside the allowed root {self.root}"
            )


_O_PATH = getattr(os, "O_PATH", None)


def _pin(path: str) -> tuple[int, str] | None:
    """`path` opened with O_PATH (Linux: resolved by the kernel, no device or FIFO opened, nothing read) and the real
    path of what it names, read back from /proc/self/fd; reading through that fd then reads that same file, so a link
    swapped in after the root check cannot redirect the read. None where the system cannot (no O_PATH or /proc) or the
    path does not open (missing, a loop): the realpath route then gives the same reject as ever."""
    if _O_PATH is None:
        return None
    try:
        fd = os.open(path, _O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        return None
    if not real.startswith("/") or real.endswith(" (deleted)"):  # not a path (or gone): decide the old way
        os.close(fd)
        return None
    return fd, real


def _read_local(path: str, kind: str, limit: int, what: str) -> bytes:
    """A local image or video file, read whole: only a regular file (a device or FIFO never ends) of at most
    `limit` bytes (--max-image-bytes / --max-video-bytes), checked before reading and while reading."""
    try:  # O_NONBLOCK: a FIFO opens without waiting for a writer (and is then refused)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise RecordError(f"{kind}_not_found", f"{what}: file not found") from None
    except OSError as e:
        raise RecordError(f"{kind}_unreadable", f"{what}: cannot read it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RecordError(
                f"{kind}_unreadable",
                f"{what}: not a regular file (a directory, device, FIFO or socket); name the file itself",
            )
        if st.st_size > limit:
            raise RecordError(f"{kind}_file_too_large", f"{what}: {st.st_size} bytes > --max-{kind}-bytes {limit}")
        f = open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        try:
            # Its size first: a read of limit + 1 bytes allocates all of them (64 MB an image, ~50 us); a file that
            # grew since its fstat is read on up to the limit, as before.
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:
                data += f.read(limit + 1 - len(data))
        except OSError as e:
            raise RecordError(f"{kind}_unreadable", f"{what}: cannot read it: {e.strerror or e}") from None
    if len(data) > limit:  # grew while read
        raise RecordError(f"{kind}_file_too_large", f"{what}: more than --max-{kind}-bytes {limit} bytes")
    return data


def _fetch_remote(url: str, where: str, limit: int) -> bytes:
    """An http(s) image, through web.py: bounded in bytes and time, redirects to http(s) only, no URL credential."""
    try:
        return web.fetch(url, limit)
    except web.TooLarge as e:
        raise RecordError("image_file_too_large", f"{where}: remote image: {e} (--max-image-bytes)") from None
    except web.WebError as e:  # any network fault is this record's fault, not the build's
        raise RecordError("remote_fetch_failed", f"{where}: {e}") from None


def decode_base64(payload, where: str) -> bytes:
    """Base64 as transformers' load_image takes it (MIME line breaks and other whitespace ignored), but strict
    otherwise: a stray character is a reject, not silently skipped bytes."""
    if not isinstance(payload, str):
        raise RecordError("invalid_base64", f"{where}: base64 image data must be a string")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise RecordError("invalid_base64", f"{where}: image data is not valid base64") from None
    if not data:
        raise RecordError("invalid_base64", f"{where}: image data is empty")
    return data

"""Ingest: input paths/globs -> a stream of RawRecord (one per line), in stable input order.
Streams .jsonl and .jsonl.zst in constant memory (never decompresses to disk); .json arrays load whole.
"""
from __future__ import annotations

import glob
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zstandard

from vlmprep.types import RawRecord, RecordError, Source, UserError

SUFFIXES = (".jsonl", ".jsonl.zst", ".json", ".jsonl.zstd")


class InputError(UserError):
    """A user-level fault with the inputs themselves (missing file, nothing matched): one clear line."""


def expand_inputs(patterns: tuple[str, ...] | list[str]) -> list[Path]:
    """Resolve paths, globs and directories into a sorted, de-duplicated file list (order = output order)."""
    files: list[Path] = []
    for pat in patterns:
        p = Path(pat)
        if p.is_dir():
            matched = sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES))
        elif any(ch in pat for ch in "*?["):
            matched = sorted(Path(m) for m in glob.glob(pat, recursive=True) if Path(m).is_file())
        elif p.is_file():
            matched = [p]
        else:
            raise InputError(f"input not found: {pat}")
        if not matched:
            raise InputError(f"no input files matched: {pat}")
        for m in matched:
            if not m.name.endswith(SUFFIXES):
                raise InputError(f"unsupported input file type: {m} (expected .jsonl, .jsonl.zst or .json)")
            if m not in files:
                files.append(m)
    return files


class _ZstdStream(io.RawIOBase):
    """Streaming multi-frame zstd decoder that, unlike stream_reader, reports a truncated last frame."""

    def __init__(self, raw, max_window_size: int, frames: list | None = None, at: tuple[int, int] = (0, 0)):
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max_window_size)
        self._dobj = self._dctx.decompressobj()
        self._buf = b""
        self._off = 0
        self._in_frame = False
        # Frame starts as (compressed offset, decompressed offset): where a task plan may seek into this file.
        self._cin, self._dout = at
        self._frames = frames
        if frames is not None:
            frames.append(at)

    def readable(self):
        return True

    def readinto(self, b):
        while self._off >= len(self._buf):
            self._buf, self._off = b"", 0
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise zstandard.ZstdError("truncated zstd stream: the last frame is incomplete")
                return 0
            while chunk:
                self._in_frame = True
                self._cin += len(chunk)
                out = self._dobj.decompress(chunk)
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
        n = min(len(b), len(self._buf) - self._off)
        b[:n] = self._buf[self._off:self._off + n]
        self._off += n
        return n

    def close(self):
        self._raw.close()
        super().close()


@dataclass(frozen=True)
class Seek:
    """Where a task starts reading inside one input file (see plan.py): the record at decompressed byte `offset`
    (item index for .json), after `line` lines, read from the zstd frame starting at compressed byte `frame`
    (decompressed byte `frame_offset`); plain files seek to `offset` directly."""

    offset: int = 0
    line: int = 0
    frame: int = 0
    frame_offset: int = 0


def _open_lines(path: Path, max_window_size: int = 1 << 27, seek: Seek = Seek(),
                frames: list | None = None) -> io.BufferedReader:
    raw = open(path, "rb")
    if path.name.endswith((".zst", ".zstd")):
        raw.seek(seek.frame)
        # max_window_size bounds decoder memory against a hostile frame header.
        f = io.BufferedReader(_ZstdStream(raw, max_window_size, frames, (seek.frame, seek.frame_offset)),
                              buffer_size=1 << 20)
        skip = seek.offset - seek.frame_offset
        while skip > 0:  # from the frame start to the task's first line
            n = len(f.read(min(skip, 1 << 20)))
            if n == 0:
                break
            skip -= n
        return f
    raw.seek(seek.offset)
    return io.BufferedReader(raw, buffer_size=1 << 20)


def iter_file_records(path: Path, *, start_position: int = 0, max_line_bytes: int = 256 << 20,
                      max_zstd_window: int = 1 << 27, seek: Seek = Seek(),
                      frames: list | None = None) -> Iterator[RawRecord]:
    """Yield one RawRecord per non-blank line, from `seek` on; file-level faults become a final record carrying
    the error. `frames`, when given, collects the zstd frame starts seen (the plan's seek points)."""
    name = str(path)
    pos = start_position
    if path.name.endswith(".json"):
        try:
            with open(path, "rb") as f:
                data = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            yield RawRecord(Source(name, 0), pos, error=RecordError("invalid_json_file", f"{name}: {e}"))
            return
        if isinstance(data, dict) and ("messages" in data or "conversations" in data):
            data = [data]
        if not isinstance(data, list):
            shape = (f"an object with keys {', '.join(sorted(data)[:8])}" if isinstance(data, dict)
                     else f"a JSON {type(data).__name__}")
            yield RawRecord(Source(name, 0), pos, error=RecordError(
                "invalid_json_file", f"{name}: a .json input must be an array of records or one record (an object "
                                     f"with 'messages'), not {shape}; use .jsonl for one record per line"))
            return
        if not data:
            yield RawRecord(Source(name, 0), pos, error=RecordError("empty_file", f"{name} holds no records"))
            return
        for i, item in enumerate(data[seek.offset:], start=seek.offset + 1):
            yield RawRecord(Source(name, i), pos, data=item, offset=i - 1, size=len(json.dumps(item)))
            pos += 1
        return
    lineno = seek.line
    offset = seek.offset
    try:
        with _open_lines(path, max_zstd_window, seek, frames) as f:
            while True:
                line = f.readline(max_line_bytes + 1)
                if not line:
                    break
                lineno += 1
                start, offset = offset, offset + len(line)
                if len(line) > max_line_bytes and not line.endswith(b"\n"):
                    # Skip the rest of the oversized line without holding it in memory.
                    while True:
                        chunk = f.readline(1 << 20)
                        offset += len(chunk)
                        if not chunk or chunk.endswith(b"\n"):
                            break
                    yield RawRecord(Source(name, lineno), pos, offset=start, size=offset - start,
                                    error=RecordError("line_too_long", f"line exceeds max_line_bytes={max_line_bytes}"))
                    pos += 1
                    continue
                if not line.strip():
                    continue
                yield RawRecord(Source(name, lineno), pos, text=line, offset=start, size=len(line))
                pos += 1
    except zstandard.ZstdError as e:
        msg = str(e).lower()
        reason = "zstd_window_too_large" if ("window" in msg or "too much memory" in msg) else "corrupt_zstd_stream"
        yield RawRecord(Source(name, lineno + 1), pos, offset=offset, error=RecordError(reason, f"{name}: {e}"))
        return
    except OSError as e:
        yield RawRecord(Source(name, lineno + 1), pos, offset=offset, error=RecordError("read_error", f"{name}: {e}"))
        return
    if pos == start_position and seek.offset == 0:
        yield RawRecord(Source(name, 0), pos, error=RecordError("empty_file", f"{name} holds no records"))


def iter_records(files: list[Path], *, max_line_bytes: int = 256 << 20, max_zstd_window: int = 1 << 27) -> Iterator[RawRecord]:
    pos = 0
    for path in files:
        for rec in iter_file_records(path, start_position=pos, max_line_bytes=max_line_bytes,
                                     max_zstd_window=max_zstd_window):
            pos = rec.position + 1
            yield rec


def parse_record(raw: RawRecord) -> dict:
    """Bytes -> dict; raises RecordError for anything that is not one JSON object."""
    if raw.error is not None:
        raise raw.error
    if raw.text is not None:
        try:
            text = raw.text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError("invalid_utf8", f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise RecordError("invalid_json", f"line is not valid JSON: {e}") from None
    else:
        data = raw.data
    if not isinstance(data, dict):
        raise RecordError("not_an_object", f"record is a JSON {type(data).__name__}, expected an object")
    return data


def input_dir(source: Source) -> str:
    return os.path.dirname(os.path.abspath(source.file))

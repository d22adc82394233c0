"""Ingest: input paths/globs -> a stream of RawRecord (one per line or table row), in stable input order.
Streams .jsonl and .jsonl.zst in constant memory (never decompresses to disk); .json arrays load whole; Parquet and
Arrow tables by row group (tables.py).
"""

from __future__ import annotations

import dataclasses
import glob
import io
import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vlmprep.config import default
from vlmprep.ingest.locations import Input, LocationError, RemoteFile, expand_url, is_url, open_input, size_of
from vlmprep.ingest.tables import TABLE_SUFFIXES, is_table, iter_table_records, table_record
from vlmprep.ingest.zstd_stream import ZstdStream
from vlmprep.types import RawRecord, RecordError, Source, UserError, json_nesting, json_value
from vlmprep_schemas.limits import json_depth

SUFFIXES = (".jsonl", ".jsonl.zst", ".json", ".jsonl.zstd") + TABLE_SUFFIXES


class InputError(UserError):
    """A user-level fault with the inputs themselves (missing file, nothing matched): one clear line."""


@dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """What the readers refuse in a record before a stage works on it (the build's options of the same
    names): a line's bytes, a zstd frame's window, JSON nesting, messages per record."""

    max_line_bytes: int = default("max_line_bytes")
    max_zstd_window: int = default("max_zstd_window")
    max_json_depth: int = default("max_json_depth")
    max_messages_per_record: int = default("max_messages_per_record")

    @classmethod
    def of(cls, cfg) -> ReadLimits:
        """The limits of a BuildConfig (its fields of the same names)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def expand_inputs(patterns: tuple[str, ...] | list[str]) -> list[Input]:
    """Resolve paths, globs and directories (local, or URLs of a store: locations.py) into a sorted, de-duplicated
    file list (order = output order)."""
    files: list[Input] = []
    seen: set[Input] = set()  # not `in files`: that is quadratic in the file count (minutes at 10^4 files)
    for pat in patterns:
        p = Path(pat)
        if is_url(pat):
            try:
                matched = expand_url(pat, SUFFIXES)
            except LocationError as e:
                raise InputError(str(e)) from None
        elif p.is_dir():
            matched = sorted(
                q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES) and not _hf_metadata(q)
            )
            _refuse_links_out(matched, p, pat)
        elif any(ch in pat for ch in "*?["):
            matched = sorted(Path(m) for m in glob.glob(pat, recursive=True) if Path(m).is_file())
            _refuse_links_out(matched, _glob_root(pat), pat)
        elif p.is_file():
            matched = [p]
        else:
            raise InputError(f"input not found: {pat}")
        if not matched:
            raise InputError(f"no input files matched: {pat}")
        for m in matched:
            if not m.name.endswith(SUFFIXES):
                raise InputError(
                    f"unsupported input file type: {m} (expected .jsonl, .jsonl.zst, .json, .parquet or .arrow)"
                )
            if m not in seen:
                seen.add(m)
                files.append(m)
    return files


def _glob_root(pattern: str) -> Path:
    """The dir a glob's matches stay in: its path up to the first part with a wildcard."""
    fixed = list(itertools.takewhile(lambda part: not any(ch in part for ch in "*?["), Path(pattern).parts))
    return Path(*fixed) if fixed else Path(".")


def _refuse_links_out(files: list[Path], root: Path, given: str) -> None:
    """The files found in an --in dir (or glob) resolve inside it: a downloaded dataset's data file (a `save_to_disk`
    .arrow) linking out would build what it points at into the shards. A file given as an --in is the user's own."""
    real_root = os.path.realpath(root)
    for f in files:
        real = os.path.realpath(f)
        if os.path.commonpath([real, real_root]) != real_root:
            raise InputError(
                f"{f}: a symlink to {real}, outside --in {given}; not read. Copy the file in or give it as an --in of "
                "its own (a Hugging Face cache snapshot links every file into blobs/: download with --local-dir DIR)"
            )


# The JSON beside the Arrow files of a `datasets` save_to_disk dir (a Dataset's, or each split's of a DatasetDict).
_HF_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")


def _hf_metadata(q: Path) -> bool:
    return q.name in _HF_METADATA and any((q.parent / n).is_file() for n in ("state.json", "dataset_dict.json"))


@dataclass(frozen=True)
class Seek:
    """Where a task starts reading inside one input file (see plan.py): the record at decompressed byte `offset`
    (item index for .json), after `line` lines, read from the zstd frame starting at compressed byte `frame`
    (decompressed byte `frame_offset`); plain files seek to `offset` directly."""

    offset: int = 0
    line: int = 0
    frame: int = 0
    frame_offset: int = 0


def _open_lines(
    path: Input, max_window_size: int, seek: Seek = Seek(), frames: list | None = None
) -> io.BufferedReader:
    raw = open_input(path)
    if path.name.endswith((".zst", ".zstd")):
        raw.seek(seek.frame)
        # max_window_size bounds decoder memory against a hostile frame header.
        f = io.BufferedReader(
            ZstdStream(raw, max_window_size, frames, (seek.frame, seek.frame_offset)), buffer_size=1 << 20
        )
        skip = seek.offset - seek.frame_offset
        while skip > 0:  # from the frame start to the task's first line
            n = len(f.read(min(skip, 1 << 20)))
            if n == 0:
                break
            skip -= n
        return f
    raw.seek(seek.offset)
    return io.BufferedReader(raw, buffer_size=1 << 20)


def iter_file_records(
    path: Input,
    *,
    start_position: int = 0,
    limits: ReadLimits = ReadLimits(),
    seek: Seek = Seek(),
    frames: list | None = None,
    input_name: str = "",
    scan: bool = False,
) -> Iterator[RawRecord]:
    """Yield one RawRecord per non-blank line (table row), from `seek` on; a file-level fault becomes a final record
    carrying the error, after every line read before it. `frames`, when given, collects the zstd frame starts seen
    (the plan's seek points); `input_name` is the input's name for generated ids (see input_names); `scan`: the
    plan's pass, where a table's rows need no data."""
    name = str(path)
    pos = start_position
    if is_table(path):
        most = limits.max_messages_per_record
        yield from iter_table_records(
            path, start_position=pos, first_row=seek.offset, input_name=input_name, scan=scan, max_messages=most
        )
        return
    if path.name.endswith(".json"):
        yield from _json_file_records(path, pos, seek.offset, input_name)
        return
    lineno = seek.line
    offset = seek.offset
    fault = None
    try:
        with _open_lines(path, limits.max_zstd_window, seek, frames) as f:
            while True:
                line = f.readline(limits.max_line_bytes + 1)
                if not line:
                    break
                lineno += 1
                start, offset = offset, offset + len(line)
                if len(line) > limits.max_line_bytes and not line.endswith(b"\n"):
                    # Skip the rest of the oversized line without holding it in memory.
                    while True:
                        chunk = f.readline(1 << 20)
                        offset += len(chunk)
                        if not chunk or chunk.endswith(b"\n"):
                            break
                    yield RawRecord(
                        Source(name, lineno, input_name),
                        pos,
                        offset=start,
                        size=offset - start,
                        error=RecordError("line_too_long", f"line exceeds max_line_bytes={limits.max_line_bytes}"),
                    )
                    pos += 1
                    continue
                text = line[len(_BOM) :] if start == 0 and line.startswith(_BOM) else line  # as .json reads it
                if not text.strip():
                    continue
                yield RawRecord(Source(name, lineno, input_name), pos, text=text, offset=start, size=len(line))
                pos += 1
            fault = getattr(f.raw, "fault", None)
    except OSError as e:
        plain = not path.name.endswith((".zst", ".zstd"))  # a .zst's offsets are decompressed: not file bytes
        yield RawRecord(
            Source(name, lineno + 1, input_name),
            pos,
            offset=offset,
            error=RecordError("read_error", f"{name}: {e}"),
            unread_bytes=size_of(path) - offset if plain else 0,
        )
        return
    if fault is not None:
        yield _zstd_fault(path, fault, Source(name, lineno + 1, input_name), pos, offset)
        return
    if pos == start_position and seek.offset == 0:
        yield RawRecord(Source(name, 0, input_name), pos, error=RecordError("empty_file", f"{name} holds no records"))


def _json_file_records(path: Input, pos: int, first: int, input_name: str) -> Iterator[RawRecord]:
    """A .json input (an array of records, or one record) read whole -> a RawRecord per record from the `first`-th
    (0-based) on, numbered from `pos`; a file that is not one, or nests too deep to parse at all, is a single record
    carrying the error (a record nesting deeper than --max-json-depth is rejected alone, by parse_record)."""
    name = str(path)
    try:
        with open_input(path) as f:
            text = f.read()
        data = json.loads(text)  # a UTF-8 BOM is fine here: json detects it
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        error = RecordError("invalid_json_file", f"{name}: {e}")
        if isinstance(e, RecursionError):
            error = RecordError("json_too_deep", f"{name}: nests {json_depth(text, 0)} levels deep, too deep to parse")
        yield RawRecord(Source(name, 0, input_name), pos, error=error, unread_bytes=size_of(path))
        return
    if isinstance(data, dict) and ("messages" in data or "conversations" in data):
        data = [data]
    if not isinstance(data, list):
        shape = (
            f"an object with keys {', '.join(sorted(data)[:8])}"
            if isinstance(data, dict)
            else f"a JSON {type(data).__name__}"
        )
        yield RawRecord(
            Source(name, 0, input_name),
            pos,
            error=RecordError(
                "invalid_json_file",
                f"{name}: a .json input must be an array of records or one record (an object "
                f"with 'messages'), not {shape}; use .jsonl for one record per line",
            ),
        )
        return
    if not data:
        yield RawRecord(Source(name, 0, input_name), pos, error=RecordError("empty_file", f"{name} holds no records"))
        return
    for i, item in enumerate(data[first:], start=first + 1):
        try:  # the plan's weight of the record; one nested past Python's stack is rejected by parse_record anyway
            size = len(json.dumps(item))
        except RecursionError:
            size = 1
        yield RawRecord(Source(name, i, input_name), pos, data=item, offset=i - 1, size=size)
        pos += 1


_BOM = b"\xef\xbb\xbf"


def _zstd_fault(path: Path, fault: tuple, source: Source, position: int, offset: int) -> RawRecord:
    """The record after the last line a .zst gave before its fault: names the byte (and frame) where decoding
    stopped and counts the bytes from there on as unread."""
    e, at, frame = fault
    size = size_of(path)
    if at >= size:
        message = (
            f"{path}: the file ends inside the zstd frame that starts at byte {frame} (cut off); the lines "
            "before the cut were kept"
        )
    else:
        message = (
            f"{path}: {e} at byte {at} of {size} (zstd frame from byte {frame}); the lines before it were "
            f"kept, the {size - at} bytes from there on were not read"
        )
    low = str(e).lower()
    reason = "zstd_window_too_large" if ("window" in low or "too much memory" in low) else "corrupt_zstd_stream"
    if reason == "zstd_window_too_large":
        message += " (raise --max-zstd-window if the file is trusted)"
    return RawRecord(
        source, position, offset=offset, error=RecordError(reason, message), unread_bytes=max(size - at, 0)
    )


def input_names(files: list[Input]) -> list[str]:
    """Each input's path relative to the inputs' common parent directory (one input: its file name; a URL's are
    relative among the URLs, each store's path after its scheme). Distinct files get distinct names, the same inputs
    the same names; generated ids are built from them (normalize.py). Kept printable: a file name that is not UTF-8
    shows its bytes as \\x escapes."""
    names: dict[int, str] = {}
    for remote in (False, True):
        idx = [i for i, f in enumerate(files) if isinstance(f, RemoteFile) == remote]
        paths = ["/" + str(files[i]).split("://", 1)[1] if remote else os.path.abspath(files[i]) for i in idx]
        root = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else ""
        for i, p in zip(idx, paths):
            names[i] = os.path.relpath(p, root).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return [names[i] for i in range(len(files))]


def iter_records(files: list[Input], *, limits: ReadLimits = ReadLimits()) -> Iterator[RawRecord]:
    """Input files in order -> their raw records (RawRecord: each line's bytes unparsed, a .json array's items, or a
    file-level fault in a record's place), numbered by one position across all files; each file read in a stream
    (zstd, line-size and window limits), so no input is ever held whole in memory."""
    pos = 0
    for path, name in zip(files, input_names(files)):
        for rec in iter_file_records(path, start_position=pos, limits=limits, input_name=name):
            pos = rec.position + 1
            yield rec


def readable_record(raw: RawRecord):
    """The record as far as it parses, without parse_record's checks (its UTF-8, unicode, type and id), for the turn
    count of a record being rejected; None where it does not parse (a reader fault, not JSON)."""
    if raw.error is not None:
        return None
    if raw.text is None:
        return table_record(raw.data) if raw.row else raw.data
    try:
        return json.loads(raw.text.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None


def parse_record(raw: RawRecord, limits: ReadLimits = ReadLimits()) -> dict:
    """Bytes -> dict; raises RecordError for anything that is not one JSON object, nests deeper than
    limits.max_json_depth or holds more messages than limits.max_messages_per_record, before a stage works on it."""
    if raw.error is not None:
        raise raw.error
    deepest, most = limits.max_json_depth, limits.max_messages_per_record
    if raw.text is not None:
        try:
            text = raw.text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError("invalid_utf8", f"line is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            data = json_value(text, max_depth=deepest, what="line")
        except ValueError as e:
            raise RecordError("invalid_json", f"line is not valid JSON: {e}") from None
        # Decoded UTF-8 holds no lone surrogate; only a JSON escape (\udc00) can make one.
        if _SURROGATE_ESCAPE.search(raw.text):
            _check_unicode(data)
    else:  # a table's row (its JSON string columns parsed by json_value), a .json file's record
        data = table_record(raw.data, max_json_depth=deepest) if raw.row else raw.data
        depth = json_nesting(data)
        if depth > deepest:
            raise RecordError("json_too_deep", f"record nests {depth} levels deep > max_json_depth={deepest}")
        _check_unicode(data)
    if not isinstance(data, dict):
        raise RecordError("not_an_object", f"record is a JSON {type(data).__name__}, expected an object")
    rid = data.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        raise RecordError("invalid_id", f"id must be a string (or an integer), got {json.dumps(rid)[:80]}")
    for key in ("messages", "conversations"):
        if isinstance(data.get(key), list) and len(data[key]) > most:
            raise RecordError("too_many_messages", f"{key}: {len(data[key])} messages > max_messages_per_record={most}")
    return data


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(data) -> None:
    """Every string of the record, keys included, must be encodable: a lone surrogate (valid JSON as an escape) would
    fail later in a tokenizer, a file write or a print. Raises invalid_unicode naming the first bad field's path."""
    try:  # every string at once (the walk below builds each field's path: 10x the cost); it names the bad field
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except (TypeError, ValueError, UnicodeEncodeError, RecursionError):  # a table's bytes, a surrogate: walk it
        pass
    stack = [("", data)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise RecordError(
                    "invalid_unicode", f"{path or 'record'}: holds a lone surrogate: {json.dumps(v[:60])}"
                ) from None
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):  # reversed: the stack pops the first field first
                stack.append((f"{path}.{k}" if path else k, x))
                stack.append((f"{path or 'record'} keys", k))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))

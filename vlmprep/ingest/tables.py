"""Ingest of tables: Parquet files and Arrow IPC files (HF datasets' `save_to_disk` and cache files) -> one RawRecord
per row, read by row group / record batch in bounded memory; and each row's layout -> the record shape normalize.py
reads. The layouts of the Hub's VLM SFT data: OpenAI `messages` (nested structs, or a JSON string), TRL's `messages`
with `{"type": "image"}` placeholders + an `images` column, ShareGPT / LLaMA-Factory (`conversations` or `messages`
with `<image>` markers + `images` or `image`) and the_cauldron's `images` + `texts`. Image cells: the HF `Image`
feature's `{bytes, path}` struct, raw bytes, or a path (read under --image-root like any path).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterator

from vlmprep.config import default
from vlmprep.ingest.locations import Input, open_input, size_of
from vlmprep.types import RawRecord, RecordError, Source, json_value

TABLE_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 64  # at most this many rows are decoded and converted to Python at once,
BATCH_BYTES = 8 << 20  # and fewer where their bytes would pass this: a row group of large images never lands whole
# Parquet pages are read through a buffer of this size, not a whole column chunk first. A data page itself is read and
# decoded whole (pyarrow): a file whose writer put a row group of large images in one page costs about twice that page.
READ_BUFFER = 1 << 20


def is_table(path: Input) -> bool:
    """A Parquet or Arrow IPC input, by its name."""
    return path.name.endswith(TABLE_SUFFIXES)


def _batches(path: Input, first_row: int):
    """(row index of the batch's first row, record batch of <= BATCH_ROWS rows), from the batch holding `first_row`
    on, each batch validated before a row of it is converted. Parquet: from its row group; Arrow IPC file format by
    batch index, stream format (what `save_to_disk` writes) read through from the start."""
    import pyarrow as pa

    if path.name.endswith(".parquet"):
        pf = _parquet_file(path)
        meta = [pf.metadata.row_group(g) for g in range(pf.metadata.num_row_groups)]
        widest = max((m.total_byte_size / max(m.num_rows, 1) for m in meta), default=1.0)  # bytes a row, decoded
        rows = max(1, min(BATCH_ROWS, int(BATCH_BYTES // max(widest, 1.0))))
        for g, at, _, _ in _row_groups(pf, first_row):
            # One group at a time: a batch across two reads their column chunks interleaved, which a store's
            # read-ahead (one range) fetched again and again (2.6x the file's bytes, measured).
            yield from _sliced(at, pf.iter_batches(batch_size=rows, row_groups=[g], use_threads=False))
        return
    # Read, never mapped: a mapped file cut short while it is read (or a batch whose buffers lie past its end) is a
    # SIGBUS that kills the build; a read is an error. Each read is capped at the file's size, so a message that
    # claims a terabyte body allocates none of it.
    size = size_of(path)
    with pa.PythonFile(_Capped(open_input(path), size), mode="r") as source:
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # not the file format: the stream format
            source.seek(0)
            batches = pa.ipc.open_stream(source)
        yield from _sliced(0, _claimed(batches, size))


class _Capped:
    """A binary file whose reads stop at `size` (the file's bytes when it was opened): what pyarrow reads an Arrow IPC
    input through (a plain file object would allocate the whole of a message body a hostile header claims)."""

    def __init__(self, f, size: int):
        self._f, self._size, self.closed = f, size, False

    def read(self, n: int = -1) -> bytes:
        left = max(self._size - self._f.tell(), 0)
        return self._f.read(left if n is None or n < 0 else min(n, left))

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True
        self._f.close()


class TableLie(ValueError):
    """A table's own bookkeeping (a Parquet footer, an Arrow batch header) claims what its bytes cannot hold."""


def _check_rows(rows: int, size: int, what: str) -> None:
    """Refuses more rows than the file has bytes: a row of a layout vlmprep reads takes bytes (its messages at
    least), and every row claimed costs the plan and the reader time and memory."""
    if rows > max(size, 0):
        raise TableLie(f"{what} claims {rows} rows in {size} bytes, more rows than the file has bytes")


def _claimed(batches, size: int) -> Iterator:
    """Arrow IPC record batches, refused once they claim more rows, in all, than the file has bytes."""
    rows = 0
    for batch in batches:
        rows += batch.num_rows
        _check_rows(rows, size, "its record batches")
        yield batch


def _parquet_file(path: Input):
    """A store's object through its range reads (locations.py); a local file by path. Its footer's row counts are
    checked against the file's bytes before any is used (a 2.8 KB file claiming 10^12 rows)."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path if isinstance(path, Path) else open_input(path), buffer_size=READ_BUFFER, pre_buffer=False)
    meta = pf.metadata
    groups = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    if min(groups, default=0) < 0 or sum(groups) != meta.num_rows:
        raise TableLie(f"its footer claims {meta.num_rows} rows but its row groups {sum(groups)}")
    _check_rows(meta.num_rows, size_of(path), "its footer")
    return pf


def _row_groups(pf, first_row: int):
    """(group, row index of its first row, its rows, bytes a row decoded) of each row group from the one holding
    `first_row` on, from the file's footer alone: the plan's scan reads no rows this way (a bucket's dataset is not
    downloaded once more to count them)."""
    start = 0
    for g in range(pf.metadata.num_row_groups):
        m = pf.metadata.row_group(g)
        if start + m.num_rows > first_row:
            yield g, start, m.num_rows, max(m.total_byte_size // max(m.num_rows, 1), 1)
        start += m.num_rows


def _sliced(start: int, batches) -> Iterator:
    """Each batch, validated in full (offsets, lengths, UTF-8: a batch whose string offsets point past its buffers
    would make the conversion read outside them), in slices of BATCH_ROWS rows, fewer where that many would pass
    BATCH_BYTES."""
    for batch in batches:
        batch.validate(full=True)
        rows = max(1, min(BATCH_ROWS, int(BATCH_BYTES * batch.num_rows // max(batch.nbytes, 1))))
        for i in range(0, batch.num_rows, rows):
            yield start + i, batch.slice(i, rows)
        start += batch.num_rows


def iter_table_records(
    path: Input,
    *,
    start_position: int = 0,
    first_row: int = 0,
    input_name: str = "",
    scan: bool = False,
    max_messages: int = default("max_messages_per_record"),
) -> Iterator[RawRecord]:
    """One RawRecord per row from `first_row` on (its data the row as a dict, `row` set: table_record converts it in
    the worker); a file that cannot be read, or fails mid-way, ends in a record carrying the error, after every row
    read before it. `scan`: rows without their data (the task plan's pass: positions and sizes only; a Parquet file's
    from its footer). A row whose message list is longer than `max_messages` is a record carrying the error
    (too_many_messages), found from the list's length before the row is converted."""
    import pyarrow as pa

    name, pos, row = str(path), start_position, first_row
    try:
        if scan and name.endswith(".parquet"):
            chunks = ((at, n, per_row, None) for _, at, n, per_row in _row_groups(_parquet_file(path), first_row))
        else:
            chunks = (
                (at, b.num_rows, max(b.nbytes // max(b.num_rows, 1), 1), b) for at, b in _batches(path, first_row)
            )
        for at, n, per_row, batch in chunks:
            skip = max(first_row - at, 0)
            rows = itertools.repeat(None, n - skip) if scan else _rows(batch.slice(skip), max_messages)
            for data in rows:
                row += 1
                source = Source(name, row, input_name)
                if isinstance(data, RecordError):
                    yield RawRecord(source, pos, error=data, offset=row - 1, size=per_row)
                else:
                    yield RawRecord(source, pos, data=data, offset=row - 1, size=per_row, row=True)
                pos += 1
    except (OSError, pa.ArrowException, TableLie) as e:
        what = (
            f"{name}: not a readable {'Parquet' if name.endswith('.parquet') else 'Arrow IPC'} file ({e})"
            if row == first_row == 0
            else f"{name}: {e} after row {row}; the rows before it were kept"
        )
        yield RawRecord(
            Source(name, row + 1, input_name),
            pos,
            error=RecordError("unreadable_table", what[:600]),
            offset=row,
            unread_bytes=size_of(path) if row == 0 else 0,
        )
        return
    if pos == start_position and first_row == 0:
        yield RawRecord(Source(name, 0, input_name), pos, error=RecordError("empty_file", f"{name} holds no rows"))


_MESSAGE_LISTS = {"messages": 1, "conversations": 1, "texts": 2}  # a list column -> messages per entry


def _rows(batch, limit: int) -> list:
    """A batch's rows as dicts; in the place of a row whose message list (messages, conversations, the_cauldron's
    texts) is longer than `limit`, a RecordError: that row is never converted (a few KB of a table can hold 10^6
    messages)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    counts = np.zeros(batch.num_rows, np.int64)
    for name, per in _MESSAGE_LISTS.items():
        i = batch.schema.get_field_index(name)
        kind = batch.schema.types[i] if i >= 0 else None
        if kind is not None and (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            n = pc.list_value_length(batch.column(i)).fill_null(0).to_numpy(zero_copy_only=False)
            counts = np.maximum(counts, n * per)
    over = counts > limit
    if not over.any():
        return batch.to_pylist()
    kept = iter(batch.filter(pa.array(~over)).to_pylist())
    return [
        RecordError("too_many_messages", f"{n} messages > max_messages_per_record={limit}") if o else next(kept)
        for o, n in zip(over.tolist(), counts.tolist())
    ]


# --- a row's layout -> the record normalize reads ---


def table_record(row: dict, *, max_json_depth: int = default("max_json_depth")) -> dict:
    """A table row -> an OpenAI or ShareGPT record (normalize_record's input), image cells as bytes or paths. A row
    that fits no layout is a RecordError (unknown_layout) naming the columns found; a JSON string column nesting
    deeper than `max_json_depth` is one too (json_too_deep), found as it is parsed."""
    columns = sorted(row)
    row = {k: v for k, v in row.items() if v is not None}  # a null cell: the column is absent from this row
    # tool specs are often stored as a JSON string column too: their schemas differ per row
    for key, invalid in (("messages", "invalid_json"), ("tools", "invalid_tools")):
        if isinstance(row.get(key), str):
            try:
                row[key] = json_value(row[key], max_depth=max_json_depth, what=f"{key} (a JSON string column)")
            except ValueError as e:
                raise RecordError(invalid, f"{key}: a JSON string column that is not valid JSON: {e}") from None
    if "image" in row and "images" not in row:  # LLaVA-style: one image per row
        row["images"] = [row.pop("image")]
    if isinstance(row.get("images"), list):
        row["images"] = [_image_cell(c, f"images[{i}]") for i, c in enumerate(row["images"])]
    if isinstance(row.get("messages"), list) and isinstance(row.get("images"), list) and _placeholders(row):
        return _trl(row)
    if "messages" in row or "conversations" in row:
        return row
    if isinstance(row.get("texts"), list):
        return _cauldron(row)
    nulls = [c for c in columns if c not in row]
    found = ", ".join(sorted(row)[:12]) or "none"
    raise RecordError(
        "unknown_layout",
        f"a row with columns {found}"
        + (f" (null: {', '.join(nulls[:12])})" if nulls else "")
        + ": none of the layouts vlmprep reads (messages; conversations; messages + images; texts + "
        "images)",
    )


def _image_cell(cell, where: str):
    """The HF Image feature's {bytes, path} struct -> its bytes (else its path); raw bytes and paths as they are."""
    if isinstance(cell, dict):
        if cell.get("bytes") is not None:
            return cell["bytes"]
        if cell.get("path") is not None:
            return cell["path"]
        raise RecordError("invalid_image_ref", f"{where}: an image cell with neither bytes nor a path")
    return cell


def _is_placeholder(part) -> bool:
    return (
        isinstance(part, dict)
        and part.get("type") == "image"
        and all(part.get(k) is None for k in ("image", "url", "path", "source", "image_url"))
    )


def _placeholders(row: dict) -> bool:
    return any(
        _is_placeholder(p)
        for m in row["messages"]
        if isinstance(m, dict)
        for p in (m.get("content") if isinstance(m.get("content"), list) else [])
    )


def _trl(row: dict) -> dict:
    """TRL's vision layout: each {"type": "image"} part, in message order, takes the next cell of `images`."""
    images = list(row.pop("images"))
    n = len(images)
    messages = []
    for m in row["messages"]:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            content = []
            for p in m["content"]:
                if _is_placeholder(p):
                    if not images:
                        raise RecordError(
                            "image_count_mismatch", f"more image placeholders than the {n} images of the row's 'images'"
                        )
                    p = {"type": "image", "image": images.pop(0)}
                content.append(p)
            m = {**m, "content": content}
        messages.append(m)
    if images:
        raise RecordError(
            "image_count_mismatch",
            f"'images' holds {n} images but the messages have only {n - len(images)} image placeholders",
        )
    return {**row, "messages": messages}


def _cauldron(row: dict) -> dict:
    """the_cauldron: `images` go with the first user turn, then each `texts` entry is a user / assistant pair."""
    images = row.get("images") or []
    messages = []
    for i, t in enumerate(row["texts"]):
        if not isinstance(t, dict) or not isinstance(t.get("user"), str) or not isinstance(t.get("assistant"), str):
            raise RecordError("unknown_layout", f"texts[{i}]: expected an object with 'user' and 'assistant' strings")
        parts = [{"type": "image", "image": im} for im in images] if i == 0 else []
        messages.append({"role": "user", "content": parts + [{"type": "text", "text": t["user"]}]})
        messages.append({"role": "assistant", "content": t["assistant"]})
    return {k: v for k, v in row.items() if k not in ("images", "texts")} | {"messages": messages}

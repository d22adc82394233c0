"""`vlmprep stats DIR --samples FILE --rejects FILE`: the dataset as tables for pandas, DuckDB or Polars. One Parquet
row per sample (stats.py collects them in its one pass over the shards, SAMPLE_COLUMNS) and one per line of the
version's rejects files (a rejected record or a lost turn), each with the version that added it, written atomically;
no file in the dataset is changed."""

from __future__ import annotations

import io
from pathlib import Path

from vlmprep.shards.dataset import write_bytes_atomic
from vlmprep.shards.manifest import open_dataset
from vlmprep.shards.versions import added_since, dataset_rejects

# `vlmprep stats --samples FILE`: one row per sample (stats.py collects them, write_sample_table writes them).
SAMPLE_COLUMNS = (
    "id",
    "version",
    "source_file",
    "source_line",
    "shard",
    "shard_index",
    "tokens",
    "trained_tokens",
    "images",
    "image_tokens",
    "videos",
    "truncated",
    "split_part",
    "dropped_images",
)
REJECT_COLUMNS = ("id", "version", "source_file", "source_line", "reason", "message", "unread_bytes")


def _types():
    import pyarrow as pa

    return {
        "id": pa.string(),
        "version": pa.int64(),
        "source_file": pa.string(),
        "source_line": pa.int64(),
        "shard": pa.string(),
        "shard_index": pa.int64(),
        "tokens": pa.int64(),
        "trained_tokens": pa.int64(),
        "images": pa.int64(),
        "image_tokens": pa.int64(),
        "videos": pa.int64(),
        "truncated": pa.bool_(),
        "split_part": pa.int64(),
        "dropped_images": pa.int64(),
        "reason": pa.string(),
        "message": pa.string(),
        "unread_bytes": pa.int64(),
    }


def _write(columns: dict[str, list], path: Path) -> int:
    """Columns -> a Parquet file at `path` (zstd, typed by _types, so an empty table has its schema too)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = _types()
    table = pa.table({c: pa.array(v, type=types[c]) for c, v in columns.items()})
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd")
    write_bytes_atomic(Path(path), out.getvalue())
    return table.num_rows


def write_sample_table(rows: dict[str, list], path: Path) -> int:
    """stats' sample rows (compute_stats(sample_rows=...)) -> FILE; returns the rows written. An id that is an
    integer in the input is its string here, as in the meta."""
    return _write(
        {c: [None if v is None else str(v) for v in vals] if c == "id" else vals for c, vals in rows.items()}, path
    )


def write_reject_table(root: Path | str, path: Path, since: str | None = None) -> int:
    """The rejects of a dataset version (DIR, DIR@vN or DIR@TAG: rejects.jsonl and each later version's
    rejects.v00000N.jsonl up to it; `since` vM: those of the versions after M alone) -> FILE, one row per reject line
    with the version it belongs to; returns the rows written."""
    cols: dict[str, list] = {c: [] for c in REJECT_COLUMNS}
    d, manifest = open_dataset(root)
    before = added_since(d, manifest, since)[0] if since is not None else 0
    for version, r in dataset_rejects(d, manifest, since=before):  # less a rebuilt input's old lines
        src = r.get("source") if isinstance(r.get("source"), dict) else {}
        text = {
            k: None if v is None else str(v)
            for k, v in (
                ("id", r.get("id")),
                ("source_file", src.get("file")),
                ("reason", r.get("reason")),
                ("message", r.get("message")),
            )
        }
        values = {
            **text,
            "version": version,
            "source_line": src.get("line") if isinstance(src.get("line"), int) else None,
            "unread_bytes": r.get("unread_bytes") if isinstance(r.get("unread_bytes"), int) else None,
        }
        for c in REJECT_COLUMNS:
            cols[c].append(values[c])
    return _write(cols, path)

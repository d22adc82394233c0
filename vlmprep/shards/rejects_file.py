"""A dataset's rejects files (rejects.jsonl, rejects.v00000N.jsonl) read back, bounded: stats, inspect and append
read every reject record through here, never parsing a line before its size and depth are checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from vlmprep.shards.format import LIMITS
from vlmprep.shards.manifest import ShardFormatError
from vlmprep_schemas.limits import load_json, past_int64


def iter_rejects(p: Path) -> Iterator[dict]:
    """A dataset's rejects.jsonl, one reject record per line; a line longer than the meta limit, nested too deep or
    not a JSON object is one ShardFormatError naming the file and line, found before it is parsed; so is a number no
    count holds (past int64)."""
    with open(p, "rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(LIMITS.meta_bytes + 1), b""), 1):
            if not line.strip():
                continue
            try:
                record = load_json(line, f"{Path(p).name} line {n}", LIMITS.meta_bytes)
            except ValueError as e:
                raise ShardFormatError(str(e)) from None
            if not isinstance(record, dict):
                raise ShardFormatError(f"{Path(p).name} line {n} is not a JSON object")
            field = past_int64(record)  # a reject numbered 10^30 fits no column of the stats tables, nor any count
            if field is not None:
                raise ShardFormatError(f"{Path(p).name} line {n}: {field} is past int64: not a reject vlmprep wrote")
            yield record

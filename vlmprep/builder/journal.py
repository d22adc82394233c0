"""Task journal: what an interrupted task has durably finished (completed shards, input position, rejects
so far), so a rerun of the task resumes and still ends byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from vlmprep.shards.dataset import sha256_file, write_json_atomic
from vlmprep.shards.versions import id_keys
from vlmprep_schemas.boundary import UnsafeWrite, open_no_follow, read_state

DONE = 1 << 62  # the resume point once every record of the task landed: the rerun goes straight to its manifest


@dataclass
class Journal:
    """A task's resume point, saved after each completed shard: what the task is (identity), its shards so far, the
    input position every earlier record is accounted for at, and the totals and rejects up to there."""

    identity: dict  # config + input signature + processor fingerprint: a resume is valid only if all match
    shards: list[dict] = field(default_factory=list)
    next_position: int = 0  # every input record before this is in a completed shard or in the rejects
    rejects_bytes: int = 0
    samples_bytes: int | None = None  # the partial sample rows up to here (None: a journal from before they were kept)
    totals: dict = field(default_factory=dict)
    rejects: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # input file index -> its share of the totals


def load_journal(
    out: Path,
    path: Path,
    partials: dict[Path, Path],
    identity: dict,
    span: tuple[int, int],
    stored: Callable[[list[str]], dict[str, int]] | None = None,
) -> Journal | None:
    """The journal at `path` if it belongs to this exact task and its shards are intact; else None (start over).
    `partials`: the task's partial rejects and sample rows files -> their completed names. `span`: the task's
    (first input position, record count), which the resume point is checked against. `stored`: for an --out in
    a store, the sizes of the named objects in the bucket, where a shard that left the stage once up is checked."""
    try:
        j = Journal(**json.loads(read_state(path)))
    except UnsafeWrite:
        raise  # a link or FIFO planted at the journal's name: one line, nothing read through it
    except (OSError, ValueError, TypeError):
        return None
    if j.identity != identity or not _consistent(j, span):
        return None  # another task's, counts it never kept, or a resume point its own counts do not reach
    gone = [s["name"] for s in j.shards if not (out / s["name"]).exists()]
    held = stored(gone) if stored is not None and gone else {}
    for s in j.shards:
        whole = held.get(s["name"]) == s["bytes"] if s["name"] in held else _intact(out / s["name"], s)
        if not whole or (s.get("index") and not _intact(out / s["index"]["name"], s["index"])):
            return None
    for (partial, final), size in zip(partials.items(), (j.rejects_bytes, j.samples_bytes)):
        if not partial.exists() and final.exists():
            final.replace(partial)  # killed between the renames and the manifest: take it back
        if (partial.stat().st_size if partial.exists() else 0) < size:
            return None
    return j


def _consistent(j: Journal, span: tuple[int, int]) -> bool:
    """The resume point against the task's input span and the journal's own counts: a task's records are the
    contiguous positions first..first+count, each counted once in totals.records when it lands, so the point is
    first + records (or DONE once all count of them landed), and the journaled shards hold every sample counted.
    A point moved past the end (or anywhere else) would skip records that never landed, with exit 0."""
    first, count = span
    try:
        records, samples = j.totals.get("records", 0), j.totals.get("samples", 0)
        in_shards = sum(s["num_samples"] for s in j.shards)
    except (AttributeError, KeyError, TypeError):
        return False
    if not all(type(v) is int for v in (j.next_position, records, samples, in_shards)):
        return False
    if j.samples_bytes is None or (records and not j.inputs):
        return False  # counts it never kept
    point = first + records if records < count else DONE
    return j.next_position in (point, first + records) and 0 <= records <= count and in_shards == samples


def _intact(p: Path, entry: dict) -> bool:
    return p.is_file() and p.stat().st_size == entry["bytes"] and sha256_file(p) == entry["sha256"]


def save_journal(path: Path, journal: Journal) -> None:
    """Writes the journal to `path` atomically (a crash leaves the previous one or this one, never half)."""
    write_json_atomic(path, asdict(journal))


def landed_ids(rows: Path) -> set[str]:
    """Ids already written, each sample's id_keys (the duplicate-id check must survive a resume): the task's sample
    rows, one per landed sample, which a resume has cut back to the journal's durable point. Not the shards: in a
    store's stage they leave once up."""
    with open_no_follow(rows, "rb") as f:
        return {key for line in f for key in id_keys(json.loads(line))}

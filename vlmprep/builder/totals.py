"""A build's counts: the totals a task and the merged manifest carry and what one landed sample adds to them (the
turn coverage derived from them: shards/summary.turn_coverage).
"""

from __future__ import annotations

import collections

from vlmprep.shards.versions import record_id

TOTAL_KEYS = (
    "records",
    "samples",
    "rejected",  # records rejected whole (each once, under one reason)
    "reject_lines",  # lines of rejects.jsonl: the rejected records and the turn_too_long lines of records that landed
    "tokens",
    "trainable_tokens",
    "image_tokens",
    "images",
    "truncated_samples",
    "dropped_images",
    "unrendered_tool_call_turns",
    "split_samples",
    "input_assistant_turns",
    "trained_assistant_turns",
    "turns_lost_truncated",
    "turns_lost_too_long",
    "turns_lost_policy",
    "turns_lost_rejected",
    "images_removed_by_history",
    "context_tokens_repeated",
    "unread_bytes",
    "reasoning_turns",
    "reasoning_turns_dropped",
    "reasoning_turns_not_rendered",
    "videos",
    "video_tokens",
    "dropped_videos",
    "turns_lost_large_image",
    "turns_lost_single_image",  # lost turns of records with at most one image: --keep-images cannot shorten them
)


SAMPLE_FIELDS = (
    "id",
    "source",
    "num_tokens",
    "num_trainable_tokens",
    "num_image_tokens",
    "num_images",
    "truncated",
    "dropped_images",
    "unrendered_tool_calls",
    "split",
    "num_videos",
    "num_video_tokens",
    "dropped_videos",
)


def count_sample(totals: collections.Counter, m: dict, sign: int = 1) -> None:
    """Add a landed sample's counts to the totals (sign=-1: take back one that merge removes)."""
    for key, field in (
        ("tokens", "num_tokens"),
        ("trainable_tokens", "num_trainable_tokens"),
        ("image_tokens", "num_image_tokens"),
        ("images", "num_images"),
        ("dropped_images", "dropped_images"),
        ("unrendered_tool_call_turns", "unrendered_tool_calls"),
    ):
        totals[key] += sign * m[field]
    for key, field in (
        ("videos", "num_videos"),
        ("video_tokens", "num_video_tokens"),
        ("dropped_videos", "dropped_videos"),
    ):
        totals[key] += sign * m.get(field, 0)  # absent from image-only samples
    totals["samples"] += sign
    totals["truncated_samples"] += sign * int(m["truncated"])
    totals["split_samples"] += sign * int(m["split"] is not None)


def count_reject(totals: collections.Counter, entry: dict, sign: int = 1) -> None:
    """Add one rejects.jsonl line to the totals (sign=-1: take back one that merge removes): a line, and a rejected
    record unless it is a turn_too_long line (a lost turn of a record whose other turns are written)."""
    totals["reject_lines"] += sign
    totals["rejected"] += sign * (entry["reason"] != "turn_too_long")


def input_totals(counts, *, zeros: bool = False) -> dict:
    """One input file's share of the totals: the same keys, those that are 0 left out (a build may read thousands of
    files; the manifest lists each). zeros=True: every key, the totals of a whole task or dataset."""
    return {k: int(counts[k]) for k in TOTAL_KEYS if zeros or counts[k]}


def duplicate_reject(meta: dict) -> dict:
    """The one reject entry of a record whose id an earlier record already used (reason duplicate_id); `meta`: any
    landed sample of it."""
    rid = record_id(meta)
    return {
        "source": dict(meta["source"]),
        "id": rid,
        "reason": "duplicate_id",
        "message": f"id {rid!r} already used by an earlier record",
    }


def duplicate_turns(turns: dict) -> dict:
    """A record's turn accounting once it is rejected as a duplicate: its assistant turns, all lost with it."""
    n = int(turns.get("input_assistant_turns", 0))
    out = {"input_assistant_turns": n, "turns_lost_rejected": n}
    if turns.get("reasoning_turns"):
        out["reasoning_turns"] = turns["reasoning_turns"]
    return out

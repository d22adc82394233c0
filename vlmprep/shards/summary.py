"""Human summaries of a built dataset, from its manifest: used by `build` and `stats`."""

from __future__ import annotations

from pathlib import Path

from vlmprep.shards.manifest import Manifest, TaskManifest


def plural(n: int, word: str) -> str:
    """`n word`, with an s unless n is 1."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def dropped_by_cut(images: int, videos: int) -> str:
    """What truncation dropped whole; videos named only where there were some."""
    return plural(images, "image") + (f" and {plural(videos, 'video')}" if videos else "") + " dropped by the cut"


def turn_coverage(totals) -> dict:
    """Assistant turns of the input that the shards train, and where the others went."""
    n = int(totals["input_assistant_turns"])
    return {
        "input_assistant_turns": n,
        "trained_assistant_turns": int(totals["trained_assistant_turns"]),
        "coverage": round(totals["trained_assistant_turns"] / n, 6) if n else 1.0,
        "lost": {
            "truncated": int(totals["turns_lost_truncated"]),
            "turn_too_long": int(totals["turns_lost_too_long"]),
            "not_trained_by_policy": int(totals["turns_lost_policy"]),
            "record_rejected": int(totals["turns_lost_rejected"]),
        },
        "images_removed_by_history": int(totals["images_removed_by_history"]),
        "context_tokens_repeated": int(totals["context_tokens_repeated"]),
    }


# A reject line that is a lost turn of a record whose other turns landed, not a rejected record.
LOST_TURNS_NOTE = {"turn_too_long": " (turns; their records landed)"}


def counts_records(manifest: Manifest) -> bool:
    """Whether totals.rejected (and each input's) counts rejected records: every dataset that also counts its
    reject_lines. Before, it counted the lines of rejects.jsonl, turn_too_long ones (lost turns) included."""
    return "reject_lines" in manifest.totals


def rejected_records(manifest: Manifest, totals: dict | None = None, lost_turns: int | None = None) -> int:
    """Rejected records, of the dataset or of one input (`totals`, its share, and `lost_turns`, its turn_too_long
    lines; None: its turns_lost_too_long): totals.rejected, or, in a dataset built before it counted them, its reject
    lines less the turn_too_long ones (a lost turn of a record whose other turns landed)."""
    if totals is None:
        totals, lost_turns = manifest.totals, manifest.rejects.get("turn_too_long", 0)
    if counts_records(manifest):
        return int(totals.get("rejected", 0))
    return int(totals.get("rejected", 0)) - int(
        totals.get("turns_lost_too_long", 0) if lost_turns is None else lost_turns
    )


def reject_mismatches(manifest: Manifest, *, lines: int, records: int) -> list[str]:
    """Where totals.rejected and totals.reject_lines differ from the rejects counted: the `lines` of rejects.jsonl and
    the `records` they reject (totals.rejected: the lines, in a dataset built before it counted records)."""
    t = manifest.totals
    want = {"rejected": records if counts_records(manifest) else lines, "reject_lines": lines}
    return [f"manifest totals.{k}={t[k]} but the rejects give {v}" for k, v in want.items() if k in t and t[k] != v]


def reject_share(manifest: Manifest) -> float:
    """The share of input records the build rejected (0 when there were none)."""
    records = manifest.totals["records"]
    return rejected_records(manifest) / records if records else 0.0


# The one-line fix for the most common reject reasons (the rest: docs/rejects.md and rejects.jsonl).
REJECT_FIXES = {
    "template_refused": "the chat template takes no such conversation (see rejects.jsonl): pass one that does with "
    "--chat-template, or reshape the records",
    "tool_calls_not_rendered": "pass a tool-aware --chat-template (bundled for Qwen2-VL / Qwen2.5-VL: "
    "--chat-template qwen2_vl_tools), or --tool-calls drop-from-loss",
    "no_trainable_tokens_after_truncation": "raise --seq-len, or pass --long-traces split (and --keep-images last:N)",
    "turn_too_long": "raise --seq-len, or pass --keep-images last:N to drop older screenshots",
    "image_not_found": "image paths resolve against each input file's dir: pass --image-root DIR",
    "path_outside_root": "image paths must resolve inside --image-root: pass the dir that holds them",
    "remote_image_refused": "pass --allow-remote to fetch http(s) images",
    "too_many_images": "raise --max-images-per-record, or pass --keep-images last:N",
    "image_too_large": "raise --max-image-pixels",
    "image_file_too_large": "raise --max-image-bytes",
    "video_file_too_large": "raise --max-video-bytes",
    "image_too_small": "lower --min-image-side",
    "video_too_small": "lower --min-image-side",
    "raw_video_stream": "wrap each raw stream in a container at its real rate: ffmpeg -framerate FPS -i IN -c copy "
    "OUT.mp4",
    "line_too_long": "raise --max-line-bytes",
    "no_assistant_turn": "records need an assistant turn to train (or --train-on-roles naming a role they have)",
    "no_trainable_tokens": "check --train-on-roles against the roles your records have",
    "duplicate_id": "give every record a unique id (or leave id out: one is derived from file and line)",
    "missing_messages": 'records must be OpenAI chat format {"messages": [...]}: see schemas/record.schema.json',
    "invalid_json": "each input line must be one JSON record: see the first line rejects.jsonl names",
}


def reject_fix(reason: str, manifest: Manifest) -> str:
    """The one-line fix printed for a reject reason, tuned to the dataset where the manifest says more."""
    fix = REJECT_FIXES.get(reason, "see rejects.jsonl and docs/rejects.md")
    if reason == "tool_calls_not_rendered" and manifest.processor.spec in ("builtin:qwen2-vl", "builtin:qwen2.5-vl"):
        fix = "pass --chat-template qwen2_vl_tools (the bundled tool-aware template), or --tool-calls drop-from-loss"
    if reason in ("no_trainable_tokens_after_truncation", "turn_too_long") and _large_images_cost(manifest):
        fix = _max_pixels_fix(manifest)
    elif reason in ("no_trainable_tokens_after_truncation", "turn_too_long") and _single_images_cost(manifest):
        fix = _seq_len_fix(manifest)
    return fix


def _max_pixels_fix(manifest: Manifest) -> str:
    """An image over half of --seq-len leaves no room for the turns around it, and neither split nor --keep-images
    helps: the pixel budget that makes any image at most a quarter of --seq-len (28 x 28 pixels a token: Qwen2-VL and
    Qwen2.5-VL; fewer tokens for Qwen3-VL's 32 x 32)."""
    seq_len = int(manifest.config["seq_len"])
    return (
        f"pass --max-pixels {seq_len // 4 * 28 * 28} (images over half of --seq-len {seq_len} cost these turns; "
        "this caps one at a quarter of it), or raise --seq-len"
    )


def _large_images_cost(manifest: Manifest) -> bool:
    return _most_lost(manifest, "turns_lost_large_image")


def _single_images_cost(manifest: Manifest) -> bool:
    return _most_lost(manifest, "turns_lost_single_image")


def _most_lost(manifest: Manifest, key: str) -> bool:
    """Whether the turns counted under `key` are at least half of those --seq-len cost (or, none cut, any: records
    rejected)."""
    t = manifest.totals
    cut, these = t.get("turns_lost_truncated", 0) + t.get("turns_lost_too_long", 0), t.get(key, 0)
    return 2 * these >= cut if cut else these > 0


def _seq_len_fix(manifest: Manifest) -> str:
    """Turns --seq-len cost in records of at most one image: --keep-images, which drops older images, cannot
    shorten them (a one-image LLaVA-OneVision build was told to pass it); --seq-len can."""
    t = manifest.totals
    cut = t.get("turns_lost_truncated", 0) + t.get("turns_lost_too_long", 0)
    share = f"{t['turns_lost_single_image']} of the {cut}" if cut else "the"
    return (
        f"raise --seq-len ({share} turns lost are in records holding at most one image, which --keep-images "
        "cannot shorten)"
    )


def turns_to_train(manifest: Manifest) -> tuple[int, int, dict[str, int]]:
    """(trained, to train, lost by reason) for the --min-turn-coverage rule: the assistant turns the options train in
    the records that landed, those --seq-len cost (truncated, turn_too_long) and every assistant turn of a rejected
    record (duplicates included: a build that keeps 2% of its records never passes on the turns it kept). Turns the
    policy leaves untrained are the user's choice."""
    turns = manifest.turns or {}
    lost = {k: int(turns.get("lost", {}).get(k, 0)) for k in ("truncated", "turn_too_long", "record_rejected")}
    trained = int(turns.get("trained_assistant_turns", 0))
    return trained, trained + sum(lost.values()), lost


def coverage_problem(manifest: Manifest, minimum: float) -> str | None:
    """The one line (share, counts, lost by reason, fix) when fewer than `minimum` of the turns to train are trained;
    None when the dataset passes. Used by build and merge (an error) and stats (a warning)."""
    trained, total, lost = turns_to_train(manifest)
    share = trained / total if total else 1.0
    if share >= minimum:
        return None
    config = manifest.config or {}
    rejected = lost.pop("record_rejected")
    why = ", ".join(f"{k} {v}" for k, v in lost.items() if v)
    losses = ([f"lost to --seq-len {config.get('seq_len')}: {why}"] if why else []) + (
        [f"lost with rejected records: {rejected}"] if rejected else []
    )
    if rejected > sum(lost.values()):
        ranked = sorted(
            ((r, n) for r, n in manifest.rejects.items() if r != "turn_too_long"), key=lambda x: (-x[1], x[0])
        )
        fix = (
            f"{ranked[0][0]} is the most common reject ({ranked[0][1]}): {reject_fix(ranked[0][0], manifest)}"
            if ranked
            else "see rejects.jsonl"
        )
    elif _large_images_cost(manifest):
        fix = _max_pixels_fix(manifest)
    elif lost["truncated"] and config.get("long_traces") == "truncate":
        fix = "drop --long-traces truncate (split, the default, trains every turn in step samples)" + (
            "" if _single_images_cost(manifest) else ", or pass --keep-images last:3 so that traces fit"
        )
    elif _single_images_cost(manifest):
        fix = _seq_len_fix(manifest)
    elif config.get("keep_images") is not None:  # older screenshots are dropped already: what is left is too long
        fix = (
            f"raise --seq-len (these turns, with what they act on, do not fit {config.get('seq_len')} tokens even "
            f"with --keep-images last:{config['keep_images']}; rejects.jsonl names each)"
        )
    else:
        fix = "pass --keep-images last:3 to drop older screenshots, or raise --seq-len"
    return (
        f"turn coverage {share:.1%} < --min-turn-coverage {minimum:g} ({trained} of {total} assistant turns "
        f"trained; {'; '.join(losses)}); fix: {fix}"
    )


def format_build_summary(manifest: Manifest, out: Path, version: int | None = None) -> str:
    """A built dataset's manifest -> the summary `vlmprep build` prints (totals, token counts, rejects and their
    fixes); `version`: what `build --append` added as that version (`manifest`: the merge's of the new inputs)."""
    t = manifest.totals
    done = f"built {out}" if version is None else f"appended version v{version} to {out}"
    rejects = "rejects.jsonl" if version in (None, 1) else f"rejects.v{version:06d}.jsonl"
    lines = [
        f"{done}: {plural(t['samples'], 'sample')} in {plural(len(manifest.shards), 'shard')} "
        f"({manifest.image_format} images, format v{manifest.format_version})",
        *(
            [
                f"  processor         {manifest.processor.spec}: a small vocabulary for trying the family and "
                "for tests, never for training a real model"
            ]
            if str(manifest.processor.spec).startswith("tiny:")
            else []
        ),
        f"  records read      {t['records']}",
        *(
            [f"  unread input      {t['unread_bytes']} bytes after file faults (see rejects.jsonl)"]
            if t.get("unread_bytes")
            else []
        ),
        f"  tokens            {t['tokens']} ({t['trainable_tokens']} trained, "
        f"{t['trainable_tokens'] / max(t['tokens'], 1):.1%})",
        f"  images            {t['images']} ({t['image_tokens']} image tokens)",
        *(
            [f"  videos            {t['videos']} ({t['video_tokens']} video tokens)"]
            if t.get("videos") or t.get("dropped_videos")
            else []
        ),
        f"  truncated samples {t['truncated_samples']} "
        f"({dropped_by_cut(t['dropped_images'], t.get('dropped_videos', 0))})",
        f"  unrendered tool-call turns {t['unrendered_tool_call_turns']}",
        *_turn_lines(manifest.turns),
        *_reasoning_lines(t, manifest.config),
        f"  rejected          {rejected_records(manifest)} of {plural(t['records'], 'record')} "
        f"({reject_share(manifest):.1%})" + (f" -> {rejects}" if manifest.rejects else ""),
    ]
    for reason, n in manifest.rejects.items():
        lines.append(f"    {reason:<36} {n}" + LOST_TURNS_NOTE.get(reason, ""))
    return "\n".join(lines)


def _turn_lines(turns: dict | None) -> list[str]:
    if not turns:
        return []
    lost = ", ".join(f"{k} {v}" for k, v in turns["lost"].items() if v) or "none"
    return [
        f"  assistant turns   {turns['trained_assistant_turns']} of {turns['input_assistant_turns']} trained "
        f"(coverage {turns['coverage']:.1%}; lost: {lost})",
        f"  history policy    {turns['images_removed_by_history']} images removed; split context "
        f"{turns['context_tokens_repeated']} tokens repeated",
    ]


def _reasoning_lines(t: dict, config: dict) -> list[str]:
    if not t.get("reasoning_turns"):
        return []
    return [
        f"  reasoning turns   {t['reasoning_turns']} (--reasoning {config.get('reasoning', 'train')}; "
        f"{t.get('reasoning_turns_dropped', 0)} dropped by it, {t.get('reasoning_turns_not_rendered', 0)} "
        "left out by the template)"
    ]


def format_task_summary(task: TaskManifest, out: Path) -> str:
    """A task manifest -> the line `vlmprep build --task-index I` prints."""
    t = task.totals
    return (
        f"task {task.task} of {out}: {plural(t['records'], 'record')} -> {plural(t['samples'], 'sample')} in "
        f"{plural(len(task.shards), 'shard')}, {t['rejected']} rejected"
    )

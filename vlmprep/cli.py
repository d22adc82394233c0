"""Thin CLI: parse options, build a config, call the pipeline, print a summary. No logic lives here."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmprep.types import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline VLM SFT data: render, mask, truncate and shard chat traces; inspect the result.")


@app.callback()
def _root() -> None:
    """vlmprep: offline VLM SFT data preparation."""


def _fail(e: BaseException) -> None:
    if os.environ.get("VLMPREP_DEBUG"):
        raise e
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1)


@app.command()
def build(
    out: Annotated[Path, typer.Option("--out", help="Output dataset dir (shards, manifest, processor).")],
    inputs: Annotated[Optional[list[str]], typer.Option("--in", help="Input .jsonl / .jsonl.zst / .json files, globs or dirs (optional with --task-index when DIR/plan.json exists).")] = None,
    processor: Annotated[str, typer.Option(help="builtin:qwen2-vl | builtin:qwen2.5-vl | builtin:qwen3-vl | builtin:qwen3.5 | local processor dir | hub id.")] = "builtin:qwen2-vl",
    seq_len: Annotated[int, typer.Option(help="Max tokens per sample; cuts never split an image.")] = 8192,
    image_format: Annotated[str, typer.Option(help="zstd | png | webp | original (see README).")] = "zstd",
    samples_per_shard: Annotated[int, typer.Option(help="Max samples per shard.")] = 1000,
    shard_size_mb: Annotated[float, typer.Option(help="Max shard size in MiB.")] = 512.0,
    workers: Annotated[int, typer.Option(help="Worker processes; output is identical for any value.")] = 1,
    allow_remote: Annotated[bool, typer.Option(help="Allow fetching http(s) image URLs.")] = False,
    image_root: Annotated[Optional[str], typer.Option(help="Local image paths must resolve inside this dir (default: each input file's dir).")] = None,
    strict: Annotated[bool, typer.Option(help="Stop at the first rejected record.")] = False,
    max_image_pixels: Annotated[int, typer.Option(help="Reject images whose declared size exceeds this.")] = 64_000_000,
    max_images_per_record: Annotated[int, typer.Option(help="Reject records with more images.")] = 64,
    max_line_bytes: Annotated[int, typer.Option(help="Reject input lines longer than this.")] = 256 * 1024 * 1024,
    max_zstd_window: Annotated[int, typer.Option(help="Max zstd window (bytes) an input may demand.")] = 1 << 27,
    min_image_side: Annotated[int, typer.Option(help="Reject images with a side shorter than this (pixels).")] = 4,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    train_on_roles: Annotated[str, typer.Option(help="Comma list of roles whose text is trained: assistant, tool, user, system.")] = "assistant",
    train_on_eos: Annotated[str, typer.Option(help="End-of-turn tokens trained: all | turn | last | none.")] = "turn",
    last_turn_only: Annotated[bool, typer.Option(help="Train only the last trained turn of each record.")] = False,
    tool_calls: Annotated[str, typer.Option(help="A trained turn whose tool_calls the template does not render: reject | drop-from-loss | train-content.")] = "reject",
    reasoning: Annotated[str, typer.Option(help="An assistant's reasoning_content: train (rendered, trained) | context (rendered, not trained) | drop (removed, counted) | reject.")] = "train",
    chat_template: Annotated[Optional[str], typer.Option(help="A .jinja file replacing the processor's chat template (saved with the dataset).")] = None,
    role_boundaries: Annotated[Optional[str], typer.Option(help="TOML of per-role start/end markers, for processors vlmprep does not know.")] = None,
    long_traces: Annotated[str, typer.Option(help="A record longer than --seq-len: truncate (cut the end) | split (step samples, every trained turn kept).")] = "truncate",
    keep_images: Annotated[str, typer.Option(help="Screenshot history per sample: all | last:N (earlier images removed).")] = "all",
    dropped_image_text: Annotated[Optional[str], typer.Option(help="Text that replaces each image --keep-images removes (default: dropped).")] = None,
    min_pixels: Annotated[Optional[int], typer.Option(help="Image resize budget: min pixels per image (saved into DIR/processor).")] = None,
    max_pixels: Annotated[Optional[int], typer.Option(help="Image resize budget: max pixels per image (saved into DIR/processor).")] = None,
    allow_empty: Annotated[bool, typer.Option(help="Exit 0 even when every record is rejected (0 samples).")] = False,
    tasks: Annotated[int, typer.Option(help="Cut the input into this many fixed tasks (DIR/plan.json); 1 = one task.")] = 1,
    task_index: Annotated[Optional[int], typer.Option(help="Run only this task of DIR/plan.json (a Slurm array / indexed job); then `vlmprep merge DIR`.")] = None,
    plan_only: Annotated[bool, typer.Option(help="Write DIR/plan.json (and DIR/processor) and stop.")] = False,
    executor: Annotated[str, typer.Option(help="Who runs the tasks: local (--workers processes) | ray (pip install 'vlmprep[ray]').")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster of --workers CPUs).")] = None,
) -> None:
    """Render, mask, truncate and write chat traces as WebDataset shards."""
    from vlmprep.config import BuildConfig
    from vlmprep.pipeline import build as run_build, build_task
    from vlmprep.summary import format_build_summary, format_plan_summary, format_task_summary

    show_progress = progress and sys.stderr.isatty()
    try:
        if not inputs:
            if task_index is None:
                raise typer.BadParameter("--in is required (only a --task-index run may take its inputs from DIR/plan.json)")
            result = build_task(out, task_index, workers=workers, progress=show_progress)
            typer.echo(format_task_summary(result.task, out))
            return
        cfg = BuildConfig(inputs=tuple(inputs), out=str(out), processor=processor, seq_len=seq_len,
                          image_format=image_format, samples_per_shard=samples_per_shard, shard_size_mb=shard_size_mb,
                          workers=workers, allow_remote=allow_remote, image_root=image_root, strict=strict,
                          max_image_pixels=max_image_pixels, max_images_per_record=max_images_per_record,
                          max_line_bytes=max_line_bytes, max_zstd_window=max_zstd_window,
                          min_image_side=min_image_side, progress=show_progress,
                          train_on_roles=tuple(r.strip() for r in train_on_roles.split(",") if r.strip()),
                          train_on_eos=train_on_eos, last_turn_only=last_turn_only, tool_calls=tool_calls,
                          reasoning=reasoning,
                          chat_template=chat_template, role_boundaries=role_boundaries, long_traces=long_traces,
                          keep_images=parse_keep_images(keep_images), dropped_image_text=dropped_image_text,
                          min_pixels=min_pixels, max_pixels=max_pixels, allow_empty=allow_empty, tasks=tasks,
                          task_index=task_index, plan_only=plan_only, executor=executor, ray_address=ray_address)
        result = run_build(cfg)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    if result.manifest is not None:
        typer.echo(format_build_summary(result.manifest, out))
    elif result.task is not None:
        typer.echo(format_task_summary(result.task, out))
    else:
        typer.echo(format_plan_summary(result.plan, out))


@app.command()
def merge(
    root: Annotated[Path, typer.Argument(help="A dataset dir whose plan's tasks have all finished.")],
) -> None:
    """Write DIR/manifest.json and rejects.jsonl over all finished tasks of DIR/plan.json (after --task-index runs)."""
    from vlmprep.merge import merge_tasks
    from vlmprep.summary import format_build_summary

    try:
        manifest = merge_tasks(root)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    typer.echo(format_build_summary(manifest, root))


def parse_keep_images(value: str) -> int | None:
    if value == "all":
        return None
    head, _, n = value.partition(":")
    if head != "last" or not n.isdigit():
        raise typer.BadParameter(f"--keep-images {value!r}: use all or last:N, e.g. last:3")
    return int(n)


@app.command()
def verify(
    root: Annotated[Path, typer.Argument(help="A built dataset dir.")],
    quick: Annotated[bool, typer.Option(help="Only the manifest, schemas, shard sizes and sha256s; skip per-sample checks.")] = False,
) -> None:
    """Check shards against the manifest and schemas, and every sample's invariants. Exit 1 on any violation."""
    from vlmprep.verify import verify_dataset

    violations = verify_dataset(root, deep=not quick)
    for v in violations:
        typer.echo(f"FAIL {v}")
    if violations:
        typer.echo(f"{len(violations)} violation(s) in {root}", err=True)
        raise typer.Exit(1)
    typer.echo(f"OK {root}: manifest, shards" + ("" if quick else " and every sample") + " verified")


@app.command()
def inspect(
    path: Annotated[str, typer.Argument(help="A built dataset dir, or raw input (.jsonl / .jsonl.zst / .json, a dir of them).")],
    index: Annotated[Optional[int], typer.Option(help="The record at this 0-based input position (= its shard key).")] = None,
    sample_id: Annotated[Optional[str], typer.Option("--id", help="The sample with this id.")] = None,
    shard: Annotated[Optional[str], typer.Option(help="Only this shard of a built dir, e.g. shard-000001.")] = None,
    limit: Annotated[int, typer.Option(help="Show at most this many samples (or rejects).")] = 3,
    only: Annotated[Optional[str], typer.Option(help="truncated | rejected (raw input: why build would reject it).")] = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="A table of token index, id, mask, type id and piece.")] = False,
    html: Annotated[Optional[str], typer.Option(help="Write a self-contained HTML report to this file instead.")] = None,
    like: Annotated[Optional[str], typer.Option(help="Raw input: render with this built dir's processor and build options.")] = None,
    processor: Annotated[Optional[str], typer.Option(help="Raw input: as for build (default builtin:qwen2-vl).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Raw input: as for build (default 8192).")] = None,
    train_on_roles: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    train_on_eos: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    last_turn_only: Annotated[Optional[bool], typer.Option(help="Raw input: as for build.")] = None,
    tool_calls: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    role_boundaries: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    image_root: Annotated[Optional[str], typer.Option(help="Raw input: as for build.")] = None,
    allow_remote: Annotated[Optional[bool], typer.Option(help="Raw input: as for build.")] = None,
) -> None:
    """Show exactly what is trained: decoded samples with trained spans marked, images collapsed, facts."""
    from vlmprep.inspector import InspectConfig, run_inspect

    try:
        roles = None if train_on_roles is None else tuple(r.strip() for r in train_on_roles.split(",") if r.strip())
        cfg = InspectConfig(path=path, index=index, id=sample_id, shard=shard, limit=limit, only=only, tokens=tokens,
                            html=html, like=like, processor=processor, seq_len=seq_len, train_on_roles=roles,
                            train_on_eos=train_on_eos, last_turn_only=last_turn_only, tool_calls=tool_calls,
                            chat_template=chat_template, role_boundaries=role_boundaries, image_root=image_root,
                            allow_remote=allow_remote)
        run_inspect(cfg)
    except (UserError, ValueError, OSError) as e:
        _fail(e)


@app.command()
def stats(
    root: Annotated[Path, typer.Argument(help="A built dataset dir.")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
) -> None:
    """Dataset summary from the manifest and the shards: tokens, trained ratio, images, lengths, truncation, rejects."""
    import json

    from vlmprep.stats import compute_stats, format_stats

    try:
        st = compute_stats(root)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    typer.echo(json.dumps(st, indent=2, sort_keys=True) if json_out else format_stats(st))


def main() -> None:
    app()

"""Thin CLI: parse options, build a config, call the pipeline, print a summary. No logic lives here."""
from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmprep.processors.builtin import builtin_names
from vlmprep.config import (EOS_POLICIES, EXECUTORS, IMAGE_FORMATS, LONG_TRACES, REASONING_POLICIES, ROLES,
                            TOOL_CALL_POLICIES)
from vlmprep.processors.load import bundled_templates
from vlmprep.shards.summary import plural
from vlmprep.types import UserError, printable

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Offline VLM SFT data: render, mask, truncate and shard chat traces; inspect the result.")


@app.callback()
def _root() -> None:
    """vlmprep: offline VLM SFT data preparation."""


def _fail(e: BaseException) -> None:
    if os.environ.get("VLMPREP_DEBUG"):
        raise e
    typer.echo(f"error: {printable(str(e))}", err=True)  # a path or record text may hold a lone surrogate
    raise typer.Exit(1)


def _keep_images_ok(value: str | None) -> str | None:
    if value is not None:
        parse_keep_images(value)
    return value


def _roles_ok(value: str | None) -> str | None:
    if value is not None and (not _roles(value) or set(_roles(value)) - set(ROLES)):
        raise typer.BadParameter(f"{value!r}: use a comma list of {', '.join(ROLES)}, e.g. assistant,tool")
    return value


def _roles(value: str) -> tuple[str, ...]:
    return tuple(r.strip() for r in value.split(",") if r.strip())


def _choice(name: str, values: tuple[str, ...]) -> type[enum.Enum]:
    """An Enum over a config tuple, so typer lists and checks the choices at parse time (the tuple stays the one list)."""
    return enum.Enum(name, {v: v for v in values}, type=str)


def _v(choice: enum.Enum | str | None) -> str | None:
    return choice.value if isinstance(choice, enum.Enum) else choice


EosPolicy, ToolCallPolicy = _choice("EosPolicy", EOS_POLICIES), _choice("ToolCallPolicy", TOOL_CALL_POLICIES)
ReasoningPolicy = _choice("ReasoningPolicy", REASONING_POLICIES)
LongTraces, ImageFormat, Executor = (_choice("LongTraces", LONG_TRACES), _choice("ImageFormat", IMAGE_FORMATS),
                                     _choice("Executor", EXECUTORS))


_INPUT, _RENDER, _IMAGES, _AGENT = "Input", "Rendering and masks", "Images", "Agent traces"
_LIMITS, _OUTPUT, _SCALE = "Limits", "Output", "Scale-out"
_BUILTINS = " | ".join(f"builtin:{n}" for n in builtin_names())

# Options that change what a record renders to, declared once: `build` takes them, and so does `inspect` on raw input
# (there None means "not given": the value of --like's dataset, else build's default).
ProcessorOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_RENDER, help=f"{_BUILTINS} | a local processor dir | a hub id.")]
SeqLenOpt = Annotated[Optional[int], typer.Option(rich_help_panel=_RENDER, help="Max tokens per sample; cuts never split an image.")]
TrainOnRolesOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_RENDER, callback=_roles_ok, help=f"Comma list of roles whose text is trained: {', '.join(ROLES)}.")]
TrainOnEosOpt = Annotated[Optional[EosPolicy], typer.Option(rich_help_panel=_RENDER, help="End-of-turn tokens trained.")]
LastTurnOnlyOpt = Annotated[Optional[bool], typer.Option(rich_help_panel=_RENDER, help="Train only the last trained turn of each record.")]
ToolCallsOpt = Annotated[Optional[ToolCallPolicy], typer.Option(rich_help_panel=_RENDER, help="A trained turn whose tool_calls the template does not render.")]
ReasoningOpt = Annotated[Optional[ReasoningPolicy], typer.Option(rich_help_panel=_RENDER, help="An assistant's reasoning_content: train (rendered, trained) | context (rendered, not trained) | drop (removed, counted) | reject.")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_RENDER, help=f"A .jinja file or a bundled template's name ({', '.join(bundled_templates())}) replacing the processor's chat template (saved with the dataset).")]
RoleBoundariesOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_RENDER, help="TOML of per-role start/end markers, for processors vlmprep does not know.")]
ImageRootOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_INPUT, help="Local image paths must resolve inside this dir (default: each input file's dir).")]
AllowRemoteOpt = Annotated[Optional[bool], typer.Option(rich_help_panel=_INPUT, help="Allow fetching http(s) image URLs.")]
LongTracesOpt = Annotated[Optional[LongTraces], typer.Option(rich_help_panel=_AGENT, help="A record longer than --seq-len: truncate (cut the end) | split (step samples, every trained turn kept).")]
KeepImagesOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_AGENT, callback=_keep_images_ok, help="Screenshot history per sample: all | last:N (earlier images removed).")]
DroppedImageTextOpt = Annotated[Optional[str], typer.Option(rich_help_panel=_AGENT, help="Text that replaces each image --keep-images removes (default: dropped).")]
MinPixelsOpt = Annotated[Optional[int], typer.Option(rich_help_panel=_IMAGES, help="Image resize budget: min pixels per image (saved into DIR/processor).")]
MaxPixelsOpt = Annotated[Optional[int], typer.Option(rich_help_panel=_IMAGES, help="Image resize budget: max pixels per image (saved into DIR/processor).")]
VideoFpsOpt = Annotated[Optional[float], typer.Option(rich_help_panel=_IMAGES, help="Video frames sampled per second, unless a part sets fps (saved into DIR/processor; default: the processor's, else 2).")]
VideoMaxFramesOpt = Annotated[Optional[int], typer.Option(rich_help_panel=_IMAGES, help="Most frames sampled from a video, unless a part sets max_frames (saved into DIR/processor).")]


@app.command()
def build(
    out: Annotated[Path, typer.Option("--out", rich_help_panel=_OUTPUT, help="Output dataset dir (shards, manifest, processor).")],
    inputs: Annotated[Optional[list[str]], typer.Option("--in", rich_help_panel=_INPUT, help="Input .jsonl / .jsonl.zst / .json files, globs or dirs (optional with --task-index when DIR/plan.json exists).")] = None,
    image_root: ImageRootOpt = None,
    allow_remote: AllowRemoteOpt = False,
    processor: ProcessorOpt = "builtin:qwen2-vl",
    seq_len: SeqLenOpt = 8192,
    train_on_roles: TrainOnRolesOpt = "assistant",
    train_on_eos: TrainOnEosOpt = "turn",
    last_turn_only: LastTurnOnlyOpt = False,
    tool_calls: ToolCallsOpt = "reject",
    reasoning: ReasoningOpt = "train",
    chat_template: ChatTemplateOpt = None,
    role_boundaries: RoleBoundariesOpt = None,
    image_format: Annotated[ImageFormat, typer.Option(rich_help_panel=_IMAGES, help="How images are stored (see README, Image formats).")] = "zstd",
    min_pixels: MinPixelsOpt = None,
    max_pixels: MaxPixelsOpt = None,
    video_fps: VideoFpsOpt = None,
    video_max_frames: VideoMaxFramesOpt = None,
    long_traces: LongTracesOpt = "truncate",
    keep_images: KeepImagesOpt = "all",
    dropped_image_text: DroppedImageTextOpt = None,
    strict: Annotated[bool, typer.Option(rich_help_panel=_LIMITS, help="Stop at the first rejected record.")] = False,
    max_reject_fraction: Annotated[float, typer.Option(rich_help_panel=_LIMITS, min=0.0, max=1.0, help="Exit 1 (after writing everything) when more than this share of the records is rejected, naming the fix; 1 = never.")] = 0.05,
    allow_empty: Annotated[bool, typer.Option(rich_help_panel=_LIMITS, help="Exit 0 even when every record is rejected (0 samples).")] = False,
    max_image_pixels: Annotated[int, typer.Option(rich_help_panel=_LIMITS, help="Reject images whose declared size exceeds this.")] = 64_000_000,
    max_images_per_record: Annotated[int, typer.Option(rich_help_panel=_LIMITS, help="Reject records with more images.")] = 64,
    max_line_bytes: Annotated[int, typer.Option(rich_help_panel=_LIMITS, help="Reject input lines longer than this.")] = 256 * 1024 * 1024,
    max_zstd_window: Annotated[int, typer.Option(rich_help_panel=_LIMITS, help="Max zstd window (bytes) an input may demand.")] = 1 << 27,
    min_image_side: Annotated[int, typer.Option(rich_help_panel=_LIMITS, help="Reject images with a side shorter than this (pixels).")] = 4,
    samples_per_shard: Annotated[int, typer.Option(rich_help_panel=_OUTPUT, help="Max samples per shard.")] = 1000,
    shard_size_mb: Annotated[float, typer.Option(rich_help_panel=_OUTPUT, help="Max shard size in MiB.")] = 512.0,
    overwrite: Annotated[bool, typer.Option(rich_help_panel=_OUTPUT, help="Replace a dataset built with other options in --out, or build beside files that are not a dataset's.")] = False,
    progress: Annotated[bool, typer.Option(rich_help_panel=_OUTPUT, help="Show a progress bar.")] = True,
    workers: Annotated[int, typer.Option(rich_help_panel=_SCALE, help="Worker processes; output is identical for any value.")] = 1,
    tasks: Annotated[int, typer.Option(rich_help_panel=_SCALE, help="Cut the input into this many fixed tasks (DIR/plan.json); 1 = one task.")] = 1,
    task_index: Annotated[Optional[int], typer.Option(rich_help_panel=_SCALE, help="Run only this task of DIR/plan.json (a Slurm array / indexed job); then `vlmprep merge DIR`.")] = None,
    plan_only: Annotated[bool, typer.Option(rich_help_panel=_SCALE, help="Write DIR/plan.json (and DIR/processor) and stop.")] = False,
    executor: Annotated[Executor, typer.Option(rich_help_panel=_SCALE, help="Who runs the tasks: local (--workers processes) | ray (pip install 'vlmprep\\[ray]').")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(rich_help_panel=_SCALE, help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster of --workers CPUs).")] = None,
) -> None:
    """Render, mask, truncate and write chat traces as WebDataset shards."""
    show_progress = progress and sys.stderr.isatty()
    try:
        if inputs:  # before the heavy imports (torch, transformers): the first second says what is happening
            from vlmprep.records import expand_inputs

            files = expand_inputs(inputs)
            size = sum(f.stat().st_size for f in files)
            typer.echo(f"vlmprep build: reading {plural(len(files), 'input file')} ({size / 1e6:.1f} MB) with "
                       f"{processor} into {out} ...", err=True)
        from vlmprep.config import BuildConfig
        from vlmprep.build.pipeline import build as run_build, build_task
        from vlmprep.shards.summary import format_build_summary, format_plan_summary, format_task_summary

        if not inputs:
            if task_index is None:
                raise typer.BadParameter("--in is required (only a --task-index run may take its inputs from DIR/plan.json)")
            result = build_task(out, task_index, workers=workers, progress=show_progress)
            typer.echo(format_task_summary(result.task, out))
            return
        cfg = BuildConfig(inputs=tuple(inputs), out=str(out), processor=processor, seq_len=seq_len,
                          image_format=_v(image_format), samples_per_shard=samples_per_shard, shard_size_mb=shard_size_mb,
                          workers=workers, allow_remote=allow_remote, image_root=image_root, strict=strict,
                          max_image_pixels=max_image_pixels, max_images_per_record=max_images_per_record,
                          max_line_bytes=max_line_bytes, max_zstd_window=max_zstd_window,
                          min_image_side=min_image_side, progress=show_progress,
                          train_on_roles=_roles(train_on_roles), train_on_eos=_v(train_on_eos),
                          last_turn_only=last_turn_only, tool_calls=_v(tool_calls),
                          reasoning=_v(reasoning),
                          chat_template=chat_template, role_boundaries=role_boundaries, long_traces=_v(long_traces),
                          keep_images=parse_keep_images(keep_images), dropped_image_text=dropped_image_text,
                          min_pixels=min_pixels, max_pixels=max_pixels, video_fps=video_fps,
                          video_max_frames=video_max_frames, allow_empty=allow_empty,
                          max_reject_fraction=max_reject_fraction, overwrite=overwrite, tasks=tasks,
                          task_index=task_index, plan_only=plan_only, executor=_v(executor), ray_address=ray_address)
        result = run_build(cfg)
    except (UserError, ValueError, OSError) as e:
        if getattr(e, "manifest", None) is not None:  # RejectsError: complete but rejected too much
            from vlmprep.shards.summary import format_build_summary

            typer.echo(format_build_summary(e.manifest, out))
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
    max_reject_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="As for build: exit 1 (after writing everything) when more than this share of the records is rejected; 1 = never.")] = 0.05,
    allow_empty: Annotated[bool, typer.Option(help="As for build: exit 0 even when every record is rejected.")] = False,
) -> None:
    """Write DIR/manifest.json and rejects.jsonl over all finished tasks of DIR/plan.json (after --task-index runs)."""
    from vlmprep.build.merge import merge_tasks
    from vlmprep.build.pipeline import RejectsError, check_rejects
    from vlmprep.shards.summary import format_build_summary

    try:
        manifest = merge_tasks(root)
        check_rejects(manifest, root, allow_empty=allow_empty, max_reject_fraction=max_reject_fraction)
    except RejectsError as e:
        typer.echo(format_build_summary(e.manifest, root))
        _fail(e)
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
    from vlmprep.tools.verify import verify_dataset

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
    processor: ProcessorOpt = None,
    seq_len: SeqLenOpt = None,
    train_on_roles: TrainOnRolesOpt = None,
    train_on_eos: TrainOnEosOpt = None,
    last_turn_only: LastTurnOnlyOpt = None,
    tool_calls: ToolCallsOpt = None,
    reasoning: ReasoningOpt = None,
    chat_template: ChatTemplateOpt = None,
    role_boundaries: RoleBoundariesOpt = None,
    image_root: ImageRootOpt = None,
    allow_remote: AllowRemoteOpt = None,
    long_traces: LongTracesOpt = None,
    keep_images: KeepImagesOpt = None,
    dropped_image_text: DroppedImageTextOpt = None,
    min_pixels: MinPixelsOpt = None,
    max_pixels: MaxPixelsOpt = None,
) -> None:
    """Show exactly what is trained: decoded samples with trained spans marked, images collapsed, facts."""
    from vlmprep.tools.inspector import InspectConfig, run_inspect

    try:
        roles = None if train_on_roles is None else _roles(train_on_roles)
        keep = None if keep_images is None else parse_keep_images(keep_images)
        cfg = InspectConfig(path=path, index=index, id=sample_id, shard=shard, limit=limit, only=only, tokens=tokens,
                            html=html, like=like, processor=processor, seq_len=seq_len, train_on_roles=roles,
                            train_on_eos=_v(train_on_eos), last_turn_only=last_turn_only, tool_calls=_v(tool_calls),
                            reasoning=_v(reasoning), chat_template=chat_template, role_boundaries=role_boundaries,
                            image_root=image_root,
                            allow_remote=allow_remote, long_traces=_v(long_traces),
                            keep_images=None if keep_images is None else ("all" if keep is None else keep),
                            dropped_image_text=dropped_image_text, min_pixels=min_pixels, max_pixels=max_pixels)
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

    from vlmprep.tools.stats import compute_stats, format_stats

    try:
        st = compute_stats(root)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    typer.echo(json.dumps(st, indent=2, sort_keys=True) if json_out else format_stats(st))


def main() -> None:
    app()

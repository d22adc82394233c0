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
    inputs: Annotated[list[str], typer.Option("--in", help="Input .jsonl / .jsonl.zst / .json files, globs or dirs.")],
    out: Annotated[Path, typer.Option("--out", help="Output dataset dir (shards, manifest, processor).")],
    processor: Annotated[str, typer.Option(help="builtin:qwen2-vl | builtin:qwen2.5-vl | local processor dir | hub id.")] = "builtin:qwen2-vl",
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
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Render, mask, truncate and write chat traces as WebDataset shards."""
    from vlmprep.config import BuildConfig
    from vlmprep.pipeline import build as run_build
    from vlmprep.summary import format_build_summary

    try:
        cfg = BuildConfig(inputs=tuple(inputs), out=str(out), processor=processor, seq_len=seq_len,
                          image_format=image_format, samples_per_shard=samples_per_shard, shard_size_mb=shard_size_mb,
                          workers=workers, allow_remote=allow_remote, image_root=image_root, strict=strict,
                          max_image_pixels=max_image_pixels, max_images_per_record=max_images_per_record,
                          max_line_bytes=max_line_bytes, progress=progress and sys.stderr.isatty())
        result = run_build(cfg)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    typer.echo(format_build_summary(result.manifest, out))


def main() -> None:
    app()

"""Thin CLI: parse options, build a config, call the pipeline, print a summary. No logic lives here: the build
options are generated from BuildConfig's field declarations (vlmprep/config.py)."""

from __future__ import annotations

import enum
import functools
import os
import sys
from inspect import Parameter, Signature, signature
from pathlib import Path
from typing import Annotated, Optional

import typer

from vlmprep import cli_versions
from vlmprep.builder.watch_config import NOT_WATCH_OPTIONS, WATCH_FIELDS, WatchConfig
from vlmprep.config import FIELDS, INSPECT_FIELDS, PER_VERSION, RAW_OPTIONS, REQUIRED, InspectConfig, default
from vlmprep.shards.summary import plural
from vlmprep.types import UserError
from vlmprep_schemas.terminal import for_terminal

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline VLM SFT data: render, mask, truncate and shard chat traces; inspect the result.",
)


@app.callback()
def _root() -> None:
    """vlmprep: offline VLM SFT data preparation."""


def _echo(text: str, *, err: bool = False, lines: bool = False) -> None:
    """Print what a command says, its text from a dataset, bucket or server escaped for the terminal (no control
    sequence acts; `lines`: a multi-line report keeps its newlines, else the line stays one line)."""
    typer.echo(for_terminal(text, lines=lines), err=err)


def _fail(e: BaseException) -> None:
    if os.environ.get("VLMPREP_DEBUG"):
        raise e
    _echo(f"error: {e}", err=True)  # record text, a name or a lone surrogate in it: escaped, one line
    raise typer.Exit(1)


def _local_dir(value: str, command: str, shards: list[str] | None = None, since: str | None = None) -> tuple[Path, str]:
    """verify, stats and inspect read a local dir: a dataset URL is copied into the cache first (shards/remote.py;
    `shards`: only these of its shards; `since`: that version's record too) and the copy read. -> (the dir to read,
    what to call it: the URL for a copy). A URL as a Path (`http:/host/...`) would be called missing."""
    from vlmprep.shards.remote import fetch_dataset, is_dataset_url

    if not is_dataset_url(value):
        return Path(value), str(Path(value))
    from vlmprep.tools.per_shard import shard_progress

    try:
        with shard_progress("fetch", "files") as progress:
            return fetch_dataset(
                value,
                shards=shards,
                on_file=progress,
                say=lambda line: _echo(f"vlmprep {command}: {line}", err=True),
                since=since,
            ), value
    except UserError as e:
        _fail(e)


def _parsed_ok(parse):
    """A callback that checks a spelled option (e.g. last:N) at parse time, with the config's own message."""

    def check(value: str | None) -> str | None:
        if value is not None:
            try:
                parse(value)
            except ValueError as e:
                raise typer.BadParameter(str(e)) from None
        return value

    return check


def _option(name: str, f, *, given_only: bool) -> Parameter:
    """The typer option of one config field, from its declaration (config.opt). given_only: every default is None,
    meaning "not given" (inspect: the value of --like's dataset, else build's default)."""
    m = f.metadata
    per_version = name in PER_VERSION and not given_only  # build's own options (inspect takes a few of them too)
    if m["choices"]:  # an Enum over the config's tuple, so typer lists and checks the choices at parse time
        typ = enum.Enum(name, {v: v for v in m["choices"]}, type=str)
    else:
        typ = m["cli_type"] or (str if m["parse"] else _TYPES[f.type.removesuffix(" | None")])
    low, high = m["bounds"] or (None, None)
    info = typer.Option(
        *[m["flag"]] if m["flag"] else [],
        rich_help_panel=m["group"] or None,
        help=m["help"] + (PER_VERSION_HELP if per_version else ""),
        min=low,
        max=high,
        callback=_parsed_ok(m["parse"]) if m["parse"] else None,
    )
    if given_only:
        default = None
    elif f.default is REQUIRED:  # a repeatable --in may be missing: the command says when it is needed
        default = None if m["cli_type"] == list[str] else Parameter.empty
    else:
        default = m["spelled"] or f.default
    return Parameter(
        name,
        Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[Optional[typ] if default is None else typ, info],
    )


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
PER_VERSION_HELP = " Per version: may differ between --append versions."  # config.PER_VERSION's mark in --help


def _with_options(names, *, fields=FIELDS, given_only: bool = False):
    """Append the generated options of these config fields (BuildConfig's unless `fields` says) to a command's own
    parameters."""

    def add(fn):
        own = [p for p in signature(fn, eval_str=True).parameters.values() if p.kind is not Parameter.VAR_KEYWORD]
        params = own + [_option(n, fields[n], given_only=given_only) for n in names]
        fn.__signature__ = Signature(params)
        fn.__annotations__ = {p.name: p.annotation for p in params}
        return fn

    return add


def _config_values(opts: dict, names) -> dict:
    """Parsed option values -> BuildConfig values (choices as strings, spelled options parsed; None stays None)."""
    values = {}
    for name in names:
        v = opts[name]
        v = v.value if isinstance(v, enum.Enum) else v
        values[name] = FIELDS[name].metadata["parse"](v) if v is not None and FIELDS[name].metadata["parse"] else v
    return values


@app.command()
@_with_options([name for name, f in FIELDS.items() if f.metadata["group"]])
def build(ctx: typer.Context, **opts) -> None:
    """Render, mask, truncate and write chat traces as WebDataset shards."""
    out, inputs, task_index = opts["out"], opts["inputs"], opts["task_index"]
    show_progress = opts["progress"] and sys.stderr.isatty()
    try:
        values = _config_values(opts, FIELDS.keys() & opts.keys())
        if opts["append"] and inputs:  # the sample options not given are the dataset's own
            from vlmprep.builder.append import inherit_options

            values = inherit_options(values, str(out), given=_given(ctx, values))
        if inputs:  # before the heavy imports (torch, transformers): the first second says what is happening
            from vlmprep.ingest import expand_inputs, size_of

            files = expand_inputs(inputs)
            size = sum(map(size_of, files))
            _echo(
                f"vlmprep build: reading {plural(len(files), 'input file')} ({size / 1e6:.1f} MB) with "
                f"{values['processor']} into {out} ...",
                err=True,
            )
        from vlmprep.builder.pipeline import build as run_build
        from vlmprep.builder.pipeline import build_task
        from vlmprep.builder.plan import format_plan_summary
        from vlmprep.config import BuildConfig
        from vlmprep.shards.summary import format_build_summary, format_task_summary

        if not inputs:
            if task_index is None:
                raise typer.BadParameter(
                    "--in is required (only a --task-index run may take its inputs from DIR/plan.json)"
                )
            result = build_task(out, task_index, workers=opts["workers"], progress=show_progress)
            _echo(format_task_summary(result.task, out), lines=True)
            return
        result = run_build(
            BuildConfig(**{**values, "inputs": tuple(inputs), "out": str(out), "progress": show_progress})
        )
    except (UserError, ValueError, OSError) as e:
        if getattr(e, "manifest", None) is not None:  # RejectsError: complete but rejected too much
            from vlmprep.shards.summary import format_build_summary

            version = e.version if opts["append"] and getattr(e, "version", None) else None
            _echo(format_build_summary(e.manifest, out, version=version), lines=True)
        _fail(e)
    if result.added is not None:  # --append: what the new version added
        _echo(format_build_summary(result.added, out, version=result.manifest.version["number"]), lines=True)
    elif result.manifest is not None and opts["append"]:
        return  # nothing new: said on stderr, the dataset unchanged
    elif result.manifest is not None:
        _echo(format_build_summary(result.manifest, out), lines=True)
    elif result.task is not None:
        _echo(format_task_summary(result.task, out), lines=True)
    else:
        _echo(format_plan_summary(result.plan, out), lines=True)


def _given(ctx: typer.Context, names) -> set[str]:
    """The options of `names` given on the command line (or by an environment variable), not left at a default."""
    return {
        n for n in names if getattr(ctx.get_parameter_source(n), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")
    }


@app.command()
@_with_options([n for n, f in FIELDS.items() if f.metadata["group"] and n not in NOT_WATCH_OPTIONS])
@_with_options(WATCH_FIELDS, fields=WATCH_FIELDS)  # watch's own options first, from WatchConfig
def watch(**opts) -> None:
    """Watch an input location (--in: a dir, a glob, an s3:// gs:// hf:// prefix) and build the objects that land
    there into --out, each cycle's as ONE new version, exactly once (docs/datasets-that-grow.md, Watch).

    The first cycle builds the dataset where --out holds none (with these build options; otherwise they must be the
    dataset's). Exit 0 after --once or SIGTERM (the version in progress commits or is abandoned whole), 1 on a fault
    it cannot retry, 75 when --once met a transient one."""
    from vlmprep.builder.watch import run_watch
    from vlmprep.config import BuildConfig

    try:
        if not opts["inputs"]:
            raise typer.BadParameter("--in is required: the location to watch (a dir, a glob or a store's prefix)")
        values = _config_values(opts, FIELDS.keys() & opts.keys())
        own = {n: (v.value if isinstance(v, enum.Enum) else v) for n, v in opts.items() if n in WATCH_FIELDS}
        build_cfg = BuildConfig(**{**values, "inputs": tuple(opts["inputs"]), "out": str(opts["out"])})
        code = run_watch(WatchConfig(build=build_cfg, **own), echo=_echo)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    raise typer.Exit(code)


# merge judges a dataset as build does, by build's defaults (declared once, on BuildConfig).
def _share(when: str, never: int):
    """A merge check's 0..1 share option, as build's."""
    return typer.Option(
        min=0.0, max=1.0, help=f"As for build: exit 1 (after writing everything) when {when}; {never} = never."
    )


@app.command()
def merge(
    root: Annotated[str, typer.Argument(help="A dataset dir (or store prefix) whose plan's tasks have all finished.")],
    max_reject_fraction: Annotated[float, _share("more than this share of the records is rejected", 1)] = default(
        "max_reject_fraction"
    ),
    min_turn_coverage: Annotated[
        float, _share("fewer than this share of the assistant turns to train land in a sample", 0)
    ] = default("min_turn_coverage"),
    allow_empty: Annotated[
        bool, typer.Option(help="As for build: exit 0 even when every record is rejected.")
    ] = default("allow_empty"),
) -> None:
    """Write DIR/manifest.json and rejects.jsonl over all finished tasks of DIR/plan.json (after --task-index runs).

    Reads every sample's line of the tasks' sample lists (ids repeated across tasks are rejected here) and hashes
    every shard: time grows with the sample count and the bytes (docs/scale.md)."""
    from vlmprep.builder.pipeline import RejectsError
    from vlmprep.builder.pipeline import merge as merge_dir
    from vlmprep.shards.summary import format_build_summary

    try:
        manifest = merge_dir(
            root, allow_empty=allow_empty, max_reject_fraction=max_reject_fraction, min_turn_coverage=min_turn_coverage
        )
    except RejectsError as e:
        _echo(format_build_summary(e.manifest, root), lines=True)
        _fail(e)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    _echo(format_build_summary(manifest, root), lines=True)


DatasetArg = Annotated[
    str,
    typer.Argument(
        help="A built dataset dir, or its URL (s3://, gs://, hf://, http(s)://: copied into the cache first)."
    ),
]


def _workers(work: str, result: str):
    """The --workers option of a command that reads every shard: `work` done at once, `result` the same for any."""
    return Annotated[
        Optional[int],
        typer.Option(
            min=1,
            show_default="the CPUs this process may use",
            help=f"Processes that {work} at once; {result} the same for any value.",
        ),
    ]


@app.command()
def verify(
    root: DatasetArg,
    quick: Annotated[
        bool, typer.Option(help="Only the manifest, schemas, shard sizes and sha256s; skip per-sample checks.")
    ] = False,
    workers: _workers("check shards", "the report is") = None,
) -> None:
    """Check shards against the manifest and schemas, and every sample's invariants. Exit 1 on any violation.

    Reads every sample (every byte of every shard for the sha256s, --quick included): time grows with the dataset's
    size (docs/scale.md), divided among --workers processes."""
    from vlmprep.tools.per_shard import shard_progress
    from vlmprep.tools.verify import verify_dataset

    root, shown = _local_dir(root, "verify")

    try:
        with shard_progress("verify") as progress:
            violations = verify_dataset(
                root, deep=not quick, workers=workers or len(os.sched_getaffinity(0)), on_shard=progress
            )
    except UserError as e:
        _fail(e)
    for v in violations:
        _echo(f"FAIL {v}")
    if violations:
        _echo(f"{len(violations)} violation(s) in {shown}", err=True)
        raise typer.Exit(1)
    _echo(f"OK {shown}: manifest, shards" + ("" if quick else " and every sample") + " verified")


@app.command()
@_with_options(RAW_OPTIONS, given_only=True)
@_with_options(INSPECT_FIELDS, fields=INSPECT_FIELDS)  # inspect's own options first, from InspectConfig
def inspect(
    path: Annotated[
        str,
        typer.Argument(
            help="A built dataset dir or its URL, or raw input (.jsonl / .jsonl.zst / .json, a dir of them; "
            "or a URL of one)."
        ),
    ],
    **opts,
) -> None:
    """Show exactly what is trained: decoded samples with trained spans marked, images collapsed, facts.

    --id and --index find their samples through the shards' sample index (reading the index files, not the samples);
    a dataset built without one, and --only truncated, read every sample's meta until --limit is reached.

    A dataset URL is copied into the cache first (docs/inspect-and-stats.md): the shards that hold the first --limit
    samples, --shard's alone (--only rejected: none), or, for --id, --index and --only truncated, every shard."""
    import dataclasses

    from vlmprep.ingest import SUFFIXES
    from vlmprep.tools.inspector import run_inspect, shards_read

    try:
        raw = {k: v for k, v in _config_values(opts, RAW_OPTIONS).items() if v is not None}
        if opts["keep_images"] == "all":
            raw["keep_images"] = "all"  # given, unlike None: overrides --like's last:N
        cfg = InspectConfig(path=path, **{name: opts[name] for name in INSPECT_FIELDS}, build_options=raw)
        if not path.endswith(SUFFIXES):  # raw input in a store is read where it is, as build reads an --in URL
            cfg = dataclasses.replace(cfg, path=str(_local_dir(path, "inspect", shards_read(cfg))[0]))
        run_inspect(cfg)
    except (UserError, ValueError, OSError) as e:
        _fail(e)


@app.command()
def stats(
    root: DatasetArg,
    json_out: Annotated[bool, typer.Option("--json", help="Print the numbers as JSON.")] = False,
    html: Annotated[
        Optional[str], typer.Option(help="Also write a self-contained HTML report with histograms to this file.")
    ] = None,
    samples: Annotated[
        Optional[str],
        typer.Option(
            help="Also write one Parquet row per sample to this file (id, version, source, shard, tokens, trained "
            "tokens, images, image tokens, truncated, split part): for pandas, DuckDB, Polars."
        ),
    ] = None,
    rejects: Annotated[
        Optional[str],
        typer.Option(
            help="Also write one Parquet row per reject line of the version (rejects.jsonl and each later "
            "version's) to this file (id, version, source, reason, message)."
        ),
    ] = None,
    workers: _workers("read shards", "the numbers are") = None,
    since: Annotated[
        Optional[str],
        typer.Option(
            help="Only what the versions after this one (vM or a tag) added: their inputs, samples and rejects "
            "(--samples and --rejects tables too)."
        ),
    ] = None,
) -> None:
    """Dataset summary from the manifest and the shards: tokens, trained ratio, images, lengths, truncation, rejects,
    each input file's turn coverage, distributions, and warnings with their fixes.

    Reads every sample's arrays and meta (counts recomputed and checked against the manifest): time grows with the
    sample count (docs/scale.md), divided among --workers processes."""
    import json

    from vlmprep.tools.per_shard import shard_progress
    from vlmprep.tools.stats import compute_stats
    from vlmprep.tools.stats_report import write_outputs
    from vlmprep.tools.stats_text import format_stats

    root, shown = _local_dir(root, "stats", since=since)

    rows: dict[str, list] | None = {} if samples else None
    try:
        with shard_progress("stats") as progress:
            st = compute_stats(
                root, workers=workers or len(os.sched_getaffinity(0)), on_shard=progress, sample_rows=rows, since=since
            )
        st["dir"] = shown  # a URL's copy by the URL
        written = write_outputs(root, st, rows, html=html, samples=samples, rejects=rejects, since=since)
    except (UserError, ValueError, OSError) as e:
        _fail(e)
    _echo(json.dumps(st, indent=2, sort_keys=True) if json_out else format_stats(st), lines=True)
    for line in written:
        _echo(line, err=json_out)


def _one_line_errors(command):
    """A command whose user errors print as one line (exit 1), as every command's do."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (UserError, ValueError, OSError) as e:
            _fail(e)

    return run


for _command in cli_versions.COMMANDS:  # versions, tag, gc: docs/datasets-that-grow.md
    app.command()(_one_line_errors(_command))


def main() -> None:
    """The `vlmprep` command: parses the command line and runs the subcommand (a user error is one line and exit 1)."""
    app()

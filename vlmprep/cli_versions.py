"""The commands over a dataset's versions (docs/datasets-that-grow.md): `vlmprep versions DIR` (the table, or --json),
`vlmprep tag DIR@vN NAME`, `vlmprep gc DIR --keep N`. Thin, as cli.py: options in, builder/catalog.py and
builder/retention.py do the work, the result printed escaped (what a dataset holds may hold control characters).
cli.py registers them on the app."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from vlmprep.shards.summary import plural
from vlmprep_schemas.terminal import for_terminal

DATASET_HELP = "A dataset dir, or its prefix in a store (s3://, gs://)."


def _say(text: str, *, err: bool = False) -> None:
    typer.echo(for_terminal(text, lines=True), err=err)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _spans(numbers: list[int]) -> str:
    """[1, 2, 3, 5] -> 'v1..v3, v5'."""
    out, start = [], None
    for k, n in enumerate(numbers):
        start = n if start is None else start
        if k + 1 == len(numbers) or numbers[k + 1] != n + 1:
            out.append(f"v{start}" if start == n else f"v{start}..v{n}")
            start = None
    return ", ".join(out)


def versions(
    dataset: Annotated[str, typer.Argument(help=DATASET_HELP)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the versions as JSON.")] = False,
) -> None:
    """List a dataset's versions: number, tags, time, inputs, samples, tokens, bytes, turn coverage.

    Samples, tokens, bytes and coverage are the dataset's as of each version (with what it added); read from the
    version records and tags (each checked), not the shards."""
    from vlmprep.builder.catalog import CatalogError, dataset_files, read_catalog, version_rows

    files, ref = dataset_files(dataset)
    if ref is not None:
        raise CatalogError(f"{dataset}: list the dataset's versions with `vlmprep versions {files.where}`")
    catalog = read_catalog(files)
    rows = version_rows(catalog)
    gone = [n for n in range(1, catalog.latest) if n not in catalog.records]
    if json_out:
        doc = {"dataset": files.where, "latest": catalog.latest, "removed": gone, "versions": rows}
        _say(json.dumps(doc, indent=2, sort_keys=True))
        return
    table = [["version", "tags", "created", "inputs", "samples", "tokens", "bytes", "coverage"]]
    for r in rows:
        added = r["version"] > 1
        table.append(
            [
                f"v{r['version']}",
                ",".join(r["tags"]) or "-",
                str(r["created"] or "-"),
                f"+{r['inputs_added']}" if added else str(r["inputs"]),
                f"{r['samples']} (+{r['samples_added']})" if added else str(r["samples"]),
                str(r["tokens"]),
                _size(r["bytes"]),
                "-" if r["coverage"] is None else f"{r['coverage']:.1%}",
            ]
        )
    head = f"dataset {files.where}: {plural(len(rows), 'version')}, the latest v{catalog.latest}"
    _say("\n".join([head + (f" (removed by gc: {_spans(gone)})" if gone else ""), *_table(table)]))


def tag(
    version: Annotated[str, typer.Argument(help="The version to name: DIR@vN (or DIR@TAG; plain DIR: the latest).")],
    name: Annotated[str, typer.Argument(help="The tag: a letter, then letters, digits, '.', '_', '-' (not vN).")],
    force: Annotated[bool, typer.Option(help="Move the tag where it exists (else refused).")] = False,
    delete: Annotated[
        bool, typer.Option(help="Remove the tag instead (DIR NAME, or DIR@vN NAME to check it).")
    ] = False,
) -> None:
    """Name a version: DIR@NAME then reads it, and gc keeps it.

    A tag that exists is refused in one line unless --force moves it; --delete removes one."""
    from vlmprep.builder.catalog import CatalogError, drop_tag, make_tag

    if delete:
        if force:
            raise CatalogError("--delete removes the tag; --force moves it: pass one of them")
        old = drop_tag(version, name)
        _say(f"removed tag {old.tag} (it named v{old.version})")
        return
    where, made, old = make_tag(version, name, force=force)
    moved = f" (moved from v{old.version})" if old is not None else ""
    _say(f"tagged v{made.version} as {made.tag}{moved}: {where}@{made.tag} reads it")


def gc(
    dataset: Annotated[str, typer.Argument(help=DATASET_HELP)],
    keep: Annotated[int, typer.Option(help="Keep this many of the newest versions (the latest always).")],
    keep_tag: Annotated[
        bool,
        typer.Option(help="Keep every tagged version too; --no-keep-tag removes tagged ones outside --keep, tags too."),
    ] = True,
    dry_run: Annotated[bool, typer.Option(help="Say what would be removed; remove nothing.")] = False,
) -> None:
    """Remove old versions: those outside --keep and not tagged, with the files only they name.

    Removed: their records and the shards and sample indexes no kept version names; never a file a kept version
    names, and every version's rejects and id files stay (later versions read them). Holds the dataset's lock: a
    build, append or watch on it meanwhile is refused (and refuses gc)."""
    from vlmprep.builder.retention import collect

    plan = collect(dataset, keep, keep_tags=keep_tag, dry_run=dry_run, say=lambda line: _say(line, err=True))
    kept = ", ".join(f"v{n} ({why})" for n, why in plan.kept.items())
    if not plan.removed:
        _say(f"gc {dataset}: nothing to remove; keeping {kept}")
        return
    verb = "would remove" if dry_run else "removed"
    _say(
        f"gc {dataset}: {verb} {_spans(plan.removed)} ({plural(len(plan.removed), 'record')}, "
        f"{plural(len(plan.files), 'file')}, {_size(plan.bytes)}"
        + (f", {plural(len(plan.tags), 'tag')}" if plan.tags else "")
        + f"); keeping {kept}"
    )


COMMANDS = (versions, tag, gc)

"""`vlmprep inspect`: a built dataset dir (read through shards/reader.py) or raw input (rendered exactly as build
would) -> the selected samples or rejects -> views printed by show.py or written as HTML by report.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from vlmprep.config import RAW_OPTIONS, InspectConfig
from vlmprep.ingest import SUFFIXES
from vlmprep.shards.dataset import MANIFEST_NAME, SHARD_GLOB
from vlmprep.shards.format import id_hash
from vlmprep.shards.manifest import Manifest, open_dataset, processor_dir, shard_paths, shard_present
from vlmprep.shards.reader import StaleIndex, iter_shard, load_sample_index, sample_at
from vlmprep.shards.versions import dataset_rejects, id_keys, record_id
from vlmprep.tools.inspected import InspectedSample, sample_from_rendered, sample_from_stored
from vlmprep.tools.show import format_plain, format_rich, format_tokens_plain, format_tokens_rich
from vlmprep.tools.view import SampleView, TokenizerView, reject_line, view_sample
from vlmprep.types import RecordError, UserError
from vlmprep_schemas.terminal import for_terminal
from vlmprep_schemas.versions import VersionError, split_ref

# Build options `--like DIR` does not take from a dataset's manifest: where inputs are, what they may read (local
# image dirs, remote URLs, a role-boundaries file) and how the build runs. The user passes them for their own input.
LIKE_SKIPS = frozenset(
    {
        "inputs",
        "out",
        "progress",
        "workers",
        "image_root",
        "allow_remote",
        "role_boundaries",
        "executor",
        "ray_address",
        "tasks",
        "task_index",
        "plan_only",
        "overwrite",
    }
)


class InspectError(UserError):
    """A user-facing inspect fault (bad selection, unsafe or malformed shard member): one line."""


def _iter_dir(cfg: InspectConfig, d: Path, manifest: Manifest) -> Iterator[InspectedSample | dict]:
    if cfg.only == "rejected":
        if cfg.index is not None or cfg.shard is not None:
            raise InspectError(
                "--only rejected on a built dir lists rejects.jsonl, which has no shard or input "
                "position: select with --id, or inspect the raw input with --index"
            )
        yield from _iter_rejects_file(d, manifest, cfg)
        return
    if (cfg.id is not None or cfg.index is not None) and all(e.index for e in manifest.shards):
        try:
            hits = list(_iter_indexed(cfg, d, manifest))
        except StaleIndex:
            hits = None  # a shard changed after its index was written: scan it as if it had none
        if hits is not None:
            yield from hits
            return
    for path in shard_paths(d, manifest, cfg.shard, present=False):  # a URL's copy may hold the first shards only
        for ts in iter_shard(shard_present(path), version=manifest.format_version):
            if cfg.index is not None and int(ts.key[:10]) != cfg.index:
                continue
            if cfg.id is not None or cfg.only == "truncated":
                meta = ts.meta()
                if cfg.id is not None and str(meta.get("id")) != cfg.id:
                    continue
                if cfg.only == "truncated" and not meta.get("truncated"):
                    continue
            yield sample_from_stored(ts)


def _iter_indexed(cfg: InspectConfig, d: Path, manifest: Manifest) -> Iterator[InspectedSample]:
    """--id / --index over a dataset whose shards all have a sample index: the index rows find the samples (by id
    hash, then the id itself; by input position), and only those are read, each by its byte range."""
    paths = shard_paths(d, manifest, cfg.shard)
    entries = {e.name: e for e in manifest.shards}
    want = id_hash(cfg.id) if cfg.id is not None else None
    for path in paths:
        rows = load_sample_index(d, entries[path.name])
        hit = (rows["id"] == np.uint64(want)) if want is not None else np.ones(len(rows), bool)
        if cfg.index is not None:
            hit &= rows["position"] == cfg.index
        for i in np.flatnonzero(hit).tolist():
            ts = sample_at(
                path,
                int(rows["start"][i]),
                int(rows["end"][i]),
                version=manifest.format_version,
                position=int(rows["position"][i]),
            )
            if cfg.id is not None and str(ts.meta().get("id")) != cfg.id:
                continue  # a hash collision
            if cfg.only == "truncated" and not ts.meta().get("truncated"):
                continue
            yield sample_from_stored(ts)


def shards_read(cfg: InspectConfig) -> list[str] | Callable[[Manifest], list[str]] | None:
    """The shards of a built dataset that inspect may read for `cfg`: --shard's alone, none for --only rejected
    (rejects.jsonl); the first shards that hold --limit samples when every sample shows (no --only, --id, --index:
    the manifest's counts say which); else None: any (which shard holds the --limit-th match is known only by
    reading them in order). What the copy of a dataset URL fetches (shards/remote.py)."""
    if cfg.only == "rejected":
        return []
    if cfg.shard is not None:
        return [cfg.shard]
    if cfg.only is None and cfg.id is None and cfg.index is None:
        return lambda manifest: _first_shards(manifest, cfg.limit)
    return None


def _first_shards(manifest: Manifest, samples: int) -> list[str]:
    out, held = [], 0
    for s in manifest.shards:
        if held >= samples:
            break
        out.append(s.name)
        held += s.num_samples
    return out


def _iter_rejects_file(d: Path, manifest: Manifest, cfg: InspectConfig) -> Iterator[dict]:
    """The version's rejects: rejects.jsonl, then each later version's own up to it (an input's that a later
    version rebuilt left out: shards/versions.stale_rejects)."""
    for _, r in dataset_rejects(d, manifest):
        if cfg.id is None or str(r.get("id")) == cfg.id:
            yield r


def _raw_build_config(cfg: InspectConfig):
    from vlmprep.config import BuildConfig

    kw = {}
    if cfg.like is not None:
        like, manifest = open_dataset(cfg.like)  # DIR, DIR@vN or DIR@TAG
        # Not taken from a dataset: where things are and what may be read (LIKE_SKIPS); pass them yourself.
        fields = {f.name for f in dataclasses.fields(BuildConfig)} - LIKE_SKIPS
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in (manifest.config or {}).items() if k in fields}
        # The saved processor is the one that rendered the dataset, chat template included.
        kw.update(processor=str(processor_dir(like, manifest)), chat_template=None)
    kw.update(cfg.build_options)
    if kw.get("keep_images") == "all":
        kw["keep_images"] = None
    return BuildConfig(inputs=(cfg.path,), out="", progress=False, **kw)  # out: inspect writes no dataset


def _refuse_foreign_template(processor, like: str) -> None:
    """--like DIR renders with DIR's saved processor, but not with a chat template that came with the dataset: that
    is Jinja from elsewhere (a loop nested to 10^16 steps hangs any renderer, sandbox or not). A template vlmprep
    ships, or the one its builtin/tiny processor carries, is vlmprep's own; any other the user names themselves."""
    from vlmprep.processors.load import TEMPLATES_DIR, load_processor

    saved = processor.chat_template
    if saved is None or any(saved == p.read_text(encoding="utf-8") for p in TEMPLATES_DIR.glob("*.jinja")):
        return
    spec = str(open_dataset(like)[1].processor.spec or "")
    if spec.startswith(("builtin:", "tiny:")):
        try:
            if load_processor(spec).chat_template == saved:
                return
        except ValueError:  # not a builtin of this vlmprep: foreign
            pass
    raise InspectError(
        f"--like {like}: its saved chat template is not one vlmprep ships, and inspect does not render "
        "a dataset's own template (untrusted Jinja, docs/untrusted-datasets.md): pass --chat-template "
        "with the template it was built with, or --processor with its processor"
    )


def _raw_id_candidate(raw, want: str) -> bool:
    """Cheap pre-filter for --id, mirroring normalize_record's id rule; the rendered id is checked after."""
    from vlmprep.ingest import generated_id, parse_record

    wants = {want, want.rsplit("#", 1)[0]}  # "ID#S" is the S-th sample split from record ID
    if generated_id(raw.source) in wants:
        return True
    try:
        rid = parse_record(raw).get("id")
    except RecordError:
        return False
    return isinstance(rid, (str, int, float)) and not isinstance(rid, bool) and str(rid) in wants


def _iter_raw(cfg: InspectConfig, renderer) -> Iterator[InspectedSample | dict]:
    from vlmprep.ingest import ReadLimits, expand_inputs, iter_records
    from vlmprep.process import reject_entry
    from vlmprep.shards.format import sample_key

    bcfg = renderer.cfg
    seen_ids: set[str] = set()
    for raw in iter_records(expand_inputs(bcfg.inputs), limits=ReadLimits.of(bcfg)):
        if cfg.index is not None and raw.position != cfg.index:
            if raw.position > cfg.index:
                return
            continue
        if cfg.id is not None and not _raw_id_candidate(raw, cfg.id):
            continue
        try:
            samples = renderer.render(raw)
        except RecordError as e:
            samples, rejects = [], [reject_entry(raw, e.reason, e.message)]
        except Exception as e:  # noqa: BLE001 - build counts these as internal_error rejects; so do we
            samples, rejects = [], [reject_entry(raw, "internal_error", f"{type(e).__name__}: {str(e)[:300]}")]
        else:
            rejects = [renderer.lost_turn_entry(raw, i) for i in renderer.lost]
        # Build rejects a record whose id an earlier one used, once and whole; seen only among records rendered
        # here, so exact for a full scan.
        keys = {k for sample in samples for k in id_keys({"id": sample.id, "split": sample.split})}
        if keys & seen_ids:  # a split `a` and a whole `a` are one id, as build has it
            rid = record_id({"id": samples[0].id, "split": samples[0].split})
            samples, rejects = (
                [],
                [
                    {
                        **reject_entry(raw, "duplicate_id", ""),
                        "id": rid,
                        "message": f"id {rid!r} already used by an earlier record",
                    }
                ],
            )
        seen_ids.update(keys if samples else ())
        for sample in samples:
            if cfg.id is not None and sample.id != cfg.id and sample.id.rsplit("#", 1)[0] != cfg.id:
                continue
            if cfg.only == "rejected" or (cfg.only == "truncated" and not sample.truncated):
                continue
            yield sample_from_rendered(sample, sample_key(raw.position, sample.split))
        if cfg.only in (None, "rejected"):
            yield from rejects


def _built_dir(path: str) -> Path | None:
    """The dataset dir that `path` (DIR, DIR@vN or DIR@TAG) names, or None for raw input. A raw input's name with an
    '@' in it that names no version (`a@1.jsonl`) is raw input; one after a dataset dir is refused by open_dataset."""
    try:
        base = split_ref(path)[0]
    except VersionError:
        if path.endswith(SUFFIXES):
            return None
        raise
    p = Path(base)
    return p if p.is_dir() and ((p / MANIFEST_NAME).exists() or any(p.glob(SHARD_GLOB))) else None


def select(cfg: InspectConfig) -> tuple[list[InspectedSample | dict], TokenizerView]:
    """The first `limit` matching items in input order: samples, or reject entries (dicts)."""
    p = _built_dir(cfg.path)
    if p is not None:
        given = (["like"] if cfg.like is not None else []) + [k for k in RAW_OPTIONS if k in cfg.build_options]
        passed = ["--" + k.replace("_", "-") for k in given]
        if passed:
            raise InspectError(
                f"{', '.join(passed)}: only for raw input; {p} is a built dataset that carries "
                "the processor and options it was built with"
            )
        p, manifest = open_dataset(cfg.path)  # DIR, DIR@vN or DIR@TAG
        tv = TokenizerView.from_dir(processor_dir(p, manifest), manifest.processor.class_name)
        items = _iter_dir(cfg, p, manifest)
    else:
        if cfg.shard is not None:
            raise InspectError(f"--shard selects a shard of a built dir; {p} is raw input")
        from vlmprep.process import Renderer
        from vlmprep.processors.load import load_processor

        bcfg = _raw_build_config(cfg)
        processor = load_processor(bcfg.processor)
        if cfg.like is not None and bcfg.chat_template is None and "processor" not in cfg.build_options:
            _refuse_foreign_template(processor, cfg.like)
        tv = TokenizerView.from_processor(processor)
        items = _iter_raw(cfg, Renderer(bcfg, processor))
    out = []
    for item in items:
        out.append(item)
        if len(out) >= cfg.limit:
            break
    return out, tv


@dataclass
class InspectResult:
    """What inspect found: the samples' views, the rejects, and the HTML report's path when one was written."""

    samples: list[SampleView]
    rejects: list[dict]
    html: str | None = None


def run_inspect(cfg: InspectConfig, console=None) -> InspectResult:
    """Select, view and print (or write the HTML report); raises InspectError when no sample matches."""
    from rich.console import Console

    console = console or Console(highlight=False)
    items, tv = select(cfg)
    if not items and cfg.only == "truncated" and cfg.index is None and cfg.id is None:
        # Nothing cut is the good news --only truncated looks for, not a failed selection.
        console.print(f"no truncated sample in {cfg.path}" + (f" {cfg.shard}" if cfg.shard else ""), soft_wrap=True)
        return InspectResult([], [])
    if not items and cfg.only != "rejected":
        what = [
            f"{k} {v}"
            for k, v in (("--index", cfg.index), ("--id", cfg.id), ("--shard", cfg.shard), ("--only", cfg.only))
            if v is not None
        ]
        raise InspectError(f"no sample in {cfg.path} matches {' '.join(what) or 'the selection'}")
    views = [view_sample(x, tv) if isinstance(x, InspectedSample) else x for x in items]
    result = InspectResult([v for v in views if isinstance(v, SampleView)], [v for v in views if isinstance(v, dict)])
    if cfg.html:
        from vlmprep.tools.report import write_report

        write_report(Path(cfg.html), result.samples, result.rejects, title=f"vlmprep inspect {cfg.path}")
        result.html = cfg.html
        console.print(
            f"wrote {cfg.html}: {len(result.samples)} samples, {len(result.rejects)} rejects",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return result
    if not views:
        console.print(f"no rejected records in {cfg.path}", markup=False, highlight=False, soft_wrap=True)
    plain = not console.is_terminal
    for v in views:
        if isinstance(v, dict):
            console.print(for_terminal(reject_line(v)), markup=False, highlight=False, soft_wrap=True)
        elif plain:
            console.out(format_tokens_plain(v) if cfg.tokens else format_plain(v), end="", highlight=False)
        else:
            console.print(format_tokens_rich(v) if cfg.tokens else format_rich(v))
    return result

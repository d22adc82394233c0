"""Stats: a built dataset dir -> counts recomputed from the shards' arrays and meta, checked against the manifest, with
reject counts by reason, each input file's share (records, samples, rejects, turn coverage, truncation), the
distributions of tokens, trained tokens and images per sample and of image sizes and tokens per image, and the
warnings they call for; stats_text.py formats it as plain text (the CLI as JSON, stats_report.py as an HTML page)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Callable

import numpy as np

from vlmprep.config import FIELDS
from vlmprep.families import family_of
from vlmprep.ingest import as_input, input_names
from vlmprep.shards.format import storage_of
from vlmprep.shards.manifest import Manifest, open_dataset, shard_paths
from vlmprep.shards.reader import ShardFormatError, iter_shard
from vlmprep.shards.summary import (
    REJECT_FIXES,
    coverage_problem,
    dropped_by_cut,
    plural,
    reject_mismatches,
    rejected_records,
)
from vlmprep.shards.versions import added_since, dataset_rejects, manifest_number, rejects_paths, shard_version
from vlmprep.tools.distributions import distribution
from vlmprep.tools.per_shard import map_shards
from vlmprep.tools.stats_tables import SAMPLE_COLUMNS

# Warning thresholds. The build's --min-turn-coverage default, and its rule (shards/summary.coverage_problem): a dataset
# built with --min-turn-coverage 0 still says what it lost.
MIN_TURN_COVERAGE = FIELDS["min_turn_coverage"].default
TRUNCATED_SHARE_WARN = 0.10  # a larger share of samples cut at --seq-len
# An image over a quarter of --seq-len leaves little room for the trace around it (a tall page, a huge photo); the
# --max-pixels suggested caps one there, as the build's own fix line does.
IMAGE_SHARE_WARN = 4
IMAGE_TOKENS_WARN = 4096  # the limit where the manifest names no seq_len
MAX_INPUT_ROWS = 40  # the terminal lists at most this many input files (the lowest coverage first); --json has all
MAX_IMAGE_SIZES = 8  # the most common image sizes listed
COVERAGE_FIX = REJECT_FIXES["no_trainable_tokens_after_truncation"]


def _image_runs(types: np.ndarray) -> list[int]:
    """Tokens of each image in a dataset built before spans were recorded: the runs of tokens marked image."""
    idx = np.flatnonzero(types == 1)
    if not len(idx):
        return []
    breaks = np.flatnonzero(np.diff(idx) > 1)
    starts, ends = idx[np.r_[0, breaks + 1]], idx[np.r_[breaks, len(idx) - 1]] + 1
    return (ends - starts).tolist()


class _Scan:
    """What one pass over the shards collects: per-sample and per-image values, and per-input-file sample counts;
    with `rows`, each sample's row of SAMPLE_COLUMNS."""

    def __init__(self, image_limit: int, rows: bool = False):
        self.image_limit = image_limit
        self.rows: dict[str, list] | None = {c: [] for c in SAMPLE_COLUMNS} if rows else None
        self.tokens, self.trained, self.image_tokens, self.images = [], [], [], []
        self.truncated = self.dropped = self.split = 0
        self.videos = self.video_frames = self.video_tokens = self.dropped_videos = 0
        self.image_token_runs: list[int] = []
        self.sizes: collections.Counter = collections.Counter()  # (w, h) -> images
        self.sizes_are_source = True  # False once an image without a recorded source size is met (older datasets)
        self.large: list[dict] = []  # images over image_limit tokens
        # storage (shards/format.storage_of) -> stored images (each once a sample), their bytes, their sources' bytes
        self.storage: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def merge(self, other: "_Scan") -> None:
        """Adds another scan's values after this one's (the next shard's, in manifest order)."""
        for name in ("tokens", "trained", "image_tokens", "images", "image_token_runs", "large"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("truncated", "dropped", "split", "videos", "video_frames", "video_tokens", "dropped_videos"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sizes.update(other.sizes)
        self.sizes_are_source = self.sizes_are_source and other.sizes_are_source
        if self.rows is not None and other.rows is not None:
            for c in SAMPLE_COLUMNS:
                self.rows[c].extend(other.rows[c])
        for source, counts in other.by_file.items():
            self.by_file[source].update(counts)
        for storage, counts in other.storage.items():
            self.storage[storage].update(counts)

    def add(self, ts) -> None:
        meta = ts.meta()
        mask, types = ts.array("loss_mask"), ts.array("mm_token_type_ids")
        self.tokens.append(len(mask))
        self.trained.append(int(mask.sum()))
        self.image_tokens.append(int(meta.get("num_image_tokens", (types == 1).sum())))
        self.video_tokens += int((types == 2).sum())
        self.videos += int(meta.get("num_videos", 0))
        self.video_frames += sum(int(v["frames"]) for v in meta.get("videos", ()))
        self.dropped_videos += int(meta.get("dropped_videos", 0))
        self.images.append(len(ts.array("image_grid_thw").reshape(-1, 3)))
        self.truncated += bool(meta.get("truncated"))
        self.split += meta.get("split") is not None
        self.dropped += int(meta.get("dropped_images", 0))
        source = str((meta.get("source") or {}).get("file"))
        self.by_file[source].update(samples=1, tokens=len(mask))
        if self.rows is not None:
            r, src = self.rows, meta.get("source") or {}
            first = not r["shard"] or r["shard"][-1] != ts.where  # a scan's samples come shard by shard, in tar order
            values = {
                "id": meta.get("id"),
                "version": shard_version(ts.where),  # the version that added the sample: its shard's
                "source_file": source,
                "source_line": src.get("line"),
                "shard": ts.where,
                "shard_index": 0 if first else r["shard_index"][-1] + 1,
                "tokens": len(mask),
                "trained_tokens": self.trained[-1],
                "images": self.images[-1],
                "image_tokens": self.image_tokens[-1],
                "videos": int(meta.get("num_videos", 0)),
                "truncated": bool(meta.get("truncated")),
                "split_part": meta.get("split"),
                "dropped_images": int(meta.get("dropped_images", 0)),
            }
            for c in SAMPLE_COLUMNS:
                r[c].append(values[c])
        entries = meta.get("images") or []
        spans = [im.get("span") for im in entries]
        runs = [b - a for a, b in spans] if spans and None not in spans else _image_runs(types)  # older: marked runs
        self.image_token_runs += runs
        for member, im in {im["member"]: im for im in entries}.items():  # an image stored once a sample
            if member not in ts.sizes:  # a meta naming a member the sample lacks: refused as reading it would be
                raise ShardFormatError(
                    f"{ts.where}: sample {ts.key}: its meta names image member {member!r}, which it lacks"
                )
            given = im.get("source_bytes", 0)  # 0: a build that did not record it
            views = (im.get("views") or {}).get("member")  # a kept photo's views: stored beside it, counted with it
            if views is not None and views not in ts.sizes:
                raise ShardFormatError(
                    f"{ts.where}: sample {ts.key}: its meta names views member {views!r}, which it lacks"
                )
            self.storage[storage_of(member) + ("+views" if views else "")].update(
                images=1,
                bytes=ts.sizes[member] + (ts.sizes[views] if views else 0),
                source_bytes=given,
                unknown=not given,
            )
        for k, im in enumerate(entries):
            if "source_width" in im:
                size = (int(im["source_width"]), int(im["source_height"]))
            else:
                size, self.sizes_are_source = (int(im["width"]), int(im["height"])), False
            self.sizes[size] += 1
            if len(runs) == len(entries) and runs[k] > self.image_limit:
                self.large.append(
                    {
                        "tokens": runs[k],
                        "size": f"{size[0]}x{size[1]}",
                        "file": source,
                        "pixels_per_token": int(im["width"]) * int(im["height"]) / runs[k],
                    }
                )


def _scan_shard(job: tuple[list[Path], int, int, bool], k: int) -> _Scan:
    """The k-th shard's scan (job: the shard paths, the format version, the image token limit, whether rows)."""
    paths, version, image_limit, rows = job
    scan = _Scan(image_limit, rows)
    for ts in iter_shard(paths[k], version=version):
        scan.add(ts)
    return scan


def _scan_shards(scan: _Scan, paths: list[Path], version: int, *, workers: int, on_shard) -> None:
    """Every shard's scan merged into `scan` in manifest order, over `workers` processes."""
    job = (paths, version, scan.image_limit, scan.rows is not None)
    for part in map_shards(_scan_shard, job, len(paths), workers=workers, command="stats", on_shard=on_shard):
        scan.merge(part)


def compute_stats(
    root: Path,
    *,
    workers: int = 1,
    on_shard: Callable[[int, int], None] | None = None,
    sample_rows: dict[str, list] | None = None,
    since: str | None = None,
) -> dict:
    """A built dataset dir -> its statistics as a dict (what `vlmprep stats` prints and --json writes): counts of
    records, samples, tokens, trained tokens, images and videos, their distributions and histograms, image sizes,
    truncation and what it dropped, rejects, turn coverage, and warnings where the manifest and the shards disagree
    or images take most of the sequence. Reads every shard once (the manifest alone cannot say how tokens are
    distributed); `workers` > 1: in that many processes (tools/per_shard.py), each shard's scan merged in manifest
    order, so the result is the same for any value. `on_shard(done, total)`: called as each shard is done.
    `sample_rows`: a dict filled with each sample's row, column by column (SAMPLE_COLUMNS), in manifest order.
    `since` (vM or a tag): only what the versions after it added (shards/versions.added_since)."""
    root, manifest = open_dataset(root)  # DIR, DIR@vN or DIR@TAG
    number, before = manifest_number(manifest), 0
    if since is not None:
        before, manifest = added_since(root, manifest, since)
    config = manifest.config or {}
    seq_len = config.get("seq_len")
    # The dataset's own threshold (the build's --min-turn-coverage); a value that is not a share gives the default.
    floor = config.get("min_turn_coverage")
    floor = float(floor) if isinstance(floor, (int, float)) and 0 <= floor <= 1 else MIN_TURN_COVERAGE
    scan = _Scan(int(seq_len) // IMAGE_SHARE_WARN if seq_len else IMAGE_TOKENS_WARN, sample_rows is not None)
    _scan_shards(scan, shard_paths(root, manifest), manifest.format_version, workers=workers, on_shard=on_shard)
    tok, img = np.array(scan.tokens, dtype=np.int64), np.array(scan.images, dtype=np.int64)
    n = len(tok)
    rejects = {k: int(v) for k, v in sorted(manifest.rejects.items())}
    st = {
        "dir": str(root),
        "format_version": manifest.format_version,
        "image_format": manifest.image_format,
        "processor": manifest.processor.spec,
        "seq_len": seq_len,
        "shards": len(manifest.shards),
        "records": int(manifest.totals.get("records", n + sum(rejects.values()))),
        "unread_bytes": int(manifest.totals.get("unread_bytes", 0)),
        "samples": n,
        "tokens": int(tok.sum()),
        "trainable_tokens": int(sum(scan.trained)),
        "trainable_ratio": sum(scan.trained) / max(int(tok.sum()), 1),
        "image_tokens": int(sum(scan.image_tokens)),
        "images": int(img.sum()),
        "text_only_samples": int((img == 0).sum()),
        "tokens_per_sample": distribution(scan.tokens),
        "trained_tokens_per_sample": distribution(scan.trained),
        "images_per_sample": distribution(scan.images),
        "tokens_per_image": distribution(scan.image_token_runs),
        "image_sizes": _image_sizes(scan),
        "image_storage": _image_storage(scan),
        "large_images": _large_images(scan, manifest),
        "truncated_samples": scan.truncated,
        "dropped_images": scan.dropped,
        "videos": scan.videos,
        "video_frames": scan.video_frames,
        "video_tokens": scan.video_tokens,
        "dropped_videos": scan.dropped_videos,
        "rejected": sum(rejects.values()),  # reject lines: records, and turns lost as turn_too_long
        "rejected_records": sum(rejects.values()) - rejects.get("turn_too_long", 0),
        "rejects": rejects,
        "split_samples": scan.split,
        "turns": manifest.turns,  # per-record accounting, only the build can know it (input turns)
        "min_turn_coverage": floor,
        "coverage_warning": coverage_problem(manifest, floor) if manifest.turns is not None else None,
    }
    st["version"], st["since"] = number, before or None
    reject_lines = _reject_lines(root, manifest, before)
    st["inputs"] = _inputs(manifest, reject_lines)
    st["mismatches"] = _mismatches(manifest, st, reject_lines, scan.by_file)
    st["warnings"] = data_warnings(st)
    if sample_rows is not None:
        sample_rows.update(scan.rows)
    return st


def _image_storage(scan: _Scan) -> dict:
    """Per storage (shards/format.storage_of): stored images, their bytes, their sources' bytes, and how many of them
    have no source bytes recorded (`unknown`: older builds)."""
    keys = ("images", "bytes", "source_bytes", "unknown")
    return {k: {n: int(c[n]) for n in keys} for k, c in sorted(scan.storage.items())}


def _image_sizes(scan: _Scan) -> dict:
    """The distinct image sizes and the most common ones (source sizes where the build recorded them)."""
    return {
        "kind": "source" if scan.sizes_are_source else "stored",
        "distinct": len(scan.sizes),
        "top": [
            {"size": f"{w}x{h}", "count": c}
            for (w, h), c in sorted(scan.sizes.items(), key=lambda x: (-x[1], x[0]))[:MAX_IMAGE_SIZES]
        ],
    }


def _reject_lines(root: Path, manifest: Manifest, since: int = 0) -> list[dict] | None:
    """The reject lines of versions since+1 .. the manifest's (rejects.jsonl, then rejects.v00000N.jsonl ...)."""
    if not rejects_paths(root, manifest, since=since):
        return None
    return [r for _, r in dataset_rejects(root, manifest, since=since)]  # a rebuilt input's old lines left out


def _inputs(manifest: Manifest, reject_lines: list[dict] | None) -> list[dict] | None:
    """Each input file's counts (the manifest's per-input totals, rejects by reason from rejects.jsonl); None for a
    dataset built before the build recorded them."""
    inputs = manifest.inputs
    if not inputs or any(inp.totals is None for inp in inputs):
        return None
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in reject_lines or ():
        by_file[str((r.get("source") or {}).get("file"))][r.get("reason")] += 1
    out = []
    for inp, name in zip(inputs, input_names([as_input(inp.path) for inp in inputs])):
        t = collections.Counter(inp.totals)
        n_turns = t["input_assistant_turns"]
        out.append(
            {
                "path": inp.path,
                "name": name,
                "records": t["records"],
                "samples": t["samples"],
                "rejected": rejected_records(manifest, t, by_file[inp.path]["turn_too_long"] if reject_lines else None),
                "rejects": dict(sorted(by_file[inp.path].items())),
                "tokens": t["tokens"],
                "trainable_tokens": t["trainable_tokens"],
                "images": t["images"],
                "image_tokens": t["image_tokens"],
                "truncated_samples": t["truncated_samples"],
                "dropped_images": t["dropped_images"],
                "split_samples": t["split_samples"],
                "input_assistant_turns": n_turns,
                "trained_assistant_turns": t["trained_assistant_turns"],
                "coverage": t["trained_assistant_turns"] / n_turns if n_turns else 1.0,
                "kept_share": _kept_share(t),
                "turns_lost": {
                    "truncated": t["turns_lost_truncated"],
                    "turn_too_long": t["turns_lost_too_long"],
                    "not_trained_by_policy": t["turns_lost_policy"],
                    "record_rejected": t["turns_lost_rejected"],
                },
            }
        )
    return out


def _kept_share(t: collections.Counter) -> float:
    """Trained / (trained + lost to --seq-len): the share the --min-turn-coverage rule judges (shards/summary.py)."""
    to_train = t["trained_assistant_turns"] + t["turns_lost_truncated"] + t["turns_lost_too_long"]
    return t["trained_assistant_turns"] / to_train if to_train else 1.0


def _large_images(scan: _Scan, manifest: Manifest) -> dict:
    """Images over the scan's limit, the largest, and the --max-pixels that caps an image at that many tokens: the
    stored pixels per token of a grid family (patch^2 x merge^2) times the limit."""
    large = scan.large
    out = {"limit": scan.image_limit, "count": len(large), "largest": None, "max_pixels": None}
    if large:
        out["largest"] = {k: v for k, v in max(large, key=lambda x: x["tokens"]).items() if k != "pixels_per_token"}
        family = family_of(manifest.processor.class_name)
        if family is not None and family.grid_images:
            out["max_pixels"] = int(scan.image_limit * round(min(x["pixels_per_token"] for x in large)))
    return out


# The manifest totals the shards (rejected: rejects.jsonl) are recounted for.
_RECOUNTED = (
    "samples tokens trainable_tokens image_tokens images truncated_samples dropped_images videos "
    "video_tokens dropped_videos"
).split()


def _mismatches(manifest: Manifest, st: dict, reject_lines: list[dict] | None, by_file: dict) -> list[str]:
    """Where the manifest disagrees with what the shards (or rejects.jsonl) actually hold."""
    out = []
    totals = manifest.totals
    for key in _RECOUNTED:
        if key in totals and totals[key] != st[key]:
            out.append(f"manifest totals.{key}={totals[key]} but the shards give {st[key]}")
    out += reject_mismatches(manifest, lines=st["rejected"], records=st["rejected_records"])
    if reject_lines is not None:
        counted = collections.Counter(r.get("reason") for r in reject_lines)
        if dict(sorted(counted.items())) != st["rejects"]:
            out.append(f"rejects.jsonl counts {dict(sorted(counted.items()))} differ from the manifest {st['rejects']}")
    for inp in st["inputs"] or ():
        got = by_file.get(inp["path"], collections.Counter())
        for key in ("samples", "tokens"):
            if got[key] != inp[key]:
                out.append(f"manifest inputs[{inp['name']}].totals.{key}={inp[key]} but the shards give {got[key]}")
    return out


def data_warnings(st: dict) -> list[str]:
    """What in the numbers calls for a look, each with its fix: a tiny processor (never for real training), turn
    coverage under st['min_turn_coverage'] (the dataset's and each input file's), a truncated share over
    TRUNCATED_SHARE_WARN, images over a quarter of --seq-len."""
    out = [st["coverage_warning"]] if st.get("coverage_warning") else []
    if str(st.get("processor", "")).startswith("tiny:"):
        out.append(
            f"built with {st['processor']}: the family's classes over a small vocabulary, for trying it and "
            "for tests; its token ids are not the checkpoint's, never train a real model on it: rebuild with "
            "the checkpoint's processor (--processor DIR, or builtin:NAME where one exists)"
        )
    floor, inputs = st["min_turn_coverage"], st.get("inputs") or []
    # Per file where there are several (one file's line would repeat the dataset's), by the build's rule: the turns to
    # train that --seq-len lost (truncated, turn_too_long).
    low = sorted((i for i in inputs if i["kept_share"] < floor), key=lambda i: (i["kept_share"], i["name"]))
    low = low if sum(1 for i in inputs if i["input_assistant_turns"]) > 1 else []
    for i in low[:MAX_INPUT_ROWS]:
        out.append(
            f"{i['name']}: {i['trained_assistant_turns']} of {i['input_assistant_turns']} assistant turns "
            f"trained ({i['kept_share']:.1%} of those to train < {floor:g}; {i['truncated_samples']} of "
            f"{plural(i['samples'], 'sample')} truncated, {i['rejected']} rejected"
            + (": " + ", ".join(f"{r} {c}" for r, c in i["rejects"].items()) if i["rejects"] else "")
            + ")"
        )
    if len(low) > MAX_INPUT_ROWS:
        out.append(
            f"... and {len(low) - MAX_INPUT_ROWS} more input files under {floor:.0%} coverage (--json lists all)"
        )
    n, cut = st["samples"], st["truncated_samples"]
    if n and cut / n > TRUNCATED_SHARE_WARN:
        worst = sorted((i for i in inputs if i["truncated_samples"]), key=lambda i: -i["truncated_samples"])[:3]
        where = ", ".join(f"{i['name']} {i['truncated_samples']} of {i['samples']}" for i in worst)
        out.append(
            f"{cut} of {plural(n, 'sample')} truncated ({cut / n:.1%} > {TRUNCATED_SHARE_WARN:.0%}"
            + (f"; {where}" if where else "")
            + f"), {dropped_by_cut(st['dropped_images'], 0)}; "
            f"fix: {COVERAGE_FIX}"
        )
    large = st["large_images"]
    if large["count"]:
        big = large["largest"]
        fix = (
            f"--max-pixels {large['max_pixels']} caps an image at {large['limit']} tokens"
            if large["max_pixels"]
            else "lower --max-pixels (or the images' resolution)"
        )
        out.append(
            f"{plural(large['count'], 'image')} over {large['limit']} tokens (largest {big['tokens']}: "
            f"{big['size']} in {Path(big['file']).name}); fix: {fix}"
        )
    return out
